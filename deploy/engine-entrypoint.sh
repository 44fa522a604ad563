#!/bin/sh
# Start vLLM's OpenAI server with our BrokerConnector. Configuration comes from
# the environment (see docs/serving.md); extra arguments are passed to vLLM.
set -eu
: "${MODEL:?set MODEL to a model name or a mounted model directory}"
: "${ENGINE_ID:?set ENGINE_ID (unique per engine)}"
ROLE="${ROLE:-both}"
PORT="${PORT:-8000}"
BROKER_ADDRESS="${BROKER_ADDRESS:-broker:50051}"
ENGINE_URL="${ENGINE_URL:-http://${ENGINE_ID}:${PORT}}"
KV_RECOMPUTE_THRESHOLD="${KV_RECOMPUTE_THRESHOLD:-64}"
MULTI_TURN="${MULTI_TURN:-false}"
# Verified bytes (docs/data_path.md#verified-bytes): true on holders and readers alike.
VERIFY_BYTES="${VERIFY_BYTES:-false}"
BLOCK_SIZE="${BLOCK_SIZE:-32}"
# The tenant of this engine's identity (mutual TLS: KVBROKER_TLS_CA/CERT/KEY, read by the adapter).
TENANT="${TENANT:-}"
KV_CONFIG=$(cat <<JSON
{"kv_connector": "BrokerConnector", "kv_connector_module_path": "kvbroker.engine_adapter.connector",
 "kv_role": "kv_both",
 "kv_connector_extra_config": {"broker_address": "${BROKER_ADDRESS}", "engine_id": "${ENGINE_ID}",
   "role": "${ROLE}", "url": "${ENGINE_URL}", "kv_recompute_threshold": ${KV_RECOMPUTE_THRESHOLD},
   "multi_turn": ${MULTI_TURN}, "verify_bytes": ${VERIFY_BYTES}, "tenant": "${TENANT}"}}
JSON
)
# vLLM's own request spans go to the OTLP endpoint our spans go to, unless
# OTEL_TRACES_EXPORTER leaves OTLP out.
OTLP_TRACES="${OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:-${OTEL_EXPORTER_OTLP_ENDPOINT:-}}"
case ",${OTEL_TRACES_EXPORTER:-otlp}," in *,otlp,*) ;; *) OTLP_TRACES="" ;; esac
if [ -n "${OTLP_TRACES}" ]; then
  set -- --otlp-traces-endpoint "${OTLP_TRACES}" "$@"
fi
exec python3 -m vllm.entrypoints.openai.api_server --model "${MODEL}" --host 0.0.0.0 --port "${PORT}" \
  --block-size "${BLOCK_SIZE}" --kv-transfer-config "${KV_CONFIG}" ${VLLM_EXTRA_ARGS:-} "$@"

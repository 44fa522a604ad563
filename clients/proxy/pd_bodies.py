"""The bodies of the two P/D steps: P's one-token prefill that holds the prompt, D's request that reads it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Request keys that do not make sense for the one-token prefill call.
_PREFILL_DROP_KEYS = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "n", "best_of")


def prefill_body(
    body: Mapping[str, Any], trace_context: Mapping[str, str], reader_engine_id: str = ""
) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP_KEYS}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    if trace_context:
        params["trace_context"] = dict(trace_context)
    if reader_engine_id:
        # The decoder we plan to use: P's hold names it as the reader, so the
        # blocks are freed at once if that decoder dies.
        params["kvbroker"] = {"reader_engine_id": reader_engine_id}
    out["kv_transfer_params"] = params
    return out


def decode_body(
    body: Mapping[str, Any], params: Mapping[str, Any] | None, trace_context: Mapping[str, str]
) -> dict[str, Any]:
    out = dict(body)
    if params:
        merged = dict(params)
        if trace_context:
            merged["trace_context"] = dict(trace_context)
        out["kv_transfer_params"] = merged
    else:
        out.pop("kv_transfer_params", None)
    return out

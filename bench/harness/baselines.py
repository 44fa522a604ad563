"""What the benchmarks compare our P/D against, defined once: vLLM's own NixlConnector P/D.

Every benchmark that runs "NixlConnector" (bench/chats/compare.py, bench/chats/pd_compare.py,
bench/fleet/reclaim.py, bench/fleet/idle_hold.py) starts its engines with `nixl_engine()`, so
the name means one setup in every result table:

- vLLM's NixlConnector, `kv_role` kv_both, `kv_buffer_device` cpu (the CPU build's only
  choice), `bidirectional_kv_xfer` on (P may read a later turn's history back from D, the
  multi-turn pattern our P/D serves too), vLLM's defaults otherwise (`kv_lease_duration`
  30 s, heartbeats);
- its NIXL agent without NIXL's spinning progress thread (bench.harness.nixl_quiet), as
  our own adapter runs its agent, so neither side is measured by a thread that burns a core;
- vLLM's stats logged every 2 s (NixlConnector reports its transfers only in those lines,
  bench/chats/pd_results.py reads them);
- its own NIXL side-channel port on loopback (one per engine on one host).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvbroker.tools.launch import EngineProcess, engine_environment, free_port
from testkit.engines import BLOCK_SIZE
from testkit.processes import python_env

# In result JSON beside every NixlConnector figure.
NIXL_BASELINE = (
    "vLLM NixlConnector: kv_role kv_both, kv_buffer_device cpu, bidirectional_kv_xfer on, "
    "NIXL agent without its progress thread (bench.harness.nixl_quiet), vLLM defaults otherwise"
)
# vLLM 0.32's NixlConnector: its default kv_lease_duration, and what P logs when a lease runs out.
NIXL_DEFAULT_LEASE_S = 30
NIXL_RELEASE_LINE = "Releasing expired KV blocks"


def nixl_config(engine_id: str) -> dict[str, Any]:
    """The kv_transfer_config of one baseline engine."""
    return {
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "bench.harness.nixl_quiet",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True},
    }


def nixl_environment() -> dict[str, str]:
    """The engine environment with the source tree on PYTHONPATH (vLLM imports nixl_quiet from
    it) and a side-channel port of its own."""
    env = python_env(engine_environment())
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    env["VLLM_LOG_STATS_INTERVAL"] = "2"
    return env


def nixl_engine(model: Path, work: Path, name: str, **engine_args: Any) -> EngineProcess:
    """One baseline engine, not started; `engine_args` are EngineProcess's (block size, cache, ...)."""
    engine_args.setdefault("block_size", BLOCK_SIZE)
    return EngineProcess(
        model,
        name=name,
        kv_transfer_config=nixl_config(name),
        env=nixl_environment(),
        log_stats=True,
        log_path=work / f"{name}.log",
        **engine_args,
    )


# How a router drives the baseline's P/D (bench.chats.nixl_proxy for chats, bench.fleet.router
# for completions). Request keys that make no sense for the one-token prefill call:
PREFILL_DROP_KEYS = ("stream", "stream_options", "min_tokens", "logprobs", "top_logprobs", "n")


def prefill_request(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in PREFILL_DROP_KEYS}
    out["max_tokens"] = 1
    out.pop("max_completion_tokens", None)
    out["stream"] = False
    out["kv_transfer_params"] = dict(params)
    return out


def decode_request(body: Mapping[str, Any], params: Mapping[str, Any], stream: bool) -> dict[str, Any]:
    out = dict(body)
    out["kv_transfer_params"] = dict(params)
    out["stream"] = stream
    if not stream:
        out.pop("stream_options", None)
    return out

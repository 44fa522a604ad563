"""Shared parts of the engine benchmarks (turn-2 TTFT in bench/chats/, reclamation and idle holds in bench/fleet/).

Real processes only: a broker process, vLLM engines started by
`kvbroker.tools.launch.EngineProcess`, requests over HTTP with token-id prompts
(so a turn-2 prompt is token-identical to turn 1's prompt + answer and the
chained block hashes match).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.output import load_note, log
from kvbroker.tools.launch import EngineProcess, connector_config, pin_apart
from kvbroker.tools.tiny_model import build_tiny_model
from testkit.engines import (
    ACQUIRE_WAIT_MS,
    BLOCK_SIZE,
    RESOLVE_WAIT_MS,
    complete,
    completion_request,
    output_ids,
    prompt_of,
    read_stats,
    start_engine,
)
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for

# The request helpers are the e2e tests' own (testkit.engines), with their
# generous broker budgets: a starved session thread on a shared machine must not
# turn a pull into a recompute.
__all__ = [
    "BLOCK_SIZE",
    "BrokerPair",
    "add_run_arguments",
    "broker_engine",
    "broker_pair",
    "complete",
    "output_ids",
    "pin_pair",
    "prepare_workdir",
    "prompt_of",
    "read_stats",
    "stat",
    "stream_ttft",
    "summary",
    "wait_for",
]


def broker_engine(
    model_dir: Path,
    log_dir: Path,
    *,
    name: str,
    broker_address: str,
    role: str,
    max_model_len: int = 4096,
    session_ttl_ms: int = 5000,
    **extra: Any,
) -> tuple[EngineProcess, Path]:
    """Start (not wait for) an engine with our connector; returns it and its stats file.
    Failed loads are recomputed (kv_load_failure_policy=recompute)."""
    return start_engine(
        model_dir,
        log_dir,
        name=name,
        broker_address=broker_address,
        role=role,
        max_model_len=max_model_len,
        session_ttl_ms=session_ttl_ms,
        load_failure_policy="recompute",
        **extra,
    )


def broker_connector_config(
    broker_address: str, engine_id: str, role: str, stats_path: Path, **extra: Any
) -> dict[str, Any]:
    """Our connector's kv_transfer_config as the benchmarks that build their own engines run it:
    a 5 s session TTL, the test suite's lookup and lease budgets, counters in `stats_path`, and a
    failed load recomputed (kv_load_failure_policy=recompute)."""
    config = connector_config(
        broker_address=broker_address,
        engine_id=engine_id,
        role=role,
        session_ttl_ms=5000,
        resolve_wait_ms=RESOLVE_WAIT_MS,
        acquire_wait_ms=ACQUIRE_WAIT_MS,
        stats_path=str(stats_path),
        **extra,
    )
    config["kv_load_failure_policy"] = "recompute"
    return config


def pin_pair(p: EngineProcess, d: EngineProcess) -> None:
    """P's scheduler and worker on the first half of this process's cores, D's on the other half.

    Both P/D setups of the chat benchmarks (NixlConnector's and ours) get this; one-engine
    setups keep every core. In a deployment P and D have hardware of their own; on one
    small machine each engine would otherwise also pay for the other's busy-polling
    (EngineProcess.pin_engine_cpus)."""
    pin_apart([p, d], log)


@dataclass
class BrokerPair:
    """A broker and two engines with our connector, ready: what the turn-2 benchmarks measure on."""

    broker: BrokerProcess
    p: EngineProcess
    d: EngineProcess
    p_stats: Path
    d_stats: Path


@contextlib.contextmanager
def broker_pair(
    model: Path,
    work: Path,
    *,
    start_timeout_s: float,
    p: tuple[str, str, dict[str, Any]] = ("P", "prefill", {}),
    d: tuple[str, str, dict[str, Any]] = ("D", "decode", {"multi_turn": True}),
    pin: bool = True,
    **common: Any,
) -> Iterator[BrokerPair]:
    """Start a broker, then the two engines `p` and `d` (name, role, broker_engine options; `common`
    goes to both), wait until both serve, pin them apart (`pin`); stop all three on the way out.

    The one P/D-with-the-broker setup of bench/chats/multiturn_ttft.py, pull_policy.py and
    pd_compare.py (bench/chats/compare.py runs the real model behind our proxy: chats/setups.py)."""
    broker = BrokerProcess(work).start()
    engines: list[EngineProcess] = []
    try:
        started = []
        for name, role, options in (p, d):
            engine, stats = broker_engine(
                model, work, name=name, broker_address=broker.address, role=role, **common, **options
            )
            engines.append(engine)
            started.append((engine, stats))
        for engine in engines:
            engine.wait_ready(timeout=start_timeout_s, progress=log)
        if pin:
            pin_pair(engines[0], engines[1])
        (p_engine, p_stats), (d_engine, d_stats) = started
        yield BrokerPair(broker, p_engine, d_engine, p_stats, d_stats)
    finally:
        for engine in engines:
            engine.stop()
        broker.stop()


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags every engine benchmark takes: where to work, where results go, start-up patience."""
    ap.add_argument("--workdir", type=Path, default=None, help="model and logs (default: a new temp dir)")
    ap.add_argument(
        "--out-dir", type=Path, default=None, help="where JSON (and tables) go (default bench/results)"
    )
    ap.add_argument(
        "--start-timeout-s", type=float, default=400.0, help="how long an engine may take to start"
    )


def prepare_workdir(args: argparse.Namespace, prefix: str) -> tuple[Path, Path]:
    """The run's work dir (--workdir or a new temp dir) and the tiny model built in it."""
    work = args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work}; load average {load_note()}")
    return work, build_tiny_model(work / "model")


def stat(path: Path, key: str) -> int:
    # At once: reclaim times how soon a counter changes, so no settling wait here.
    return int(read_stats(path, settle=False).get(key, 0))


def stream_ttft(
    engine: EngineProcess,
    prompt: list[int],
    *,
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
    timeout: float = 300.0,
) -> tuple[float, list[int]]:
    """Streamed greedy completion: (seconds from sending to the first generated token, all token ids).

    Measured at the client, on loopback: includes HTTP, the scheduler's broker
    lookup, any KV pull, the prefill of what is not pulled, and the first step.
    """
    req = completion_request(
        engine,
        prompt,
        max_tokens=max_tokens,
        kv_transfer_params=kv_transfer_params,
        cache_salt=cache_salt,
        stream=True,
    )
    ids: list[int] = []
    ttft: float | None = None
    sent = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                new = choice.get("token_ids") or []
                if new and ttft is None:
                    ttft = time.perf_counter() - sent
                ids.extend(new)
    if ttft is None:
        raise RuntimeError(f"{engine.name}: the stream carried no token")
    return ttft, ids


def summary(xs: Sequence[float]) -> dict[str, Any]:
    """Median with the spread (min..max) and every value, in milliseconds."""
    ms = [x * 1000 for x in xs]
    return {
        "median_ms": round(statistics.median(ms), 2),
        "min_ms": round(min(ms), 2),
        "max_ms": round(max(ms), 2),
        "values_ms": [round(x, 2) for x in ms],
    }

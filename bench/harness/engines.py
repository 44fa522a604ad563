"""Shared parts of the engine benchmarks (multi-turn TTFT, lease reclamation).

Real processes only: a broker process, vLLM engines started by
`kvbroker.tools.launch.EngineProcess`, requests over HTTP with token-id prompts
(so a turn-2 prompt is token-identical to turn 1's prompt + answer and the
chained block hashes match).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.output import load_note, log
from kvbroker.tools.launch import EngineProcess
from kvbroker.tools.tiny_model import build_tiny_model
from testkit.engines import (
    BLOCK_SIZE,
    complete,
    completion_request,
    output_ids,
    prompt_of,
    read_stats,
    start_engine,
)
from testkit.waiting import wait_for

# The request helpers are the e2e tests' own (testkit.engines), with their
# generous broker budgets: a starved session thread on a shared machine must not
# turn a pull into a recompute.
__all__ = [
    "BLOCK_SIZE",
    "add_run_arguments",
    "broker_engine",
    "complete",
    "output_ids",
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

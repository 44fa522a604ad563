"""Shared parts of the engine benchmarks (multi-turn TTFT, lease reclamation).

Real processes only: a broker process, vLLM engines started by
`engine_adapter.launch.EngineProcess`, requests over HTTP with token-id prompts
(so a turn-2 prompt is token-identical to turn 1's prompt + answer and the
chained block hashes match).
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_adapter.launch import EngineProcess, connector_config

BLOCK_SIZE = 32
# Generous budgets: the machine is shared; a starved session thread must not
# turn a pull into a recompute (same reasoning as tests/e2e/harness.py).
RESOLVE_WAIT_MS = 3000
ACQUIRE_WAIT_MS = 5000


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
    """Start (not wait for) an engine with our connector; returns it and its stats file."""
    stats_path = log_dir / f"{name}-stats.json"
    config = connector_config(
        broker_address=broker_address,
        engine_id=name,
        role=role,
        session_ttl_ms=session_ttl_ms,
        resolve_wait_ms=RESOLVE_WAIT_MS,
        acquire_wait_ms=ACQUIRE_WAIT_MS,
        stats_path=str(stats_path),
        **extra,
    )
    config["kv_load_failure_policy"] = "recompute"
    engine = EngineProcess(
        model_dir,
        name=name,
        kv_transfer_config=config,
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        log_path=log_dir / f"{name}.log",
    )
    engine.start()
    return engine, stats_path


def read_stats(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def stat(path: Path, key: str) -> int:
    return int(read_stats(path).get(key, 0))


def wait_for(predicate: Any, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def prompt_of(length: int, seed: int) -> list[int]:
    """Deterministic token ids inside the tiny model's vocabulary (avoids special ids)."""
    return [10 + (seed * 7919 + i * 104729) % 400 for i in range(length)]


def _body(
    engine: EngineProcess,
    prompt: list[int],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None,
    cache_salt: str | None,
    stream: bool,
) -> bytes:
    body: dict[str, Any] = {
        "model": str(engine.model_dir),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return json.dumps(body).encode()


def complete(
    engine: EngineProcess,
    prompt: list[int],
    *,
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """A greedy, non-streamed /v1/completions call; returns the JSON answer."""
    req = urllib.request.Request(
        f"{engine.url}/v1/completions",
        data=_body(engine, prompt, max_tokens, kv_transfer_params, cache_salt, stream=False),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


def output_ids(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


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
    req = urllib.request.Request(
        f"{engine.url}/v1/completions",
        data=_body(engine, prompt, max_tokens, kv_transfer_params, cache_salt, stream=True),
        headers={"Content-Type": "application/json"},
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

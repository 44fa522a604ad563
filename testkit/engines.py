"""vLLM engines with our connector, and the HTTP helpers the end-to-end tests and the engine
benchmarks send requests with. Starting an engine needs the engine-side extra (vLLM, torch).
From a shell:

    .venv/bin/python -m testkit.engines   # starts broker + P + D, runs one P->D request
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from kvbroker.tools.launch import DEFAULT_KV_CACHE_BYTES, EngineProcess, connector_config
from testkit.processes import BrokerProcess

BLOCK_SIZE = 32
# Generous budgets: the tests share two cores with three engines (and maybe other
# test runs); a starved session thread must not turn a pull into a recompute.
SESSION_TTL_MS = 5000
RESOLVE_WAIT_MS = 3000
ACQUIRE_WAIT_MS = 5000


def start_engine(
    model_dir: Path,
    log_dir: Path,
    *,
    name: str,
    broker_address: str,
    role: str,
    env: dict[str, str] | None = None,
    max_model_len: int = 2048,
    session_ttl_ms: int = SESSION_TTL_MS,
    load_failure_policy: str = "",
    kv_cache_bytes: int | None = None,
    log_stats: bool = False,
    served_model_name: str | None = None,
    **extra: Any,
) -> tuple[EngineProcess, Path]:
    """Start (not wait for) an engine with our connector; returns it and its stats file.

    `env` replaces the engine's environment (default: `engine_environment()`);
    `load_failure_policy` sets vLLM's kv_load_failure_policy (default: vLLM's);
    `kv_cache_bytes` its KV cache size (default: the launcher's); `log_stats` turns on
    vLLM's stats, and with them the engine and connector series of its /metrics."""
    stats_path = log_dir / f"{name}-stats.json"
    # The fixed rule unless asked otherwise: tests and benchmarks that pull short
    # histories on the tiny model need the pull to happen (the adaptive policy
    # would rightly recompute them there).
    extra.setdefault("pull_policy", "threshold")
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
    if load_failure_policy:
        config["kv_load_failure_policy"] = load_failure_policy
    engine = EngineProcess(
        model_dir,
        name=name,
        kv_transfer_config=config,
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        served_model_name=served_model_name,
        log_path=log_dir / f"{name}.log",
        env=env,
        log_stats=log_stats,
        kv_cache_bytes=kv_cache_bytes or DEFAULT_KV_CACHE_BYTES,
    )
    engine.start()
    return engine, stats_path


def completion_request(
    engine: EngineProcess,
    prompt: list[int],
    *,
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
    stream: bool = False,
    include_usage: bool = False,
) -> urllib.request.Request:
    """A greedy /v1/completions request with a token-id prompt (streamed: with usage at the end if asked)."""
    body: dict[str, Any] = {
        "model": str(engine.model_dir),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if stream:
        body["stream"] = True
        if include_usage:
            body["stream_options"] = {"include_usage": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return urllib.request.Request(
        f"{engine.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )


def complete(
    engine: EngineProcess,
    prompt: list[int],
    *,
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """A greedy, non-streamed /v1/completions call; returns the JSON answer."""
    req = completion_request(
        engine, prompt, max_tokens=max_tokens, kv_transfer_params=kv_transfer_params, cache_salt=cache_salt
    )
    global _last_answer
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer = dict(json.loads(resp.read()))
    _last_answer = time.monotonic()
    return answer


def reset_prefix_cache(engine: EngineProcess, timeout: float = 30.0) -> None:
    """Empty the engine's local prefix cache (vLLM's dev endpoint: VLLM_SERVER_DEV_MODE=1)."""
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(f"{engine.url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            if json.loads(response.read() or b"{}").get("success", True):
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{engine.name}: reset_prefix_cache kept failing")
        time.sleep(0.2)  # blocks still in use by a finishing request


def output_ids(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def recompute_reference(engine: EngineProcess, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy output of one engine computing the prompt itself: a fresh cache_salt
    puts it in a namespace nobody holds, so neither the local prefix cache nor a
    pull can supply any of it."""
    answer = complete(engine, prompt, max_tokens=max_tokens, cache_salt=f"ref-{uuid.uuid4().hex}")
    return output_ids(answer)


# The engines write their stats file from a background thread (vLLM's
# scheduler loop does no file I/O), so the counters of a request may land a
# moment after its answer. read_stats gives the writers this long after the
# last answer `complete` saw before it reads; later reads do not wait.
STATS_SETTLE_S = 0.5
_last_answer = 0.0


def read_stats(path: Path, *, settle: bool = True) -> dict[str, Any]:
    """The engine's counters; settle=False reads at once (for timing how soon they change)."""
    wait_s = _last_answer + STATS_SETTLE_S - time.monotonic() if settle else 0.0
    if wait_s > 0:
        time.sleep(wait_s)
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def handover_blocks(length: int) -> int:
    """Blocks a decoder reads when P hands it a ``length``-token prompt: every block
    holding one of the first ``length - 1`` tokens (P holds the last, partial block
    too), so the decoder computes only the prompt's last token."""
    return -(-(length - 1) // BLOCK_SIZE)


def prompt_of(length: int, seed: int) -> list[int]:
    """Deterministic token ids inside the tiny model's vocabulary (avoids special ids)."""
    return [10 + (seed * 7919 + i * 104729) % 400 for i in range(length)]


if __name__ == "__main__":
    import tempfile

    from kvbroker.tools.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="kvbroker-e2e-"))
    model = build_tiny_model(work / "model")
    broker = BrokerProcess(work).start()
    p, p_stats = start_engine(model, work, name="P", broker_address=broker.address, role="prefill")
    d, d_stats = start_engine(model, work, name="D", broker_address=broker.address, role="decode")
    try:
        p.wait_ready(progress=print)
        d.wait_ready(progress=print)
        prompt = prompt_of(150, 1)
        first = complete(p, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        print("P answer kv_transfer_params:", first.get("kv_transfer_params"))
        second = complete(d, prompt, max_tokens=8, kv_transfer_params=first.get("kv_transfer_params"))
        print("D output:", output_ids(second))
        print("reference:", recompute_reference(d, prompt, 8))
        time.sleep(1)
        print("P stats:", read_stats(p_stats))
        print("D stats:", read_stats(d_stats))
    finally:
        p.stop()
        d.stop()
        broker.stop()
        print("logs in", work)

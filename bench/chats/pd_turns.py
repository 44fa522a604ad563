"""The three setups of bench.chats.pd_compare and how each serves one turn of a chat.

Each setup starts its engines (and for ours a broker), serves a warm-up chat and
then every (repetition, length) chat; a turn runner returns the turn's figures.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.baselines import nixl_engine
from bench.harness.engines import (
    BLOCK_SIZE,
    broker_pair,
    complete,
    output_ids,
    prompt_of,
    read_stats,
    stream_ttft,
)
from bench.harness.output import log
from kvbroker.tools.launch import EngineProcess

ANSWER_TOKENS = 8
# Per HTTP call: a P/D turn that has not answered by then is recorded as failed (see conversation()).
TURN_TIMEOUT_S = 60.0
NEW_TOKENS = 32
TURNS = 3
SETUPS = ("single", "nixl", "broker")


def timed_complete(engine: EngineProcess, prompt: list[int], **kw: Any) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    answer = complete(engine, prompt, timeout=TURN_TIMEOUT_S, **kw)
    return time.perf_counter() - start, answer


def _stream(engine: EngineProcess, prompt: list[int], **kw: Any) -> tuple[float, float, list[int]]:
    """(TTFT, whole-answer latency, token ids) of a streamed greedy answer."""
    start = time.perf_counter()
    ttft, ids = stream_ttft(engine, prompt, max_tokens=ANSWER_TOKENS, timeout=TURN_TIMEOUT_S, **kw)
    return ttft, time.perf_counter() - start, ids


# A turn runner returns {"ttft_s", "turn_s", "ids", ...}; state carries what the next turn needs.
TurnRunner = Callable[[list[int], int, dict[str, Any]], dict[str, Any]]


def single_turn(engine: EngineProcess) -> TurnRunner:
    def run(prompt: list[int], turn: int, state: dict[str, Any]) -> dict[str, Any]:
        ttft, total, ids = _stream(engine, prompt)
        return {"ttft_s": ttft, "turn_s": total, "ids": ids}

    return run


def nixl_turn(p: EngineProcess, d: EngineProcess) -> TurnRunner:
    def run(prompt: list[int], turn: int, state: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        # Turn 1: a plain P/D prefill. Later turns: D's returned params (do_remote_decode + D's
        # block ids) tell P where the history is: the bidirectional multi-turn pattern.
        p_params = state.get("d_params") or {"do_remote_decode": True}
        p_s, p_answer = timed_complete(p, prompt, max_tokens=1, kv_transfer_params=p_params)
        to_d = p_answer.get("kv_transfer_params")
        if not to_d:
            raise RuntimeError(f"NixlConnector P returned no kv_transfer_params: {p_answer}")
        row: dict[str, Any] = {"p_prefill_s": p_s, "p_read_back_offered": bool(state.get("d_params"))}
        if turn < TURNS:
            _, d_answer = timed_complete(d, prompt, max_tokens=ANSWER_TOKENS, kv_transfer_params=to_d)
            state["d_params"] = d_answer.get("kv_transfer_params")
            row.update(ttft_s=None, turn_s=time.perf_counter() - start, ids=output_ids(d_answer))
            row["d_returned_params"] = bool(state["d_params"])
        else:
            sent = time.perf_counter()
            ttft, ids = stream_ttft(
                d, prompt, max_tokens=ANSWER_TOKENS, kv_transfer_params=to_d, timeout=TURN_TIMEOUT_S
            )
            row.update(ttft_s=sent - start + ttft, turn_s=time.perf_counter() - start, ids=ids)
        return row

    return run


def broker_turn(p: EngineProcess, d: EngineProcess, p_stats: Path, d_stats: Path) -> TurnRunner:
    def pulled(path: Path) -> int:
        return int(read_stats(path).get("pulled_blocks", 0))

    def run(prompt: list[int], turn: int, state: dict[str, Any]) -> dict[str, Any]:
        p_before, d_before = pulled(p_stats), pulled(d_stats)
        start = time.perf_counter()
        p_params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "kvbroker": {"reader_engine_id": "D"},
        }
        p_s, p_answer = timed_complete(p, prompt, max_tokens=1, kv_transfer_params=p_params)
        to_d = p_answer.get("kv_transfer_params")
        if not to_d:
            raise RuntimeError(f"our P returned no kv_transfer_params: {p_answer}")
        sent = time.perf_counter()
        ttft, ids = stream_ttft(
            d, prompt, max_tokens=ANSWER_TOKENS, kv_transfer_params=to_d, timeout=TURN_TIMEOUT_S
        )
        row: dict[str, Any] = {"p_prefill_s": p_s, "ids": ids}
        row["turn_s"] = time.perf_counter() - start
        row["ttft_s"] = sent - start + ttft
        # The counters file is rewritten by each scheduler shortly after the step.
        time.sleep(0.3)
        row["p_pulled_tokens"] = (pulled(p_stats) - p_before) * BLOCK_SIZE
        row["d_pulled_tokens"] = (pulled(d_stats) - d_before) * BLOCK_SIZE
        return row

    return run


def conversation(run: TurnRunner, length: int, seed: int) -> list[dict[str, Any]]:
    """One 3-turn chat; a turn that fails or times out is recorded and ends the chat (its history is gone)."""
    prompt = prompt_of(length, seed)
    state: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for turn in range(1, TURNS + 1):
        started = time.perf_counter()
        try:
            row = run(prompt, turn, state)
        except Exception as e:
            failed = {"error": f"{type(e).__name__}: {e}", "failed_after_s": time.perf_counter() - started}
            log(f"L={length} seed {seed} turn {turn} failed: {failed['error']}")
            rows.append(
                {**failed, "turn": turn, "prompt_tokens": len(prompt), "length": length, "seed": seed}
            )
            return rows
        row.update(turn=turn, prompt_tokens=len(prompt), length=length, seed=seed)
        rows.append(row)
        prompt = prompt + row["ids"] + prompt_of(NEW_TOKENS, seed * 10 + turn)
    return rows


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f} ms"


def run_setup(
    name: str, model: Path, work: Path, lengths: list[int], reps: int, timeout: float
) -> dict[str, Any]:
    engines: list[EngineProcess] = []
    logs: dict[str, Path] = {}
    stack = contextlib.ExitStack()
    try:
        if name == "single":
            e = EngineProcess(model, name="S", block_size=BLOCK_SIZE, log_path=work / "S.log").start()
            engines = [e]
            runner = single_turn(e)
        elif name == "nixl":
            p, d = nixl_engine(model, work, "P-nixl").start(), nixl_engine(model, work, "D-nixl").start()
            engines = [p, d]
            runner = nixl_turn(p, d)
        else:
            # pd_compare has always run its P/D apart from the chat benchmarks' core pinning.
            pair = stack.enter_context(broker_pair(model, work, start_timeout_s=timeout, pin=False))
            engines = [pair.p, pair.d]
            runner = broker_turn(pair.p, pair.d, pair.p_stats, pair.d_stats)
        for e in engines:
            if name != "broker":  # broker_pair returned its engines ready
                e.wait_ready(timeout=timeout, progress=log)
            logs[e.name] = e.log_path
        conversation(runner, 256, seed=7)  # warm-up: first connections and prefills, not recorded
        rows: list[dict[str, Any]] = []
        for rep in range(reps):
            for length in lengths:
                rows += conversation(runner, length, seed=1000 + rep * 10 + lengths.index(length))
                last = [r for r in rows if r["seed"] == rows[-1]["seed"]]
                log(
                    f"{name} rep {rep} L={length}: "
                    + ", ".join(
                        f"t{r['turn']} FAILED"
                        if "error" in r
                        else f"t{r['turn']} ttft {_ms(r['ttft_s'])} turn {_ms(r['turn_s'])}"
                        for r in last
                    )
                )
        return {"available": True, "rows": rows, "logs": {k: str(v) for k, v in logs.items()}}
    except Exception as e:
        log(f"{name}: could not run: {e}")
        tails = {x.name: x.log_tail(15) for x in engines}
        return {"available": False, "reason": f"{type(e).__name__}: {e}", "log_tails": tails}
    finally:
        for x in engines:
            x.stop()
        stack.close()

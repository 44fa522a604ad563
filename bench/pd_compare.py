"""P/D transfer and multi-turn, side by side: one engine, vLLM's NixlConnector, our broker.

    .venv/bin/python -m bench.pd_compare [--lengths 256 1024 2048] [--reps 3] [--skip single nixl broker]

The same workload is served by three setups in turn (each setup's engines are
stopped before the next one starts; the machine is shared):

- **single**: one vLLM engine, no connector (its own prefix cache serves turns 2 and 3);
- **nixl**: P and D with vLLM's `NixlConnector` (`kv_buffer_device` "cpu",
  `bidirectional_kv_xfer` on). Per turn: P gets the prompt with
  `max_tokens 1` and `kv_transfer_params {"do_remote_decode": true}` (turn 1)
  or, from turn 2 on, D's `kv_transfer_params` from the previous turn (which
  carry `do_remote_decode` and D's block ids: P may read the history back from
  D); D then gets the prompt with P's returned `kv_transfer_params` and reads
  the prompt's KV from P. D's answer must be non-streamed on turns 1 and 2:
  vLLM returns `kv_transfer_params` only in a non-streamed answer, so those
  turns have no streamed TTFT (the table shows "n/a"; turn latency is measured
  for all);
- **broker**: a broker process, P and D with our `BrokerConnector` (D with
  `multi_turn` on). Per turn: P with `max_tokens 1` and
  `{"do_remote_decode": true, "do_remote_prefill": false, "kvbroker":
  {"reader_engine_id": "D"}}`, then D streamed with P's returned params (what
  `kvbroker.clients.proxy` does). P finds any history it lacks through the broker.

Workload: per prompt length L and repetition, a 3-turn conversation: turn 1 =
L token ids; turn k+1 = turn k's prompt + its greedy answer (ANSWER tokens) +
NEW fresh token ids. Every setup builds its own conversation from its own
answers; the answers of all setups are compared turn by turn ("identical").

Per setup and turn: TTFT (client-side, from sending the turn's first request to
the first streamed token of the answer; for P/D this includes P's prefill call)
and turn latency (until the whole answer), p50/p90 over repetitions; tokens
pulled (our connector: `stats_path` counters `pulled_blocks` of P and D per
turn; NixlConnector: totals per engine from its "KV Transfer metrics" log lines,
converted with the KV bytes per token, not per turn); transfer time (our
adapter's "read N blocks ... in T ms" log lines; NixlConnector's average and
p90 transfer time from its metrics lines).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import format_table, load_note, log, write_json
from bench.engines import (
    BLOCK_SIZE,
    add_run_arguments,
    broker_engine,
    complete,
    output_ids,
    prepare_workdir,
    prompt_of,
    read_stats,
    stream_ttft,
)
from kvbroker.testing.processes import BrokerProcess
from kvbroker.tools.launch import EngineProcess, engine_environment, free_port

ANSWER_TOKENS = 8
# Per HTTP call: a P/D turn that has not answered by then is recorded as failed (see conversation()).
TURN_TIMEOUT_S = 60.0
NEW_TOKENS = 32
TURNS = 3
SETUPS = ("single", "nixl", "broker")


class LoggingStatsEngine(EngineProcess):
    """An engine that keeps vLLM's periodic stats logging on: NixlConnector reports transfers only there."""

    def command(self) -> list[str]:
        return [a for a in super().command() if a != "--disable-log-stats"]


def nixl_engine(model: Path, work: Path, name: str) -> EngineProcess:
    env = engine_environment()
    # Each engine needs its own NIXL side channel (handshake) port on one host.
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    env["VLLM_LOG_STATS_INTERVAL"] = "2"
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "engine_id": name,
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True},
    }
    engine = LoggingStatsEngine(
        model,
        name=name,
        kv_transfer_config=config,
        block_size=BLOCK_SIZE,
        env=env,
        log_path=work / f"{name}.log",
    )
    engine.start()
    return engine


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


def pct(xs: list[float], q: int) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    return float(statistics.quantiles(xs, n=100, method="inclusive")[q - 1]) if q < 100 else xs[-1]


def p50_p90(xs: list[float | None]) -> dict[str, Any] | None:
    vals = [x * 1000 for x in xs if x is not None]
    if not vals:
        return None
    return {
        "p50_ms": round(pct(vals, 50), 1),
        "p90_ms": round(pct(vals, 90), 1),
        "values_ms": [round(v, 1) for v in vals],
    }


_OUR_READ = re.compile(r"kvbroker: request \S+: read (\d+) blocks \((\d+) bytes\) from \S+ in ([\d.]+) ms")
_NIXL_METRICS = re.compile(r"KV Transfer metrics: (.*)$", re.M)


def our_reads(log_path: Path) -> list[dict[str, float]]:
    return [
        {"blocks": int(b), "bytes": int(n), "ms": float(ms)}
        for b, n, ms in _OUR_READ.findall(log_path.read_text(errors="replace"))
    ]


def nixl_transfers(log_path: Path) -> dict[str, Any]:
    """Sum NixlConnector's periodic metrics lines: transfers, MB, time-weighted mean transfer ms."""
    n = 0
    mb = 0.0
    ms_sum = 0.0
    p90s = []
    for line in _NIXL_METRICS.findall(log_path.read_text(errors="replace")):
        fields = dict(re.findall(r"([A-Za-z][A-Za-z0-9 ()/]*?)=([\d.]+)", line))
        k = int(float(fields.get("Num successful transfers", 0)))
        if not k:
            continue
        n += k
        mb += k * float(fields.get("Avg MB per transfer", 0))
        ms_sum += k * float(fields.get("Avg xfer time (ms)", 0))
        p90s.append(float(fields.get("P90 xfer time (ms)", 0)))
    return {
        "transfers": n,
        "mb": round(mb, 3),
        "mean_xfer_ms": round(ms_sum / n, 2) if n else None,
        "max_interval_p90_xfer_ms": max(p90s) if p90s else None,
    }


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f} ms"


def run_setup(
    name: str, model: Path, work: Path, lengths: list[int], reps: int, timeout: float
) -> dict[str, Any]:
    engines: list[EngineProcess] = []
    broker: BrokerProcess | None = None
    logs: dict[str, Path] = {}
    try:
        if name == "single":
            e = EngineProcess(model, name="S", block_size=BLOCK_SIZE, log_path=work / "S.log").start()
            engines = [e]
            runner = single_turn(e)
        elif name == "nixl":
            p, d = nixl_engine(model, work, "P-nixl"), nixl_engine(model, work, "D-nixl")
            engines = [p, d]
            runner = nixl_turn(p, d)
        else:
            broker = BrokerProcess(work).start()
            p, p_stats = broker_engine(model, work, name="P", broker_address=broker.address, role="prefill")
            d, d_stats = broker_engine(
                model, work, name="D", broker_address=broker.address, role="decode", multi_turn=True
            )
            engines = [p, d]
            runner = broker_turn(p, d, p_stats, d_stats)
        for e in engines:
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
        if broker is not None:
            broker.stop()


def kv_bytes_per_token(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * 4  # K and V, float32


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip", action="append", default=[], choices=SETUPS)
    add_run_arguments(ap)
    args = ap.parse_args(argv)

    work, model = prepare_workdir(args, "kvbroker-pd-compare-")
    bpt = kv_bytes_per_token(model)
    setups: dict[str, Any] = {}
    for name in SETUPS:
        if name in args.skip:
            setups[name] = {"available": False, "reason": "skipped (--skip)"}
            continue
        log(f"setup {name}: starting")
        setups[name] = run_setup(name, model, work, args.lengths, args.reps, args.start_timeout_s)

    # Transfer figures from the logs.
    if setups.get("broker", {}).get("available"):
        lg = setups["broker"]["logs"]
        setups["broker"]["transfers"] = {k: our_reads(Path(v)) for k, v in lg.items()}
    if setups.get("nixl", {}).get("available"):
        t = {k: nixl_transfers(Path(v)) for k, v in setups["nixl"]["logs"].items()}
        for v in t.values():
            v["tokens"] = int(v["mb"] * 2**20 / bpt)
        setups["nixl"]["transfers"] = t

    # Identical tokens per prompt (length, rep) and turn across the setups that ran.
    ran = [n for n in SETUPS if setups[n].get("available")]
    identical: dict[str, Any] = {}
    by_key = {n: {(r["length"], r["seed"], r["turn"]): r.get("ids") for r in setups[n]["rows"]} for n in ran}
    if ran:
        for key in by_key[ran[0]]:
            answers = {n: by_key[n].get(key) for n in ran}
            present = [json.dumps(a) for a in answers.values() if a is not None]
            identical[f"L{key[0]} seed{key[1]} turn{key[2]}"] = {
                # Only answers that exist are compared; a failed turn is counted in "failed".
                "identical": len(present) == len(ran) and len(set(present)) == 1,
                "compared": [n for n, a in answers.items() if a is not None],
                "answers": answers,
            }

    table_rows = []
    per: dict[str, Any] = {}
    for n in ran:
        for length in args.lengths:
            for turn in range(1, TURNS + 1):
                every = [r for r in setups[n]["rows"] if r["length"] == length and r["turn"] == turn]
                rs = [r for r in every if "error" not in r]
                failed = len(every) - len(rs)
                if not rs:
                    per[f"{n} L{length} turn{turn}"] = {"failed": failed, "ok": 0}
                    table_rows.append(
                        [n, str(length), str(turn), "-", "all failed", "-", "-", "-", "-", str(failed)]
                    )
                    continue
                ttft = p50_p90([r["ttft_s"] for r in rs])
                turn_lat = p50_p90([r["turn_s"] for r in rs])
                if n == "broker":
                    pulled = "P {} / D {}".format(
                        "/".join(str(x) for x in sorted({r["p_pulled_tokens"] for r in rs})),
                        "/".join(str(x) for x in sorted({r["d_pulled_tokens"] for r in rs})),
                    )
                    computed = "/".join(
                        str(x) for x in sorted({r["prompt_tokens"] - r["p_pulled_tokens"] for r in rs})
                    )
                elif n == "nixl":
                    pulled, computed = "see totals", "n/a"
                else:
                    pulled, computed = "0", "prefix cache"
                same = all(
                    identical.get(f"L{length} seed{r['seed']} turn{turn}", {}).get("identical", False)
                    for r in rs
                )
                per[f"{n} L{length} turn{turn}"] = {
                    "prompt_tokens": sorted({r["prompt_tokens"] for r in rs}),
                    "ttft": ttft,
                    "turn_latency": turn_lat,
                    "tokens_pulled": pulled,
                    "tokens_computed_on_P": computed,
                    "identical_across_setups": same,
                    "ok": len(rs),
                    "failed": failed,
                }
                table_rows.append(
                    [
                        n,
                        str(length),
                        str(turn),
                        "/".join(str(x) for x in sorted({r["prompt_tokens"] for r in rs})),
                        f"{ttft['p50_ms']:.0f} / {ttft['p90_ms']:.0f}" if ttft else "n/a (non-streamed)",
                        f"{turn_lat['p50_ms']:.0f} / {turn_lat['p90_ms']:.0f}" if turn_lat else "-",
                        pulled,
                        computed,
                        "yes" if same else "NO",
                        str(failed),
                    ]
                )
    table = format_table(
        [
            "setup",
            "L",
            "turn",
            "prompt tok",
            "TTFT ms p50/p90",
            "turn ms p50/p90",
            "tokens pulled",
            "computed on P",
            "identical",
            "failed",
        ],
        table_rows,
    )
    lines = [
        f"P/D compare: {args.reps} repetitions, answer {ANSWER_TOKENS} tokens, {NEW_TOKENS} new tokens per turn;"
        f" machine shared, load {load_note()}",
        table,
    ]
    for n in SETUPS:
        if not setups[n].get("available"):
            lines.append(f"{n}: NOT RUN: {setups[n].get('reason')}")
    if "nixl" in ran:
        for eng, t in setups["nixl"]["transfers"].items():
            lines.append(
                f"nixl {eng} reads: {t['transfers']} transfers, {t['mb']} MB (~{t['tokens']} tokens),"
                f" mean {t['mean_xfer_ms']} ms, worst interval p90 {t['max_interval_p90_xfer_ms']} ms"
            )
    if "broker" in ran:
        for eng, reads in setups["broker"]["transfers"].items():
            if reads:
                ms = [r["ms"] for r in reads]
                lines.append(
                    f"broker {eng} reads: {len(reads)} NIXL reads, {sum(r['blocks'] for r in reads) * BLOCK_SIZE}"
                    f" tokens, p50 {pct(ms, 50):.1f} ms, p90 {pct(ms, 90):.1f} ms"
                )
            else:
                lines.append(f"broker {eng} reads: none logged")
    mismatches = [k for k, v in identical.items() if not v["identical"]]
    lines.append(
        f"identical tokens across {', '.join(ran)}: "
        + ("yes, every prompt" if not mismatches else f"NO for {len(mismatches)}: {', '.join(mismatches)}")
    )
    failures = [r for n in ran for r in setups[n]["rows"] if "error" in r]
    if failures:
        lines.append(
            f"failed turns (timeout {TURN_TIMEOUT_S:.0f} s per call; the chat ends there): {len(failures)}; "
            "their prompts are not compared (identical = NO where a setup has no answer)"
        )
    text = "\n".join(lines)
    print(text)
    for n in ran:
        for r in setups[n]["rows"]:
            r.pop("ids", None)
        # Log file names only: the work dir is a machine-specific temporary path.
        setups[n]["logs"] = {k: Path(v).name for k, v in setups[n]["logs"].items()}

    path = write_json(
        "pd_compare",
        {
            "settings": {
                "lengths": args.lengths,
                "reps": args.reps,
                "turns": TURNS,
                "answer_tokens": ANSWER_TOKENS,
                "new_tokens": NEW_TOKENS,
                "block_size": BLOCK_SIZE,
                "kv_bytes_per_token": bpt,
                "nixl_config": "NixlConnector, kv_buffer_device cpu, bidirectional_kv_xfer true, defaults otherwise",
                "broker_config": "BrokerConnector, D multi_turn true, kv_recompute_threshold default",
                "ttft": "client-side from the turn's first request to the first streamed answer token",
            },
            "setups": setups,
            "results": per,
            "identical": {k: v["identical"] for k, v in identical.items()},
            "answers": {k: v["answers"] for k, v in identical.items()},
            "table": text,
        },
        args.out_dir,
    )
    path.with_suffix(".txt").write_text(text + "\n")
    print(f"wrote {path}")
    return 0 if not mismatches else 1


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    log(f"done in {time.monotonic() - started:.0f} s")
    raise SystemExit(code)

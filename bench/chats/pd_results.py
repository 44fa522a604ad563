"""What bench.chats.pd_compare makes of the turns: percentiles, transfer figures from the
engines' logs, whether the setups answered alike, and the printed summary."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from bench.chats.pd_turns import ANSWER_TOKENS, NEW_TOKENS, SETUPS, TURN_TIMEOUT_S, TURNS
from bench.harness.engines import BLOCK_SIZE
from bench.harness.output import format_table, load_note


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


def add_transfers(setups: dict[str, Any], bpt: int) -> None:
    """Transfer figures from the logs of the setups that ran (NixlConnector's in tokens too)."""
    if setups.get("broker", {}).get("available"):
        lg = setups["broker"]["logs"]
        setups["broker"]["transfers"] = {k: our_reads(Path(v)) for k, v in lg.items()}
    if setups.get("nixl", {}).get("available"):
        t = {k: nixl_transfers(Path(v)) for k, v in setups["nixl"]["logs"].items()}
        for v in t.values():
            v["tokens"] = int(v["mb"] * 2**20 / bpt)
        setups["nixl"]["transfers"] = t


def compare_answers(setups: dict[str, Any], ran: list[str]) -> dict[str, Any]:
    """Identical tokens per prompt (length, rep) and turn across the setups that ran."""
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
    return identical


def per_turn(
    setups: dict[str, Any], ran: list[str], lengths: list[int], identical: dict[str, Any]
) -> tuple[dict[str, Any], list[list[str]]]:
    """Figures per setup, length and turn: the JSON's "results" and the table's rows."""
    table_rows = []
    per: dict[str, Any] = {}
    for n in ran:
        for length in lengths:
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
    return per, table_rows


def summary(
    setups: dict[str, Any], ran: list[str], table_rows: list[list[str]], identical: dict[str, Any], reps: int
) -> tuple[str, list[str]]:
    """The printed summary, and the prompts whose answers differ across setups."""
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
        f"P/D compare: {reps} repetitions, answer {ANSWER_TOKENS} tokens, {NEW_TOKENS} new tokens per turn;"
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
    return text, mismatches

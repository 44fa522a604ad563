"""Multi-turn chat: turn-2 time to first token with a KV pull versus a recompute.

    .venv/bin/python -m bench.chats.multiturn_ttft [--histories 256 1024 2048] [--reps 5]

Starts a broker process, a prefill engine P and a decode engine D (both vLLM,
the tiny random-weight model, our BrokerConnector; D with `multi_turn` on, so
it holds every finished conversation's prompt + answer under a broker lease).

Per repetition and history length H:

1. turn 1 goes to D: a prompt of H - ANSWER tokens, a greedy answer of ANSWER
   tokens; D then holds the (H - 1) computed tokens' full blocks;
2. turn 2 = turn 1 prompt + answer + NEW fresh tokens, as token ids, goes to P
   twice, in alternating order:
   - **pull**: as is. P has never seen the conversation; its adapter asks the
     broker, finds D holding the history, and NIXL-reads those blocks;
   - **recompute**: the same token ids with a fresh `cache_salt`: a namespace
     nobody holds, so neither P's prefix cache nor the broker can supply any
     block and P computes the whole prompt (same engine, same connector loaded).
   Both are streamed; TTFT is measured at the client (loopback HTTP).
3. the two answers must be identical token for token.

Tokens pulled come from P's connector counters (`stats_path`: `pulled_blocks`);
tokens recomputed = prompt length - tokens pulled. The adapter's own timings
come from P's log: the NIXL read (worker) and the whole pull as the scheduler
saw it (plan -> lease -> read -> release).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from bench.harness.engines import (
    BLOCK_SIZE,
    BrokerPair,
    add_run_arguments,
    broker_pair,
    complete,
    output_ids,
    prepare_workdir,
    prompt_of,
    stat,
    stream_ttft,
    summary,
    wait_for,
)
from bench.harness.output import format_table, load_note, log, write_json
from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import wire_chain
from kvbroker.v1 import broker_pb2 as pb

# P decides on its index mirror, which hears a hold about a millisecond after the
# broker does (bench/control_plane/compare.py, "mirror lag"); a generous margin.
MIRROR_SETTLE_S = 0.05
ANSWER_TOKENS = 32
NEW_TOKENS = 32
OUTPUT_TOKENS = 8


_ADAPTER_LINE = re.compile(
    r"kvbroker: request \S+: (read|pulled) (\d+) blocks \((\d+) bytes\) from D in ([\d.]+) ms"
)


def adapter_pull_times(p_log: Path) -> dict[int, dict[str, list[float]]]:
    """P adapter's own timings per pulled block count, from its log lines, in order.

    `read`: the NIXL read in the worker; `pulled`: what the scheduler saw from
    planning the pull to the released lease (acquire + read + release +
    scheduler steps in between).
    """
    out: dict[int, dict[str, list[float]]] = {}
    for m in _ADAPTER_LINE.finditer(p_log.read_text(errors="replace")):
        kind, blocks, _, ms = m.groups()
        out.setdefault(int(blocks), {"read": [], "pulled": []})[kind].append(float(ms) / 1000)
    return out


_PULLED_LINE = re.compile(r"kvbroker: request (\S+): pulled (\d+) blocks")
_TIMELINE_LINE = re.compile(r"kvbroker: request (\S+): pull timeline: (.*)$", re.M)
_PHASE = re.compile(r"(\w+) ([\d.]+) ms(?:/(\d+) steps?)?")
TIMELINE_COLUMNS = (
    "lookup",
    "allocate",
    "lease",
    "read",
    "release",
    "notice",
    "schedule",
    "prefill",
    "waiting",
)


def pull_timelines(p_log: Path) -> dict[int, list[dict[str, float]]]:
    """P's pull timelines (decision -> first token, pull_timeline.py) per pulled block count, in order.

    Each: phase -> ms, plus `<phase>_steps`, the broker's answer times and the worker's read."""
    text = p_log.read_text(errors="replace")
    blocks_of = {m.group(1): int(m.group(2)) for m in _PULLED_LINE.finditer(text)}
    out: dict[int, list[dict[str, float]]] = {}
    for m in _TIMELINE_LINE.finditer(text):
        entry: dict[str, float] = {}
        for name, ms, steps in _PHASE.findall(m.group(2)):
            entry[name] = float(ms)
            if steps:
                entry[f"{name}_steps"] = int(steps)
        if m.group(1) in blocks_of:
            out.setdefault(blocks_of[m.group(1)], []).append(entry)
    return out


def timeline_table(per_history: dict[str, Any]) -> str:
    rows = []
    for history, entry in per_history.items():
        t = entry.get("pull_timeline") or {}
        if not t:
            continue
        cells = []
        for name in TIMELINE_COLUMNS:
            ms = t.get(name)
            steps = t.get(f"{name}_steps")
            cells.append("-" if ms is None else f"{ms:.1f}" + ("" if steps is None else f" /{steps:g}"))
        rows.append([history, *cells, f"{entry['pull']['median_ms']:.1f}"])
    return format_table(
        [
            "history",
            *(f"{c} ms" + ("" if c == "waiting" else " /steps") for c in TIMELINE_COLUMNS),
            "TTFT pull ms",
        ],
        rows,
    )


def broker_names_holder(client: BrokerClient, holder: str, chain: list[int]) -> bool:
    """True once the broker's Resolve (what P's adapter asks) names `holder` for the whole chain under a hold."""
    layout = next((e.layout_id for e in client.list_engines().engines if e.engine_id == holder), "")
    answer = client.resolve(namespace=pb.Namespace(layout_id=layout, tenant=""), block_hashes=chain)
    return any(
        m.engine_id == holder and m.matched_blocks == len(chain) and m.hold_lease_id for m in answer.matches
    )


def one_conversation(
    p: Any, d: Any, p_stats: Path, client: BrokerClient, history: int, seed: int, pull_first: bool
) -> dict[str, Any]:
    turn1 = prompt_of(history - ANSWER_TOKENS, seed)
    answer1 = output_ids(complete(d, turn1, max_tokens=ANSWER_TOKENS))
    # D computed all but the answer's last token; its hold covers those tokens' full blocks.
    # Turn 2 goes out only once the broker knows: otherwise P would (rightly) find no holder.
    chain = wire_chain(turn1 + answer1[:-1], BLOCK_SIZE)
    if not wait_for(lambda: broker_names_holder(client, "D", chain), 15, 0.02):
        log(f"warning: the broker shows no hold by D of conversation {seed}")
    time.sleep(MIRROR_SETTLE_S)  # and P's index mirror has heard it too
    turn2 = turn1 + answer1 + prompt_of(NEW_TOKENS, seed + 100_000)

    result: dict[str, Any] = {"history": history, "prompt_tokens": len(turn2), "seed": seed}

    def pull() -> None:
        blocks_before = stat(p_stats, "pulled_blocks")
        failed_before = stat(p_stats, "pulls_failed")
        ttft, ids = stream_ttft(p, turn2, max_tokens=OUTPUT_TOKENS)
        # The counters file is rewritten by P's scheduler; give it a moment.
        wait_for(lambda: stat(p_stats, "pulled_blocks") > blocks_before, 2)
        pulled = (stat(p_stats, "pulled_blocks") - blocks_before) * BLOCK_SIZE
        result.update(
            pull_ttft_s=ttft,
            pull_ids=ids,
            tokens_pulled=pulled,
            tokens_computed_with_pull=len(turn2) - pulled,
            pulls_failed=stat(p_stats, "pulls_failed") - failed_before,
        )

    def recompute() -> None:
        ttft, ids = stream_ttft(
            p, turn2, max_tokens=OUTPUT_TOKENS, cache_salt=f"recompute-{uuid.uuid4().hex}"
        )
        result.update(recompute_ttft_s=ttft, recompute_ids=ids, tokens_computed_recompute=len(turn2))

    for step in (pull, recompute) if pull_first else (recompute, pull):
        step()
    result["identical"] = result["pull_ids"] == result["recompute_ids"]
    return result


def _med(s: dict[str, Any] | None) -> str:
    return f"{s['median_ms']:.1f}" if s else "-"


TABLE_HEADERS = [
    "history",
    "turn-2 prompt",
    "pulled tokens",
    "TTFT pull ms med (min..max)",
    "TTFT recompute ms med (min..max)",
    "recompute/pull",
    "P pull total ms",
    "NIXL read ms",
    "identical",
]


def run_conversations(pair: BrokerPair, histories: list[int], reps: int) -> list[dict[str, Any]]:
    """A warm-up conversation, then `reps` rounds over `histories`, pull first every other round."""
    client = BrokerClient(pair.broker.address)
    try:
        # Warm-up (not recorded): first NIXL connection P<-D, first prefills.
        one_conversation(pair.p, pair.d, pair.p_stats, client, 256, seed=1, pull_first=True)
        rows: list[dict[str, Any]] = []
        seed = 1000
        for rep in range(reps):
            for history in histories:
                seed += 1
                r = one_conversation(
                    pair.p, pair.d, pair.p_stats, client, history, seed, pull_first=rep % 2 == 0
                )
                log(
                    f"rep {rep} history {history}: pull {r['pull_ttft_s'] * 1000:.1f} ms "
                    f"({r['tokens_pulled']} tokens pulled), recompute {r['recompute_ttft_s'] * 1000:.1f} ms, "
                    f"identical={r['identical']}"
                )
                rows.append(r)
        return rows
    finally:
        client.close()


def p_timings(p_log: Path) -> tuple[dict[int, dict[str, list[float]]], dict[int, list[dict[str, float]]]]:
    """P's pull times and timelines by blocks pulled, without the unrecorded warm-up conversation."""
    timings = adapter_pull_times(p_log)
    timelines = pull_timelines(p_log)
    warmup_blocks = (256 - 1) // BLOCK_SIZE
    if warmup_blocks in timings:  # the unrecorded warm-up conversation pulled first
        for kind in ("read", "pulled"):
            timings[warmup_blocks][kind] = timings[warmup_blocks][kind][1:]
    if timelines.get(warmup_blocks):
        timelines[warmup_blocks] = timelines[warmup_blocks][1:]
    return timings, timelines


def history_entry(rs: list[dict[str, Any]], history: int, p_log_figures: Any) -> dict[str, Any]:
    """One history's figures: TTFT with a pull and a recompute, tokens, P's pull times and timeline."""
    timings, timelines = p_log_figures
    pull = summary([r["pull_ttft_s"] for r in rs])
    rec = summary([r["recompute_ttft_s"] for r in rs])
    entry = {
        "prompt_tokens": rs[0]["prompt_tokens"],
        "pull": pull,
        "recompute": rec,
        "speedup_median": round(rec["median_ms"] / pull["median_ms"], 2),
        "tokens_pulled": sorted({r["tokens_pulled"] for r in rs}),
        "tokens_computed_with_pull": sorted({r["tokens_computed_with_pull"] for r in rs}),
        "tokens_computed_recompute": rs[0]["tokens_computed_recompute"],
        "pulls_failed": sum(r["pulls_failed"] for r in rs),
        "identical_tokens": all(r["identical"] for r in rs),
    }
    t = timings.get((history - 1) // BLOCK_SIZE, {})
    entry["adapter_nixl_read"] = summary(t["read"]) if t.get("read") else None
    entry["adapter_pull_total"] = summary(t["pulled"]) if t.get("pulled") else None
    runs = timelines.get((history - 1) // BLOCK_SIZE, [])
    entry["pull_timeline"] = {
        key: round(statistics.median(r[key] for r in runs if key in r), 3)
        for key in sorted({k for r in runs for k in r})
    }
    entry["pull_timeline_runs"] = runs
    return entry


def table_row(history: int, entry: dict[str, Any]) -> list[str]:
    pull, rec = entry["pull"], entry["recompute"]
    return [
        str(history),
        str(entry["prompt_tokens"]),
        "/".join(map(str, entry["tokens_pulled"])),
        f"{pull['median_ms']:.1f} ({pull['min_ms']:.1f}..{pull['max_ms']:.1f})",
        f"{rec['median_ms']:.1f} ({rec['min_ms']:.1f}..{rec['max_ms']:.1f})",
        f"{entry['speedup_median']:.2f}x",
        _med(entry["adapter_pull_total"]),
        _med(entry["adapter_nixl_read"]),
        "yes" if entry["identical_tokens"] else "NO",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--histories", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--reps", type=int, default=10)
    add_run_arguments(ap)
    args = ap.parse_args(argv)

    work, model = prepare_workdir(args, "kvbroker-mt-bench-")
    # A low threshold is not needed: every history here is >= 224 pulled tokens.
    with broker_pair(model, work, start_timeout_s=args.start_timeout_s) as pair:
        rows = run_conversations(pair, args.histories, args.reps)
    figures = p_timings(pair.p.log_path)
    per_history = {
        str(h): history_entry([r for r in rows if r["history"] == h], h, figures) for h in args.histories
    }
    table = format_table(TABLE_HEADERS, [table_row(h, per_history[str(h)]) for h in args.histories])
    print(f"turn-2 time to first token on P, {args.reps} repetitions; machine shared, load {load_note()}")
    print(table)
    steps = timeline_table(per_history)
    print("P's pull, decision to first token (medians; /steps: scheduler steps the phase spanned; ")
    print("waiting = every phase but the read and the prefill):")
    print(steps)
    path = write_json(
        "multiturn_ttft",
        {
            "settings": {
                "histories": args.histories,
                "reps": args.reps,
                "answer_tokens": ANSWER_TOKENS,
                "new_tokens": NEW_TOKENS,
                "output_tokens": OUTPUT_TOKENS,
                "block_size": BLOCK_SIZE,
                "model": "tiny random-weight Llama (engine_adapter.tiny_model defaults), float32, vLLM CPU",
                "recompute_method": "same engine P, same token ids, fresh cache_salt (namespace nobody holds)",
                "ttft": "client-side, streamed /v1/completions over loopback HTTP",
            },
            "shared_machine": "other vLLM engines and test runs were using the same cores during the run",
            "results": per_history,
            "runs": rows,
            "table": table + "\n\npull timeline on P, medians (ms /scheduler steps):\n" + steps,
        },
        args.out_dir,
    )
    print(f"wrote {path}")
    ok = all(e["identical_tokens"] for e in per_history.values())
    return 0 if ok else 1


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    log(f"done in {time.monotonic() - started:.0f} s")
    raise SystemExit(code)

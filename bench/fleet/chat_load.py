"""Many real chats at once on the real model: P/D with the broker next to one engine alone.

    python -m bench.fleet.chat_load             # 8 conversations x 5 turns, answers up to 64 tokens
    python -m bench.fleet.chat_load --quick     # 4 x 3, 32 tokens (a few minutes)

Starts the demo's stack on SmolLM2-135M-Instruct (broker, prefill P, decode D
with multi_turn, proxy; tools/demo_stack.py), then runs the conversations, all
in flight at once, through the proxy, streamed, timing TTFT at the client. Each
question is about another passage of this repository's docs
(testkit.chat), so every turn's history holds the earlier questions and
the model's answers. Then the same conversations run on P alone (its own prefix
cache, a cache_salt nobody else uses) as the reference.

Prints per turn: prompt tokens, TTFT p50/p90 for both, history pulled by P from
D; and totals: requests failed, identical greedy tokens, wall time, turns/s and
output tokens/s, leases left active once the holds' TTL passed. Writes
bench/results/chat_load[-quick].json and .txt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.output import RESULTS_DIR, format_table, load_note, log, write_json
from kvbroker.tools.demo_stack import start_stack
from kvbroker.tools.launch import free_port
from testkit.chat import ConversationRun, doc_conversations, mismatches, run_conversations
from testkit.waiting import wait_for

HOLD_TTL_MS = 10000


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _stats(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _per_turn(runs: list[ConversationRun], turns: int) -> list[dict[str, Any]]:
    out = []
    for k in range(turns):
        answers = [r.turns[k].answer for r in runs if len(r.turns) > k and r.turns[k].answer]
        ttfts = [a.ttft_s * 1000 for a in answers if a and a.ttft_s is not None]
        out.append(
            {
                "turn": k + 1,
                "prompt_tokens_p50": statistics.median([len(a.prompt_token_ids) for a in answers if a])
                if answers
                else 0,
                "ttft_ms_p50": _pct(ttfts, 0.5),
                "ttft_ms_p90": _pct(ttfts, 0.9),
                "answers": len(answers),
            }
        )
    return out


def _totals(runs: list[ConversationRun], wall_s: float) -> dict[str, Any]:
    turns = [t for r in runs for t in r.turns]
    out_tokens = sum(len(t.answer.token_ids) for t in turns if t.answer)
    return {
        "requests": len(turns),
        "failed": sum(len(t.failures) for t in turns) + sum(1 for r in runs if r.error),
        "wall_s": round(wall_s, 2),
        "turns_per_s": round(len(turns) / wall_s, 3),
        "output_tokens_per_s": round(out_tokens / wall_s, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet.chat_load", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64, help="answer length cap (greedy, stops at EOS)")
    parser.add_argument("--words", type=int, default=120, help="words of doc passage per question")
    parser.add_argument("--quick", action="store_true", help="4 conversations x 3 turns, 32 tokens, 60 words")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.max_tokens, args.words = 4, 3, 32, 60
    name = "chat_load-quick" if args.quick else "chat_load"

    workdir = Path(tempfile.mkdtemp(prefix="kvbroker-chat-load-"))
    log(f"starting broker, P, D and proxy on the real model (logs in {workdir}) ...")
    with contextlib.redirect_stdout(sys.stderr):
        stack = start_stack(
            workdir,
            proxy_port=0,
            broker_port=free_port(),
            threshold=32,
            model="real",
            connector_extra={"hold_ttl_ms": HOLD_TTL_MS},
        )
    try:
        assert stack.prefill is not None
        convs = doc_conversations(args.conversations, args.turns, seed=5, words=args.words)
        kw: dict[str, Any] = {"model": stack.served_name, "max_tokens": args.max_tokens}
        before = {n: _stats(p) for n, p in stack.stats.items()}
        log(f"P/D: {len(convs)} conversations x {args.turns} turns, all at once, through the proxy ...")
        started = time.monotonic()
        pd_runs = run_conversations(stack.proxy_url, convs, retries=0, **kw)
        pd_wall = time.monotonic() - started
        time.sleep(1)
        after = {n: _stats(p) for n, p in stack.stats.items()}
        pulled = {
            n: int(after[n].get("pulled_blocks", 0)) - int(before[n].get("pulled_blocks", 0)) for n in after
        }
        log("one engine alone: the same conversations on P under a fresh cache_salt ...")
        started = time.monotonic()
        ref_runs = run_conversations(
            stack.prefill.url, convs, salt_prefix=f"ref-{time.time_ns()}", retries=0, **kw
        )
        ref_wall = time.monotonic() - started
        log(f"waiting (at most the holds' TTL, {HOLD_TTL_MS / 1000:.0f} s, + 6 s) for the leases to end ...")
        from kvbroker.clients.sync import BrokerClient

        with BrokerClient(stack.broker_address) as client:
            wait_for(lambda: not client.list_leases().leases, HOLD_TTL_MS / 1000 + 6, interval=0.5)
            active = len(client.list_leases().leases)
    finally:
        stack.stop()

    differ = mismatches(pd_runs, ref_runs)
    pd_turns, ref_turns = _per_turn(pd_runs, args.turns), _per_turn(ref_runs, args.turns)
    block = stack.prefill.block_size
    rows = [
        [
            str(p["turn"]),
            f"{p['prompt_tokens_p50']:.0f}",
            f"{p['ttft_ms_p50']:.0f} / {p['ttft_ms_p90']:.0f}",
            f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p90']:.0f}",
        ]
        for p, r in zip(pd_turns, ref_turns, strict=True)
    ]
    totals = {"pd": _totals(pd_runs, pd_wall), "single": _totals(ref_runs, ref_wall)}
    text = "\n".join(
        [
            f"Real-model chat load: {args.conversations} conversations x {args.turns} turns at once, answers "
            f"<= {args.max_tokens} tokens, questions on {args.words}-word doc passages; load {load_note()}",
            format_table(
                ["turn", "prompt tok p50", "TTFT ms P/D p50/p90", "TTFT ms one engine p50/p90"], rows
            ),
            format_table(
                ["setup", "requests", "failed", "wall s", "turns/s", "output tok/s"],
                [
                    [
                        k,
                        *(
                            str(t[f])
                            for f in ("requests", "failed", "wall_s", "turns_per_s", "output_tokens_per_s")
                        ),
                    ]
                    for k, t in totals.items()
                ],
            ),
            f"history pulled by P from D: {pulled.get('prefill-0', 0)} blocks ({pulled.get('prefill-0', 0) * block} "
            f"tokens); prompt blocks pulled by D from P: {pulled.get('decode-0', 0)}",
            f"identical greedy tokens, P/D vs one engine: {'yes, every turn' if not differ else 'NO: ' + '; '.join(differ)}",
            f"leases still active {HOLD_TTL_MS / 1000 + 6:.0f} s after the last turn, or when none was left "
            f"(hold TTL {HOLD_TTL_MS / 1000:.0f} s): {active}",
        ]
    )
    print(text)
    payload = {
        "mode": "quick" if args.quick else "full",
        # Where the results went is this machine's business, not the result's.
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"}
        | {"hold_ttl_ms": HOLD_TTL_MS, "model": "SmolLM2-135M-Instruct"},
        "per_turn": {"pd": pd_turns, "single": ref_turns},
        "totals": totals,
        "pulled_blocks": pulled,
        "block_size": block,
        "identical": not differ,
        "mismatches": differ,
        "leases_active_after_ttl": active,
        "load": load_note(),
    }
    path = write_json(name, payload, args.out_dir)
    (args.out_dir / f"{name}.txt").write_text(text + "\n")
    log(f"wrote {path}")
    return 0 if not differ and totals["pd"]["failed"] == 0 and active == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

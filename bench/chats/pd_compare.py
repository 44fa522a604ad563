"""P/D transfer and multi-turn, side by side: one engine, vLLM's NixlConnector, our broker.

    .venv/bin/python -m bench.chats.pd_compare [--lengths 256 1024 2048] [--reps 3] [--skip single nixl broker]

The same workload is served by three setups in turn (each setup's engines are
stopped before the next one starts; the machine is shared):

- **single**: one vLLM engine, no connector (its own prefix cache serves turns 2 and 3);
- **nixl**: P and D with vLLM's `NixlConnector` (the benchmarks' one baseline,
  bench.harness.baselines: `kv_buffer_device` "cpu", `bidirectional_kv_xfer` on). Per turn: P gets the prompt with
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
import time
from pathlib import Path
from typing import Any

from bench.chats.pd_results import add_transfers, compare_answers, per_turn, summary
from bench.chats.pd_turns import ANSWER_TOKENS, NEW_TOKENS, SETUPS, TURNS, run_setup
from bench.harness.baselines import NIXL_BASELINE
from bench.harness.engines import BLOCK_SIZE, add_run_arguments, prepare_workdir
from bench.harness.output import log, write_json


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

    add_transfers(setups, bpt)
    ran = [n for n in SETUPS if setups[n].get("available")]
    identical = compare_answers(setups, ran)
    per, table_rows = per_turn(setups, ran, args.lengths, identical)
    text, mismatches = summary(setups, ran, table_rows, identical, args.reps)
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
                "nixl_config": NIXL_BASELINE,
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

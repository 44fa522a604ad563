"""Turn-2 TTFT under four pull-or-recompute policies, on the tiny test model and on SmolLM2-135M.

    .venv/bin/python -m bench.chats.pull_policy [--models tiny smollm2] [--histories 32 ... 4096]
        [--reps 3] [--short-reps 9] [--busy-holder 8 --busy-models tiny]

Per model: one real broker, a holder H (multi_turn: it answers turn 1 and holds
the conversation's blocks) and a reader R with the default configuration
(pull_policy adaptive, nothing tuned). Each turn 2 names its policy in its
``kv_transfer_params`` (``kvbroker.pull_policy`` / ``kv_recompute_threshold``),
so the four policies run on the same engine under the same machine load:

- ``adaptive``: R's own policy (no override);
- ``always_pull``: the fixed rule with kv_recompute_threshold 0;
- ``always_recompute``: the fixed rule with a threshold no prompt reaches;
- ``threshold_64``: the fixed rule with its old default, 64 tokens.

For every history length, repetition and policy there is a new conversation
(turn 1 on H, then turn 2 = history + answer + new tokens on R) and the client
times turn 2's first token (streamed, loopback). The policies take turns in
a rotating order. Before measuring, R serves a warm-up (two unrelated prompts
and two conversations under each policy): what any engine has seen after a
few requests, and all that its cost model learns from.

Repetitions: ``--reps`` at every length, ``--short-reps`` at lengths up to
SHORT_HISTORY tokens. A short turn 2 takes 15-30 ms on the tiny model and
varies by a few ms from one request to the next, as much as the 10% the
target allows, so a median of three says more of the noise than of the
policy there; short conversations are cheap to repeat.

Busy holder (``--busy-holder N`` on ``--busy-models``): after the idle run,
the same engines run the four policies again while H serves N other
requests at all times (unrelated prompts, long answers), so every pull from
H is decided at the load H reports (N and up) and R's cost model learns
from pulls made at it. These rows are reported as model "NAME+busyN".

Target: adaptive within 10% of the better of always-pull and always-recompute
at every length on both models. Results: bench/results/pull_policy.json, .txt
and .png; the machine's load (uptime) is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.harness.engines import (
    add_run_arguments,
    broker_pair,
    complete,
    output_ids,
    read_stats,
    stat,
    stream_ttft,
    summary,
)
from bench.harness.output import RESULTS_DIR, format_table, load_note, log, write_json
from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import wire_chain
from kvbroker.tools.launch import EngineProcess
from kvbroker.v1 import broker_pb2 as pb
from testkit.engines import BLOCK_SIZE, prompt_of
from testkit.waiting import wait_for

POLICIES: dict[str, dict[str, Any]] = {
    "adaptive": {},
    "always_pull": {"pull_policy": "threshold", "kv_recompute_threshold": 0},
    "always_recompute": {"pull_policy": "threshold", "kv_recompute_threshold": 1 << 30},
    "threshold_64": {"pull_policy": "threshold", "kv_recompute_threshold": 64},
}
ANSWER_TOKENS = 16
NEW_TOKENS = 16
OUTPUT_TOKENS = 4
MAX_MODEL_LEN = 8192
TARGET = 1.10  # adaptive's median within 10% of the better fixed choice
SHORT_HISTORY = 512  # lengths up to this many tokens get --short-reps repetitions
BUSY_PROMPT_TOKENS = 64
BUSY_ANSWER_TOKENS = 2000
MIRROR_SETTLE_S = 0.3


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def held_by(client: BrokerClient, holder: str, chain: list[int]) -> bool:
    layout = next((e.layout_id for e in client.list_engines().engines if e.engine_id == holder), "")
    answer = client.resolve(namespace=pb.Namespace(layout_id=layout, tenant=""), block_hashes=chain)
    return any(
        m.engine_id == holder and m.matched_blocks == len(chain) and m.hold_lease_id for m in answer.matches
    )


def conversation(
    h: EngineProcess,
    reader: EngineProcess,
    stats: Path,
    client: BrokerClient,
    history: int,
    seed: int,
    policy: str,
) -> dict[str, Any]:
    """Turn 1 on H (held), turn 2 on the reader; its TTFT and how many tokens it pulled."""
    turn1 = prompt_of(history, seed)
    answer = output_ids(complete(h, turn1, max_tokens=ANSWER_TOKENS, timeout=600))
    chain = wire_chain(turn1 + answer[:-1], BLOCK_SIZE)
    if not wait_for(lambda: held_by(client, "H", chain), 15, 0.02):
        log(f"warning: the broker shows no hold by H of conversation {seed}")
    time.sleep(MIRROR_SETTLE_S)  # the reader's index mirror has heard it too
    turn2 = turn1 + answer + prompt_of(NEW_TOKENS, seed + 1_000_000)
    before = stat(stats, "pulled_blocks")
    params = {"kvbroker": POLICIES[policy]} if POLICIES[policy] else None
    ttft, _ = stream_ttft(reader, turn2, max_tokens=OUTPUT_TOKENS, kv_transfer_params=params, timeout=600)
    wait_for(lambda: stat(stats, "pulled_blocks") > before, 0.5)
    figures = read_stats(stats, settle=False).get("figures", {})
    return {
        "ttft_s": ttft,
        "pulled_tokens": (stat(stats, "pulled_blocks") - before) * BLOCK_SIZE,
        # What R's last decision weighed for its holder (the idle run: 0 or 1).
        "holder_load": figures.get("last_holder_load", 0.0),
        "pull_load_factor": figures.get("last_pull_load_factor", 1.0),
    }


@contextmanager
def busy(h: EngineProcess, streams: int) -> Iterator[None]:
    """H serves ``streams`` other requests at all times while the block runs."""
    stop = threading.Event()

    def serve(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                complete(
                    h,
                    prompt_of(BUSY_PROMPT_TOKENS, 5_000_000 + 1000 * i + n),
                    max_tokens=BUSY_ANSWER_TOKENS,
                    timeout=600,
                )
            except OSError as e:  # the engine stopping under us ends the load
                if not stop.is_set():
                    log(f"busy stream {i}: {e}")
                return

    threads = [threading.Thread(target=serve, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def measure(
    name: str,
    h: EngineProcess,
    r: EngineProcess,
    stats: Path,
    client: BrokerClient,
    args: argparse.Namespace,
    seed: int,
) -> tuple[list[dict[str, Any]], int]:
    """Every length, repetition and policy once, the policies in a rotating order."""
    rows: list[dict[str, Any]] = []
    order = list(POLICIES)
    for rep in range(max(args.reps, args.short_reps)):
        for history in args.histories:
            if rep >= (args.short_reps if history <= SHORT_HISTORY else args.reps):
                continue
            for i in range(len(order)):
                policy = order[(i + rep + history) % len(order)]
                seed += 1
                row = conversation(h, r, stats, client, history, seed, policy)
                row.update(model=name, policy=policy, history=history, rep=rep)
                rows.append(row)
                log(
                    f"{name} rep {rep} history {history} {policy}: {row['ttft_s'] * 1000:.1f} ms, "
                    f"pulled {row['pulled_tokens']} tokens, holder load {row['holder_load']}"
                )
    return rows, seed


def run_model(name: str, model: Path, work: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The idle run, and the busy-holder run when asked for: rows per run name."""
    kv = {"tiny": 256 << 20, "smollm2": 1 << 30}[name]
    log_dir = work / name
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = {}
    holder = ("H", "decode", {"multi_turn": True, "hold_ttl_ms": 15000, "kv_cache_bytes": kv * 2})
    # The product's defaults: adaptive, untuned (broker_engine would pin the fixed rule).
    reader = ("R", "both", {"kv_cache_bytes": kv, "pull_policy": "adaptive"})
    with broker_pair(
        model, log_dir, start_timeout_s=args.start_timeout_s, p=holder, d=reader, max_model_len=MAX_MODEL_LEN
    ) as pair:
        h, r, stats = pair.p, pair.d, pair.d_stats
        client = BrokerClient(pair.broker.address)
        seed = 1
        log(f"{name}: warm-up; load {load_note()}")
        for length in (512, 2048):
            complete(r, prompt_of(length, seed=900 + length), max_tokens=OUTPUT_TOKENS, timeout=600)
        for policy in POLICIES:
            for history in (256, 1024):
                seed += 1
                conversation(h, r, stats, client, history, seed, policy)
        rows, seed = measure(name, h, r, stats, client, args, seed)
        runs[name] = {"rows": rows}
        if args.busy_holder > 0 and name in args.busy_models:
            label = f"{name}+busy{args.busy_holder}"
            with busy(h, args.busy_holder):
                log(f"{label}: H serves {args.busy_holder} other requests; warm-up; load {load_note()}")
                for policy in POLICIES:
                    seed += 1
                    conversation(h, r, stats, client, 1024, seed, policy)
                runs[label] = {"rows": measure(label, h, r, stats, client, args, seed)[0]}
        final = _json_stats(stats)
        client.close()
    for run in runs.values():
        run["reader_stats"] = final
    return runs


def _json_stats(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def evaluate(rows: list[dict[str, Any]], histories: list[int]) -> dict[str, Any]:
    """Per history: each policy's TTFT summary, what adaptive pulled, and the 10% check."""
    out: dict[str, Any] = {}
    for history in histories:
        if any(not any(r["history"] == history and r["policy"] == p for r in rows) for p in POLICIES):
            continue  # a run stopped early: this length lacks a policy
        per = {
            p: summary([r["ttft_s"] for r in rows if r["history"] == history and r["policy"] == p])
            for p in POLICIES
        }
        best = min(per["always_pull"]["median_ms"], per["always_recompute"]["median_ms"])
        adaptive_pulled = sorted(
            {r["pulled_tokens"] for r in rows if r["history"] == history and r["policy"] == "adaptive"}
        )
        faster = (
            "pull" if per["always_pull"]["median_ms"] <= per["always_recompute"]["median_ms"] else "recompute"
        )
        choice = (
            "mixed"
            if len(adaptive_pulled) > 1
            else ("pull" if adaptive_pulled and adaptive_pulled[0] else "recompute")
        )
        loads = [
            float(r.get("holder_load", 0.0))
            for r in rows
            if r["history"] == history and r["policy"] == "adaptive"
        ]
        out[str(history)] = {
            "ttft": per,
            "reps": len(loads),
            # The holder load adaptive's decisions weighed (median; 0 before a decision names it).
            "adaptive_holder_load": sorted(loads)[len(loads) // 2] if loads else 0.0,
            "better_fixed_ms": best,
            "adaptive_pulled_tokens": adaptive_pulled,
            "adaptive_vs_better": round(per["adaptive"]["median_ms"] / best, 3),
            "threshold_64_vs_better": round(per["threshold_64"]["median_ms"] / best, 3),
            "adaptive_within_target": per["adaptive"]["median_ms"] <= TARGET * best,
            "threshold_64_within_target": per["threshold_64"]["median_ms"] <= TARGET * best,
            # Less noisy than TTFT ratios on a loaded machine: did adaptive take the quicker fixed choice?
            "faster_fixed": faster,
            "adaptive_choice": choice,
            "adaptive_chose_faster": choice == faster,
        }
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        per = results[name]["per_history"]
        xs = [int(h) for h in per]
        for policy, style in zip(POLICIES, ("o-", "s--", "^--", "x:"), strict=True):
            ax.plot(xs, [per[str(x)]["ttft"][policy]["median_ms"] for x in xs], style, label=policy)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("history (tokens)")
        ax.set_ylabel("turn-2 TTFT, median ms")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("Pull or recompute: turn-2 TTFT per policy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(
    results: dict[str, Any],
    args: argparse.Namespace,
    uptime_before: str,
    uptime_after: str,
    date_utc: str | None = None,
    stopped_early: str = "",
) -> None:
    """Print the tables, write the JSON, the text and the plot."""
    lines = []
    for name, res in results.items():
        table = [
            [
                h,
                *(f"{e['ttft'][p]['median_ms']:.1f}" for p in POLICIES),
                "/".join(map(str, e["adaptive_pulled_tokens"])),
                f"{e.get('adaptive_holder_load', 0.0):g}",
                f"{e['adaptive_choice']} / {e['faster_fixed']}",
                f"{e['adaptive_vs_better']:.2f}{'' if e['adaptive_within_target'] else ' MISS'}",
                f"{e['threshold_64_vs_better']:.2f}{'' if e['threshold_64_within_target'] else ' MISS'}",
            ]
            for h, e in res["per_history"].items()
        ]
        reps = sorted({e.get("reps", 0) for e in res["per_history"].values()})
        lines.append(
            f"{name}: turn-2 TTFT, median ms of {'/'.join(map(str, reps))} repetitions "
            f"(more at lengths up to {SHORT_HISTORY}; lengths every policy completed)"
        )
        lines.append(
            format_table(
                [
                    "history",
                    *POLICIES,
                    "adaptive pulled",
                    "holder load",
                    "adaptive chose / faster fixed",
                    "adaptive/better",
                    "threshold_64/better",
                ],
                table,
            )
        )
        hits = sum(e["adaptive_within_target"] for e in res["per_history"].values())
        fixed = sum(e["threshold_64_within_target"] for e in res["per_history"].values())
        chose = sum(e["adaptive_chose_faster"] for e in res["per_history"].values())
        lines.append(
            f"{name}: adaptive within 10% of the better fixed choice at {hits}/{len(table)} lengths "
            f"(threshold_64 at {fixed}/{len(table)}); adaptive took the faster fixed choice at "
            f"{chose}/{len(table)}\n"
        )
    lines.append(f"uptime before: {uptime_before}\nuptime after:  {uptime_after}")
    text = "\n".join(lines)
    print(text)
    out_dir = args.out_dir or RESULTS_DIR
    path = write_json(
        args.name,
        {
            "histories": args.histories,
            "reps": args.reps,
            "short_reps": args.short_reps,
            "short_history": SHORT_HISTORY,
            "busy_holder_requests": args.busy_holder,
            "policies": POLICIES,
            "answer_tokens": ANSWER_TOKENS,
            "new_tokens": NEW_TOKENS,
            "target": "adaptive median TTFT <= 1.10 x min(always_pull, always_recompute) at every length",
            "measured_utc": date_utc or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "uptime_before": uptime_before,
            "uptime_after": uptime_after,
            "stopped_early": stopped_early,
            "table": text,
            "results": results,
        },
        out_dir,
    )
    (out_dir / f"{args.name}.txt").write_text(text + "\n")
    try:
        plot(results, out_dir / f"{args.name}.png")
    except ImportError as e:
        log(f"no plot: {e}")
    log(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    ap.add_argument("--histories", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3, help="repetitions per length and policy")
    ap.add_argument(
        "--short-reps",
        type=int,
        default=9,
        help=f"repetitions at lengths up to {SHORT_HISTORY} tokens, where one is cheap and noise is large",
    )
    ap.add_argument(
        "--busy-holder", type=int, default=8, help="requests H serves meanwhile in the busy run (0: none)"
    )
    ap.add_argument(
        "--busy-models",
        nargs="*",
        default=["tiny"],
        choices=["tiny", "smollm2"],
        help="models with a busy run",
    )
    ap.add_argument("--name", default="pull_policy", help="results file name (bench/results/NAME.json)")
    add_run_arguments(ap)
    ap.add_argument(
        "--from-json", type=Path, default=None, help="rebuild the tables and plot from a saved run's rows"
    )
    args = ap.parse_args(argv)
    import tempfile

    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        args.histories, args.reps = saved["histories"], saved["reps"]
        args.short_reps = saved.get("short_reps", args.reps)
        rebuilt = {
            name: {**res, "per_history": evaluate(res["rows"], args.histories)}
            for name, res in saved["results"].items()
        }
        measured = saved.get("measured_utc") or saved.get("date_utc")
        report(
            rebuilt,
            args,
            saved["uptime_before"],
            saved["uptime_after"],
            date_utc=measured,
            stopped_early=saved.get("stopped_early", ""),
        )
        return 0

    from kvbroker.tools.real_model import ensure_real_model
    from kvbroker.tools.tiny_model import build_tiny_model

    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvbroker-pull-policy-"))
    work.mkdir(parents=True, exist_ok=True)
    uptime_before = uptime()
    log(f"work dir {work}; {uptime_before}")
    results: dict[str, Any] = {}
    for name in args.models:
        model = build_tiny_model(work / "tiny-model") if name == "tiny" else ensure_real_model(log=log)
        for label, run in run_model(name, model, work, args).items():
            results[label] = {"per_history": evaluate(run["rows"], args.histories), **run}
    report(results, args, uptime_before, uptime())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

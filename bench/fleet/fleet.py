"""Fleet benchmark: concurrent multi-turn agent sessions on N engines, one router per setup, several request rates.

    python -m bench.fleet.fleet                  # tiny model, 2 engines, every setup, rates 1,2,4,8 req/s
    python -m bench.fleet.fleet --quick          # tiny model, 24 sessions, rates 4,16 (a few minutes)
    python -m bench.fleet.fleet --model real --setups rr,prefix --rates 1,3    # SmolLM2-135M
    python -m bench.fleet.fleet --engines 4 --setups rr,prefix,ours-pd         # how routing scales

For each setup (bench/fleet/setups.py: rr, prefix, ours-pd, nixl-pd, ours-dp, ours-dp-learn) it starts
the engines (pinned apart: the same cores per engine in every setup) and the router,
then runs the same sessions (bench/fleet/agent_sessions.py) at each rate, every run under a
fresh cache_salt, and reports per setup and rate: goodput at the SLO, TTFT p50/p90/p99,
throughput, prefix reuse against the workload's ideal, tokens recomputed, tokens and
bytes pulled, failed requests; and per setup the leases left once the holds' TTL passed.
A setup that cannot run here is reported unavailable with the reason. Prints a table;
writes bench/results/fleet[-quick].json, .txt and .png (goodput and p90 TTFT against
rate). Definitions: bench/fleet/report.py and docs/bench.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.fleet import report
from bench.fleet.agent_sessions import Plan, WorkloadSpec, generate
from bench.fleet.driver import drive, warm_up
from bench.fleet.setups import HOLD_TTL_MS, SETUPS, Context, Running, Unavailable, prompt_sources, start
from bench.harness.engines import add_run_arguments
from bench.harness.output import RESULTS_DIR, load_note, log, write_json
from bench.harness.plot import matplotlib_missing

# The SLOs each model is judged by (TTFT ms, time per output token ms): the tiny model
# answers in milliseconds, SmolLM2-135M on one CPU core in tens of them.
SLO_DEFAULTS = {"tiny": (500.0, 50.0), "real": (3000.0, 300.0)}
QUICK = {"sessions": 24, "rates": "4,16", "hot_turns": 4, "think_s": 0.5}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    spec = WorkloadSpec()
    ap = argparse.ArgumentParser(
        prog="python -m bench.fleet.fleet",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument(
        "--rates",
        default=None,
        help=f"offered requests/s, comma-separated (default 1,2,4,8; --quick {QUICK['rates']})",
    )
    ap.add_argument("--engines", type=int, default=2, help="engines per setup (P/D: half P, half D)")
    ap.add_argument(
        "--model", choices=("tiny", "real"), default="tiny", help="tiny (built here) or SmolLM2-135M"
    )
    ap.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help=f"TTFT SLO of goodput (default per model: tiny {SLO_DEFAULTS['tiny'][0]:g}, "
        f"real {SLO_DEFAULTS['real'][0]:g})",
    )
    ap.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=None,
        help=f"time-per-output-token SLO of goodput, after the first token (default per model: tiny "
        f"{SLO_DEFAULTS['tiny'][1]:g}, real {SLO_DEFAULTS['real'][1]:g})",
    )
    for name, value in vars(spec).items():
        if name == "block_size":  # the engines' (32): not a workload knob
            continue
        kind = type(value)
        ap.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=None, help=f"workload (default {value})"
        )
    ap.add_argument(
        "--admit-per-engine",
        type=int,
        default=8,
        help="the -admit setups' proxy: at most this many requests run at once per engine "
        "(--admit-per-engine); their TTFT and TPOT goals are the run's SLOs",
    )
    ap.add_argument(
        "--admit-max-wait-s",
        type=float,
        default=60.0,
        help="the -admit setups' proxy: a request that has waited this long goes next (--admit-max-wait-s)",
    )
    ap.add_argument(
        "--admit-first-come",
        action="store_true",
        help="the -admit setups' proxy keeps the limit but lets waiting requests go first come, first "
        "served (--admit-ttft-goal-ms 0)",
    )
    ap.add_argument(
        "--admit-no-early-token",
        action="store_true",
        help="the -admit setups' proxy holds a request that can no longer meet the first-token goal "
        "whole, without sending its first token early (--no-admit-early-token)",
    )
    ap.add_argument("--request-timeout-s", type=float, default=300.0, help="one turn's limit at the client")
    ap.add_argument("--quick", action="store_true", help=f"fewer, shorter sessions: {QUICK}")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    ap.add_argument("--name", default="", help="result file name (default fleet, fleet-quick with --quick)")
    add_run_arguments(ap)
    return ap.parse_args(argv)


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    fields = {k: getattr(args, k) for k in vars(WorkloadSpec()) if getattr(args, k, None) is not None}
    if args.quick:
        fields = {k: v for k, v in QUICK.items() if k in vars(WorkloadSpec())} | fields
    return WorkloadSpec(**fields)


def kv_bytes_per_token(model: Path) -> int:
    """K and V of one token over every layer, float32 (what the engines run on CPU)."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(2 * cfg["num_hidden_layers"] * heads * head_dim * 4)


def model_dir(kind: str, work: Path) -> tuple[Path, str | None]:
    if kind == "real":
        from kvbroker.tools.real_model import ensure_real_model

        return ensure_real_model(log=log), "smollm2"
    from kvbroker.tools.tiny_model import build_tiny_model

    return build_tiny_model(work / "model"), None


def differing_sessions(
    outputs: dict[str, list[list[int]]], reference: dict[str, list[list[int]]]
) -> list[str]:
    """Sessions whose answers differ from the reference run's in any turn both completed."""
    out = []
    for sid, answers in outputs.items():
        ref = reference.get(sid, [])
        if any(a != b for a, b in zip(answers, ref, strict=False)):
            out.append(sid)
    return sorted(out)


def router_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The router's counts of one run (its /stats counts since it started)."""
    if "error" in before or "error" in after:
        return {"error": after.get("error") or before["error"]}
    out = dict(after)
    for counts in ("routed", "route_reasons", "admission_orders", "early_first_tokens"):
        if counts in after:
            earlier = before.get(counts, {})
            out[counts] = {k: v - earlier.get(k, 0) for k, v in after[counts].items()}
    for key in ("scored_hits", "score_errors", "score_calls", "score_ms_total"):
        if key in after:
            out[key] = round(after[key] - before.get(key, 0), 1)
    if out.get("score_calls"):
        out["score_ms_mean"] = round(out["score_ms_total"] / out["score_calls"], 2)
    return out


def run_setup(
    running: Running, plans: list[Plan], args: argparse.Namespace, ctx: Context, refs: dict[float, Any]
) -> list[dict[str, Any]]:
    warm_up(running.url, model=ctx.model_name, requests=2 * len(running.engines))
    runs = []
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000
    for plan in plans:
        salt = f"{running.name}-{plan.rate:g}-{time.time_ns()}"
        engines_before = running.engine_counts()
        connector = running.connector_stats()
        router_before = running.router_stats()
        log(
            f"{running.name} at {plan.rate:g} req/s: {len(plan.sessions)} sessions, {plan.requests} requests ..."
        )
        record = drive(running.url, plan, model=ctx.model_name, salt=salt, timeout_s=args.request_timeout_s)
        time.sleep(1.0)  # the connector writes its stats file from a background thread
        engines_after = running.engine_counts()
        summary = report.summarize(
            record,
            plan,
            slo_ttft_s=slo_ttft,
            slo_tpot_s=slo_tpot,
            sources=(prompt_sources(engines_before), prompt_sources(engines_after)),
            connector=(connector, running.connector_stats()),
            kv_bytes_per_token=kv_bytes_per_token(ctx.model),
        )
        ref = refs.setdefault(plan.rate, (running.name, record.outputs))
        summary["outputs_differ_from"] = ref[0]
        summary["sessions_differing"] = differing_sessions(record.outputs, ref[1])
        summary["router"] = router_delta(router_before, running.router_stats())
        summary["per_engine"] = report.per_engine(engines_before, engines_after)
        log(
            f"  goodput {summary['goodput_rps']}/s, TTFT p90 {summary['ttft_ms']['p90']} ms, "
            f"reuse {summary['prefix_reuse']:.0%} (ideal {summary['ideal_reuse']:.0%}), failed {summary['failed']}"
        )
        runs.append(summary)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rates is None:
        args.rates = str(QUICK["rates"]) if args.quick else "1,2,4,8"
    slo = SLO_DEFAULTS[args.model]
    args.slo_ttft_ms = args.slo_ttft_ms if args.slo_ttft_ms is not None else slo[0]
    args.slo_tpot_ms = args.slo_tpot_ms if args.slo_tpot_ms is not None else slo[1]
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        print(f"unknown setups {unknown}; of {SETUPS}", file=sys.stderr)
        return 2
    rates = [float(r) for r in args.rates.split(",")]
    spec = workload_spec(args)
    base = generate(spec)
    plans = [base.at_rate(r) for r in rates]
    name = args.name or ("fleet-quick" if args.quick else "fleet")
    out_dir = args.out_dir or RESULTS_DIR

    import tempfile

    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvbroker-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work}; load average {load_note()}")
    model, served = model_dir(args.model, work)
    ctx = Context(
        model,
        work,
        args.engines,
        args.start_timeout_s,
        served_name=served,
        admit_per_engine=args.admit_per_engine,
        admit_max_wait_s=args.admit_max_wait_s,
        admit_first_come=args.admit_first_come,
        admit_early_token=not args.admit_no_early_token,
        ttft_slo_ms=args.slo_ttft_ms,
        tpot_slo_ms=args.slo_tpot_ms,
    )
    results: dict[str, dict[str, Any]] = {}
    refs: dict[float, Any] = {}
    try:
        for setup in setups:
            try:
                running = start(setup, ctx)
            except Unavailable as e:
                log(f"{setup}: unavailable: {e}")
                results[setup] = {"unavailable": str(e)}
                continue
            try:
                runs = run_setup(running, plans, args, ctx, refs)
                wait_s = HOLD_TTL_MS / 1000 + 6
                leases = running.leases_active(wait_s)
                if runs:
                    runs[-1]["leases_left"] = leases
                results[setup] = {"runs": runs, "leases_left": leases}
            finally:
                running.stop()
    finally:
        ctx.release_shared()

    text = "\n".join(
        [
            f"Fleet: {spec.sessions} sessions ({spec.classes} agent classes, system prompt "
            f"{spec.system_tokens} tokens, {spec.hot_fraction:.0%} hot sessions of {spec.hot_turns} turns, others "
            f"{spec.cold_turns}), {args.engines} engines, model {args.model}; SLO: TTFT <= {args.slo_ttft_ms:g} ms "
            f"and time per output token <= {args.slo_tpot_ms:g} ms; load {load_note()}",
            report.table(results),
            f"ideal reuse for this workload: {base.ideal_reuse():.0%} of prompt tokens (a perfect fleet-wide cache)",
        ]
    )
    print(text)
    payload = {
        "mode": "quick" if args.quick else "full",
        # Where it worked is this machine's business: no paths in the record.
        "config": {k: v for k, v in vars(args).items() if k not in ("workdir", "out_dir")},
        "workload": vars(spec) | {"requests": base.requests, "ideal_reuse": round(base.ideal_reuse(), 4)},
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "rates": rates,
        "setups": results,
        "load": load_note(),
    }
    path = write_json(name, payload, out_dir)
    (out_dir / f"{name}.txt").write_text(text + "\n")
    log(f"wrote {path}")
    if not args.no_plot:
        missing = matplotlib_missing()
        png = (
            None
            if missing
            else report.plot(
                results,
                out_dir / f"{name}.png",
                f"bench.fleet: {args.engines} engines, {args.model} model, {spec.sessions} sessions",
                f"SLO: TTFT <= {args.slo_ttft_ms:g} ms, time per output token <= {args.slo_tpot_ms:g} ms; "
                f"load average {load_note()}",
            )
        )
        log(f"plot: {png or missing}")
    failed = sum(r["failed"] + r["not_sent"] for e in results.values() for r in e.get("runs", []))
    leases = sum(e.get("leases_left") or 0 for e in results.values())
    return 0 if failed == 0 and leases == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

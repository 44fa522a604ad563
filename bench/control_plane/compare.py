"""Control plane side by side: the broker against what a user would pick instead, in one run.

Starts everything it measures on loopback (a real broker process, a private
redis-server, a private mooncake_master, a grpc.aio echo server), runs the same
fixed workload on each (lookup of the longest held prefix of a 64-block chain at 1
and 16 concurrent clients; publishing 64-block chains; memory per indexed entry),
prints tables with medians and spread over repetitions, writes
bench/results/control_plane.json and renders control_plane.png.

    python -m bench.control_plane.compare            # full run (several minutes)
    python -m bench.control_plane.compare --quick    # smoke run (~2 minutes)

A peer that cannot run here is reported with the reason and left out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.control_plane.measure import Settings
from bench.control_plane.measure_broker import measure_broker
from bench.control_plane.measure_peers import measure_grpc_floors, measure_mooncake, measure_redis
from bench.control_plane.report import (
    lookup_table,
    memory_table,
    plot_lookup,
    publish_table,
    targets,
    targets_table,
    unavailable_lines,
)
from bench.harness.checks import exit_code, memcpy_gb_per_s, report_invalid, validate_results
from bench.harness.output import RESULTS_DIR, load_note, log, shared_cores_note, write_json
from bench.harness.plot import matplotlib_missing

PEERS = ("grpc", "redis", "mooncake", "broker")


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions (~2 minutes)")
    mode.add_argument(
        "--tiny", action="store_true", help="smoke-test sizes (seconds); the figures mean nothing"
    )
    p.add_argument(
        "--reps", type=int, default=None, help="repetitions of each measurement (median and spread)"
    )
    p.add_argument(
        "--engines", type=int, default=None, help="engines registered with the broker (default 1000)"
    )
    p.add_argument(
        "--out-dir", type=Path, default=RESULTS_DIR, help="where JSON and PNG go (default bench/results)"
    )
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary folder)")
    p.add_argument(
        "--broker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `python -m kvbroker.broker` (repeatable), e.g. --broker-arg=--max-hashes=100000",
    )
    p.add_argument(
        "--skip", action="append", default=[], choices=PEERS, help="leave a system out (repeatable)"
    )
    p.add_argument("--no-plot", action="store_true", help="do not render the PNG")


def settings_from(args: argparse.Namespace) -> Settings:
    s = Settings.tiny() if args.tiny else Settings.quick() if args.quick else Settings()
    if args.reps:
        s.reps = args.reps
    if args.engines:
        s.engines = args.engines
    s.broker_args = list(args.broker_arg)
    return s


def mode_name(args: argparse.Namespace) -> str:
    return "tiny" if args.tiny else "quick" if args.quick else "full"


def guarded(name: str, fn: Any, *a: Any, **kw: Any) -> dict[str, Any]:
    """Run one system's measurement; a system that fails to run is reported, not fatal."""
    try:
        return fn(*a, **kw)  # type: ignore[no-any-return]
    except Exception as e:
        log(f"{name} failed: {type(e).__name__}: {e}")
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}


def print_targets(results: dict[str, Any], conc: list[int], heading: str) -> list[dict[str, Any]]:
    """Print the target checks and what could not be measured; return the checks."""
    tgt = targets(results, hi_c=conc[-1])
    if tgt:
        print(heading)
        print(targets_table(tgt))
    missing = unavailable_lines(results)
    if missing:
        print("\nNot measured here:")
        print("\n".join(missing))
    return tgt


def check_figures(results: dict[str, Any]) -> dict[str, Any]:
    """Run the consistency checks (bench.harness.checks) on every figure, marking failures in place.

    Call before printing: the tables print failed figures as INVALID and the targets
    judged from them as "invalid". Returns what goes in the JSON as "checks".
    """
    invalid = validate_results(results)
    return {"memcpy_gb_per_s": memcpy_gb_per_s(), "invalid": invalid, "passed": not invalid}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    args = p.parse_args(argv)
    s = settings_from(args)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-control-plane-"))
    log(f"mode {mode_name(args)}; server logs in {log_dir}")

    results: dict[str, Any] = {}
    if "grpc" not in args.skip:
        results["grpc"] = guarded("grpc floors", measure_grpc_floors, s, log_dir)
    if "redis" not in args.skip:
        results["redis"] = guarded("Redis", measure_redis, s, log_dir)
    if "mooncake" not in args.skip:
        results["mooncake"] = guarded("Mooncake", measure_mooncake, s, log_dir)
    if "broker" not in args.skip:
        results["broker"] = guarded("broker", measure_broker, s, log_dir)

    conc = list(s.concurrency)
    checks = check_figures(results)
    tables = io.StringIO()
    with contextlib.redirect_stdout(tables):
        print(
            f"\nControl plane, side by side ({mode_name(args)} mode, {s.reps} repetitions; median [min..max])"
        )
        print(f"NOTE: {shared_cores_note()}; load average at the end: {load_note()}.\n")
        for table in (lookup_table(results, conc), publish_table(results, conc), memory_table(results)):
            if table:
                print(table + "\n")
        tgt = print_targets(results, conc, "The broker's targets, as ratios to the peers above:")
        print("\n" + report_invalid(checks["invalid"]))

    name = "control_plane" if not args.tiny else "control_plane-tiny"
    title = f"Lookup of a 64-block chain ({mode_name(args)} mode; bars: median, whiskers: min..max)"
    save_outputs(name, tables.getvalue(), args, s, results, tgt, conc, title, checks)
    return exit_code(checks["invalid"])


def save_outputs(
    name: str,
    tables: str,
    args: argparse.Namespace,
    s: Settings,
    results: dict[str, Any],
    tgt: Any,
    conc: list[int],
    title: str,
    checks: dict[str, Any],
) -> None:
    """Print the tables, then write them (.txt), the JSON and the PNG under args.out_dir."""
    print(tables, end="")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.txt").write_text(tables)
    path = write_json(
        name,
        {
            "mode": mode_name(args),
            "settings": _settings_json(s),
            "results": results,
            "targets": tgt,
            "checks": checks,
        },
        args.out_dir,
    )
    print(f"\nJSON: {path}")
    if args.no_plot:
        return
    why = matplotlib_missing()
    if why:
        print(f"PNG: skipped: {why}")
        return
    png = plot_lookup(results, conc, args.out_dir / f"{name}.png", title, shared_cores_note())
    print(f"PNG: {png}")


def _settings_json(s: Settings) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(s)


if __name__ == "__main__":
    sys.exit(main())

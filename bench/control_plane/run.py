"""What the control-plane programs (compare, broker) share: their flags, settings, the guard
around each system's measurement, the consistency checks, the targets and the outputs."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from bench.control_plane.measure import Settings
from bench.control_plane.report import plot_lookup, targets, targets_table, unavailable_lines
from bench.harness.checks import memcpy_gb_per_s, validate_results
from bench.harness.output import RESULTS_DIR, log, shared_cores_note, write_json
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


def start(
    description: str | None, argv: list[str] | None, prefix: str
) -> tuple[argparse.Namespace, Settings, Path]:
    """A control-plane benchmark's start: the common arguments parsed, its settings, and the
    folder for its servers' logs (--log-dir, or a new temp folder whose name starts with `prefix`), logged."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    args = p.parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix=prefix))
    log(f"mode {mode_name(args)}; server logs in {log_dir}")
    return args, settings_from(args), log_dir


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

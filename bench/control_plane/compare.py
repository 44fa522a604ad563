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

import contextlib
import io
import sys
from typing import Any

from bench.control_plane.measure_broker import measure_broker
from bench.control_plane.measure_peers import measure_grpc_floors, measure_mooncake, measure_redis
from bench.control_plane.report import (
    lookup_table,
    memory_table,
    publish_table,
)
from bench.control_plane.run import (
    check_figures,
    guarded,
    mode_name,
    print_targets,
    save_outputs,
    start,
)
from bench.harness.checks import exit_code, report_invalid
from bench.harness.output import load_note, shared_cores_note


def main(argv: list[str] | None = None) -> int:
    args, s, log_dir = start(__doc__, argv, "bench-control-plane-")

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


if __name__ == "__main__":
    sys.exit(main())

"""The broker's own figures, with the ratios to the peers its targets are held against.

Starts a real broker process (``python -m kvbroker.broker``), registers 1,000 engines over
real session streams, loads the index to 1M and 10M random blocks through those
sessions, and measures for a 64-block chain: resolve latency p50/p99 with 1 and 16
concurrent clients over the session stream (the engine path) and over unary
Resolve, resolves per second, inventory updates (blocks/s) over sessions, and the
broker's memory per indexed block (RSS delta / blocks). It also measures the index
alone in a fresh process, and, in the same run, the peers the targets are ratios
to: Mooncake's ``batch_is_exist`` and Redis ``MGET`` / pipelined ``SET PX``.

    python -m bench.control_plane.broker            # full run (1M and 10M blocks; several minutes)
    python -m bench.control_plane.broker --quick    # smoke run (~2 minutes; 200k and 1M blocks)

Writes bench/results/broker_bench.json and broker_bench.png.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from typing import Any

from bench.control_plane.measure import Settings
from bench.control_plane.measure_broker import measure_broker
from bench.control_plane.measure_peers import measure_mooncake, measure_redis
from bench.control_plane.report import broker_table, memory_table
from bench.control_plane.run import (
    check_figures,
    guarded,
    mode_name,
    print_targets,
    save_outputs,
    start,
)
from bench.harness.checks import exit_code, report_invalid
from bench.harness.output import REPO_ROOT, load_note, shared_cores_note
from testkit.processes import python_env


def measure_index_alone(s: Settings) -> dict[str, Any]:
    """bench.control_plane.index_memory in a fresh child process (so its RSS is the index's)."""
    sizes = ",".join(str(n) for n in s.broker_mem_blocks)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.control_plane.index_memory",
            "--blocks",
            sizes,
            "--engines",
            str(s.engines),
        ],
        cwd=str(REPO_ROOT),
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if out.returncode != 0:
        return {"available": False, "reason": f"index_memory exited {out.returncode}: {out.stderr[-2000:]}"}
    return {"available": True, **json.loads(out.stdout)}


def main(argv: list[str] | None = None) -> int:
    args, s, log_dir = start(__doc__, argv, "bench-broker-")

    results: dict[str, Any] = {}
    if "broker" not in args.skip:
        results["broker"] = guarded("broker", measure_broker, s, log_dir)
        results["index_inprocess"] = guarded("index alone", measure_index_alone, s)
    if "mooncake" not in args.skip:
        results["mooncake"] = guarded("Mooncake", measure_mooncake, s, log_dir, with_memory=False)
    if "redis" not in args.skip:
        results["redis"] = guarded("Redis", measure_redis, s, log_dir, with_lua=False, with_memory=False)

    conc = list(s.concurrency)
    checks = check_figures(results)
    tables = io.StringIO()
    with contextlib.redirect_stdout(tables):
        print(f"\nBroker figures ({mode_name(args)} mode, {s.reps} repetitions; median [min..max])")
        print(f"NOTE: {shared_cores_note()}; load average at the end: {load_note()}.")
        broker = results.get("broker") or {}
        if broker.get("available"):
            print(f"Engines: {broker['engines']['how']}.\n")
        for table in (broker_table(results, conc), memory_table(results)):
            if table:
                print(table + "\n")
        inproc = results.get("index_inprocess") or {}
        if inproc.get("available"):
            print(
                f"In-process index lookup of a held 64-block chain (no RPC): p50 {inproc['lookup_64_p50_us']:.1f} us, "
                f"p99 {inproc['lookup_64_p99_us']:.1f} us\n"
            )
        tgt = print_targets(results, conc, "Targets, as ratios to the peers measured in this run:")
        print("\n" + report_invalid(checks["invalid"]))

    name = "broker_bench" if not args.tiny else "broker_bench-tiny"
    title = f"Broker resolve vs the peers of its targets ({mode_name(args)} mode; median, min..max)"
    save_outputs(name, tables.getvalue(), args, s, results, tgt, conc, title, checks)
    return exit_code(checks["invalid"])


if __name__ == "__main__":
    sys.exit(main())

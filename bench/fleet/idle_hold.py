"""CPU an engine uses while it holds KV blocks for a reader and has nothing else to do.

    .venv/bin/python -m bench.fleet.idle_hold [--window-s 10] [--skip-nixl]

An engine that keeps a finished request's blocks for a reader (P for D, or D
for the next turn) must idle like an engine with no requests: on a GPU host a
spinning engine burns a CPU core for as long as conversations are held.

One vLLM engine at a time (tiny random-weight model, CPU build), measured over
three windows of --window-s seconds each, each starting 2 s after the engine's
last request (vLLM's workers busy-poll for about a second after a message);
CPU is user + system time of every process of the engine (API server, engine
core, workers) from /proc, divided by the window, so 1.00 is one whole core:

- **idle**: started and warmed up, no request;
- **holding**: it has prefilled a 256-token prompt with
  `kv_transfer_params = {"do_remote_decode": true}`, answered, and keeps the
  blocks for a decode engine that does not come (yet);
- **after**: the hold ended (kvbroker: the reader declined it through the
  broker; NixlConnector: its 30 s lease ran out).

Setups: `kvbroker` (our connector, hold TTL 120 s) and, unless --skip-nixl,
vLLM's own `NixlConnector` (the benchmarks' one baseline, bench.harness.baselines). Results go to
bench/results/idle_hold.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench.harness.baselines import NIXL_BASELINE, NIXL_DEFAULT_LEASE_S, NIXL_RELEASE_LINE, nixl_engine
from bench.harness.engines import (
    add_run_arguments,
    broker_engine,
    complete,
    prepare_workdir,
    prompt_of,
    stat,
    wait_for,
)
from bench.harness.output import format_table, load_note, log, write_json
from kvbroker.clients.sync import BrokerClient
from kvbroker.tools.launch import EngineProcess
from testkit.processes import BrokerProcess

PROMPT_TOKENS = 256
TARGET_CORES = 0.05  # the target: under 5% of a core while only holding
# vLLM's workers busy-poll their message queue for about a second after the last
# message: every window starts this long after the engine's last request.
SETTLE_S = 2.0


def cpu_window(engine: EngineProcess, window_s: float) -> dict[str, Any]:
    """Cores used by the engine's processes over the next `window_s` seconds, in all and per process."""
    before = engine.cpu_seconds()
    started = time.monotonic()
    time.sleep(window_s)
    after = engine.cpu_seconds()
    elapsed = time.monotonic() - started
    per_process = {
        name: round((used - before.get(name, 0.0)) / elapsed, 4) for name, used in sorted(after.items())
    }
    return {
        "cores": round(sum(per_process.values()), 4),
        "window_s": round(elapsed, 2),
        "per_process": per_process,
    }


def hold_request(engine: EngineProcess, seed: int) -> dict[str, Any]:
    answer = complete(
        engine, prompt_of(PROMPT_TOKENS, seed), max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    params = answer.get("kv_transfer_params") or {}
    if not params.get("do_remote_prefill"):
        raise RuntimeError(f"{engine.name} did not hand the request over for remote decode: {params}")
    return params


def measure_kvbroker(work: Path, model: Path, window_s: float, start_timeout_s: float) -> dict[str, Any]:
    broker = BrokerProcess(work).start()
    engine, stats = broker_engine(
        model, work, name="P", broker_address=broker.address, role="prefill", hold_ttl_ms=120_000
    )
    try:
        engine.wait_ready(start_timeout_s)
        complete(engine, prompt_of(64, 1), max_tokens=4)  # warm up
        time.sleep(SETTLE_S)
        idle = cpu_window(engine, window_s)
        params = hold_request(engine, 2)
        client = BrokerClient(broker.address)
        if not wait_for(lambda: stat(stats, "held_requests") == 1, 15):
            raise RuntimeError("P reports no held request")
        time.sleep(SETTLE_S)
        holding = cpu_window(engine, window_s)
        still_held = stat(stats, "held_requests") == 1
        part = params["kvbroker"]
        client.decline(holder_engine_id=part["holder_engine_id"], request_id=part["hold_request_id"])
        if not wait_for(lambda: stat(stats, "holds_returned") == 1, 15):
            raise RuntimeError("P did not free the declined hold")
        time.sleep(SETTLE_S)
        after = cpu_window(engine, window_s)
        client.close()
        return {"idle": idle, "holding": holding, "after": after, "held_whole_window": still_held}
    finally:
        engine.stop()
        broker.stop()


def measure_nixl(work: Path, model: Path, window_s: float, start_timeout_s: float) -> dict[str, Any]:
    engine = nixl_engine(model, work, "P-nixl").start()
    try:
        engine.wait_ready(start_timeout_s)
        complete(engine, prompt_of(64, 1), max_tokens=4)
        time.sleep(SETTLE_S)
        idle = cpu_window(engine, window_s)
        started = time.monotonic()
        hold_request(engine, 2)
        time.sleep(SETTLE_S)
        holding = cpu_window(engine, min(window_s, NIXL_DEFAULT_LEASE_S - 10))
        still_held = NIXL_RELEASE_LINE not in engine.log_path.read_text(errors="replace")
        released = wait_for(
            lambda: NIXL_RELEASE_LINE in engine.log_path.read_text(errors="replace"),
            NIXL_DEFAULT_LEASE_S + 30,
            0.1,
        )
        log(f"NixlConnector released after {time.monotonic() - started:.1f} s: {released}")
        time.sleep(SETTLE_S)
        after = cpu_window(engine, window_s)
        return {"idle": idle, "holding": holding, "after": after, "held_whole_window": still_held}
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window-s", type=float, default=10.0, help="length of each CPU measurement window")
    ap.add_argument("--skip-nixl", action="store_true", help="do not measure vLLM's NixlConnector")
    add_run_arguments(ap)
    args = ap.parse_args(argv)
    work, model = prepare_workdir(args, "kvbroker-idle-hold-")
    setups: dict[str, dict[str, Any]] = {}
    log("measuring kvbroker (our connector)")
    setups["kvbroker"] = measure_kvbroker(work, model, args.window_s, args.start_timeout_s)
    if not args.skip_nixl:
        log("measuring vLLM NixlConnector")
        setups["nixl"] = measure_nixl(work, model, args.window_s, args.start_timeout_s)
    rows = []
    for name, result in setups.items():
        holding = result["holding"]["cores"]
        rows.append(
            [
                name,
                f"{result['idle']['cores']:.3f}",
                f"{holding:.3f}",
                f"{result['after']['cores']:.3f}",
                "yes" if result["held_whole_window"] else "NO",
                "met" if holding < TARGET_CORES else "MISSED",
            ]
        )
    title = (
        f"Engine CPU while it only holds blocks (cores; 1.00 = one core; windows of {args.window_s:g} s; "
        f"load {load_note()})"
    )
    table = format_table(
        ["connector", "idle", "holding", "after hold ended", "held all window", f"holding < {TARGET_CORES}"],
        rows,
    )
    lines = [title, table]
    for name, result in setups.items():
        busiest = sorted(result["holding"]["per_process"].items(), key=lambda kv: -kv[1])[:3]
        lines.append(f"{name} holding, busiest processes: " + ", ".join(f"{n} {c:.3f}" for n, c in busiest))
    print("\n".join(lines))
    write_json(
        "idle_hold",
        {
            "table": "\n".join(lines[1:]),
            "prompt_tokens": PROMPT_TOKENS,
            "window_s": args.window_s,
            "target_cores": TARGET_CORES,
            "setups": setups,
            "nixl_config": NIXL_BASELINE,
        },
        out_dir=args.out_dir,
    )
    return 0 if all(r["holding"]["cores"] < TARGET_CORES for n, r in setups.items() if n == "kvbroker") else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Lease reclamation: kill -9 a reader while a holder holds KV blocks for it; how long until the holder frees them?

    .venv/bin/python -m bench.fleet.reclaim [--ttls-ms 1000 3000 5000] [--reps 5] [--skip-nixl] [--skip-vllm-reader]

The holder is always a real vLLM engine (tiny random-weight model, CPU) that
has just prefilled the same request: a PROMPT_TOKENS token-id prompt sent with
`kv_transfer_params = {"do_remote_decode": true}` and `max_tokens = 1`, so it
keeps the prompt's blocks for a decode engine that has not read them yet.

- **broker** (our connector): the request names the reader
  (`"kvbroker": {"reader_engine_id": R}`), so P's hold is tied to R's broker
  session. Once the broker shows that hold, R is killed -9. Time = kill ->
  P's connector reports the blocks back in vLLM's free pool (`holds_returned`
  in its `stats_path` counters, polled every 10 ms). Readers:
  - `bench.fleet.reader_session` processes (a real broker session with the client
    library, the same layout as P), one per repetition, for each session TTL;
    a killed process's sockets are closed by the kernel, so the broker sees
    the stream break at once and the TTL does not matter;
  - the same readers **hung** with SIGSTOP instead (process alive, socket
    open, no heartbeats: what a frozen host or a network partition looks
    like): only the session TTL can end those leases;
  - once, a real vLLM engine X with our connector (session TTL = the first of
    --ttls-ms), unless --skip-vllm-reader.
- **vLLM NixlConnector** (the benchmarks' one baseline, bench.harness.baselines;
  vLLM's lease defaults: `kv_lease_duration` 30 s, heartbeats from D every 5 s
  extending the lease by 20 s): P and D are vLLM engines with `NixlConnector`. D is killed -9 right after P answers (before it has asked
  for the blocks, as above). P does not know who its reader is, so it can only
  wait for its lease timer. Time = kill -> P logs "Releasing expired KV blocks"
  (its worker frees the blocks in that step); log polled every 10 ms.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.baselines import NIXL_BASELINE, NIXL_DEFAULT_LEASE_S, NIXL_RELEASE_LINE, nixl_engine
from bench.harness.engines import (
    BLOCK_SIZE,
    add_run_arguments,
    broker_engine,
    complete,
    prepare_workdir,
    prompt_of,
    stat,
    summary,
    wait_for,
)
from bench.harness.output import format_table, load_note, log, write_json
from kvbroker.clients.sync import BrokerClient
from kvbroker.tools.launch import EngineProcess
from kvbroker.v1 import broker_pb2 as pb
from testkit.processes import REPO_ROOT, BrokerProcess, ChildProcess

PROMPT_TOKENS = 256


def _kill_and_time(kill: Any, p_stats: Path, returned_before: int, limit_s: float) -> dict[str, Any]:
    """Run `kill`, then poll P's counters every 10 ms until its blocks are back in vLLM's free pool."""
    killed = time.monotonic()
    kill()
    freed = wait_for(lambda: stat(p_stats, "holds_returned") > returned_before, limit_s, 0.01)
    return {"holder_freed_s": time.monotonic() - killed if freed else None}


def _hold_for(p: EngineProcess, p_stats: Path, client: BrokerClient, reader: str, seed: int) -> int:
    """P prefills one request for `reader` and the broker shows the hold; returns P's holds_returned before.

    P sends its hold to the broker after the request finished: killing the
    reader before the broker has the hold would measure a refused hold, not a
    reclamation.
    """
    held_before = stat(p_stats, "held_requests")
    returned_before = stat(p_stats, "holds_returned")
    answer = complete(
        p,
        prompt_of(PROMPT_TOKENS, seed),
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "kvbroker": {"reader_engine_id": reader}},
    )
    if not (answer.get("kv_transfer_params") or {}).get("do_remote_prefill"):
        raise RuntimeError(
            f"P did not hand the request over for remote decode: {answer.get('kv_transfer_params')}"
        )
    if not wait_for(lambda: stat(p_stats, "held_requests") > held_before, 10):
        raise RuntimeError("P reports no held request")
    if not wait_for(lambda: _broker_holds_for(client, reader), 15):
        raise RuntimeError(f"the broker shows no hold by P for {reader}; see P's log")
    return returned_before


def _broker_holds_for(client: BrokerClient, reader: str) -> bool:
    return any(
        le.state == pb.LEASE_HELD and le.reader_engine_id == reader
        for le in client.list_leases(engine_id=reader).leases
    )


def start_reader_session(broker: str, reader: str, ttl_ms: int, log_dir: Path) -> ChildProcess:
    """bench.fleet.reader_session as reader `reader`, returned once it says `ready` (registered)."""
    argv = [sys.executable, "-m", "bench.fleet.reader_session", "--broker", broker, "--engine-id", reader]
    argv += ["--like", "P", "--ttl-ms", str(ttl_ms)]
    proc = ChildProcess(reader, argv, log_dir / f"{reader}.log", cwd=REPO_ROOT, fresh_log=True).start()
    try:
        proc.wait_line(b"ready\n", timeout=120)
    except RuntimeError:
        proc.kill9()
        raise
    return proc


def _count_ids(ids: Any) -> int:
    """remote_block_ids is a list of block ids, or one such list per KV cache group."""
    return sum(_count_ids(i) for i in ids) if isinstance(ids, list) else 1


def measure_nixl(p: EngineProcess, d: EngineProcess, reps: int, limit_s: float) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        seen = p.log_path.read_text(errors="replace").count(NIXL_RELEASE_LINE)
        answer = complete(
            p,
            prompt_of(PROMPT_TOKENS, 5000 + rep),
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True},
        )
        params = answer.get("kv_transfer_params") or {}
        if not params.get("remote_block_ids"):
            raise RuntimeError(f"NixlConnector P returned no remote_block_ids: {params}")
        killed = time.monotonic()
        if rep == 0:
            os.killpg(d.pid or 0, signal.SIGKILL)
        freed_s: float | None = None
        while time.monotonic() - killed < limit_s:
            if p.log_path.read_text(errors="replace").count(NIXL_RELEASE_LINE) > seen:
                freed_s = time.monotonic() - killed
                break
            time.sleep(0.01)
        blocks = _count_ids(params["remote_block_ids"])
        log(f"nixl rep {rep}: P freed after {freed_s} s ({blocks} blocks held)")
        runs.append(
            {
                "rep": rep,
                "reader_killed_in_this_rep": rep == 0,
                "blocks_held": blocks,
                "holder_freed_s": freed_s,
            }
        )
    return runs


@dataclass
class Engines:
    """The holder P, the optional vLLM reader X and NixlConnector pair, as started."""

    p: EngineProcess
    p_stats: Path
    x: EngineProcess | None = None
    p_nixl: EngineProcess | None = None
    d_nixl: EngineProcess | None = None
    nixl_error: str | None = None
    all: list[EngineProcess] = field(default_factory=list)


def start_engines(
    model: Path, work: Path, broker: BrokerProcess, args: argparse.Namespace, out: list[Any]
) -> Engines:
    """Start every engine (each appended to `out` at once, for the caller's clean-up) and wait for
    them; a NixlConnector engine that does not start is recorded, not fatal."""
    p, p_stats = broker_engine(model, work, name="P", broker_address=broker.address, role="prefill")
    out.append(p)
    eng = Engines(p, p_stats, all=out)
    if not args.skip_vllm_reader:
        eng.x, _ = broker_engine(
            model,
            work,
            name="X",
            broker_address=broker.address,
            role="decode",
            session_ttl_ms=args.ttls_ms[0],
        )
        out.append(eng.x)
    if not args.skip_nixl:
        eng.p_nixl = nixl_engine(model, work, "P-nixl").start()
        out.append(eng.p_nixl)
        eng.d_nixl = nixl_engine(model, work, "D-nixl").start()
        out.append(eng.d_nixl)
    for engine in list(out):
        name = engine.name
        try:
            engine.wait_ready(timeout=args.start_timeout_s, progress=log)
        except Exception as e:
            if engine not in (eng.p_nixl, eng.d_nixl):
                raise
            eng.nixl_error = f"{name} did not start: {e}"
            log(eng.nixl_error)
    return eng


def measure_session_readers(
    eng: Engines,
    client: BrokerClient,
    broker: BrokerProcess,
    work: Path,
    args: argparse.Namespace,
    readers: list[Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per session TTL: readers killed -9, then readers hung (SIGSTOP); runs per TTL for each."""
    killed: dict[str, Any] = {}
    hung: dict[str, Any] = {}
    for ttl_ms in args.ttls_ms:
        for mode, reps in (("kill", args.reps), ("hang", args.hang_reps)):
            runs = []
            for rep in range(reps):
                reader = f"R{ttl_ms}-{mode}-{rep}"
                proc = start_reader_session(broker.address, reader, ttl_ms, work)
                readers.append(proc)
                seed = ttl_ms * 100 + rep + (50 if mode == "hang" else 0)
                returned_before = _hold_for(eng.p, eng.p_stats, client, reader, seed=seed)
                sig = signal.SIGKILL if mode == "kill" else signal.SIGSTOP
                r = _kill_and_time(
                    lambda proc=proc, sig=sig: os.killpg(proc.pid, sig),
                    eng.p_stats,
                    returned_before,
                    ttl_ms / 1000 + 15,
                )
                proc.kill9()
                log(f"broker, session TTL {ttl_ms} ms, reader {mode}, rep {rep}: {r}")
                runs.append(r)
            (killed if mode == "kill" else hung)[str(ttl_ms)] = runs
    return killed, hung


def measure_vllm_reader(eng: Engines, client: BrokerClient, ttl_ms: int) -> dict[str, Any] | None:
    """The real vLLM reader X killed -9 while P holds for it."""
    x = eng.x
    if x is None:
        return None
    returned_before = _hold_for(eng.p, eng.p_stats, client, "X", seed=777)
    r = _kill_and_time(
        lambda: os.killpg(x.pid or 0, signal.SIGKILL), eng.p_stats, returned_before, ttl_ms / 1000 + 15
    )
    x.kill9()  # reap the group
    log(f"broker, real vLLM reader X (session TTL {ttl_ms} ms): {r}")
    return {"session_ttl_ms": ttl_ms, **r}


def measure_nixl_pair(eng: Engines, reps: int) -> dict[str, Any] | None:
    if eng.p_nixl is None or eng.d_nixl is None:
        return None
    error = eng.nixl_error
    if error is None:
        try:
            return {
                "runs": measure_nixl(eng.p_nixl, eng.d_nixl, reps, NIXL_DEFAULT_LEASE_S * 3),
                "measured": True,
            }
        except Exception as e:
            error = f"NixlConnector request failed: {e!r}"
    return {"measured": False, "error": error}


def _freed_cell(f: dict[str, Any] | None) -> str:
    return (
        f"{f['median_ms'] / 1000:.2f} ({f['min_ms'] / 1000:.2f}..{f['max_ms'] / 1000:.2f})" if f else "never"
    )


def per_ttl_figures(by_ttl: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for ttl, runs in by_ttl.items():
        freed = [r["holder_freed_s"] for r in runs if r["holder_freed_s"] is not None]
        out[ttl] = {
            "holder_freed": summary(freed) if freed else None,
            "not_freed_in_time": len(runs) - len(freed),
        }
    return out


def table_rows(
    results: dict[str, Any], per_ttl: dict[str, Any], per_ttl_hang: dict[str, Any]
) -> list[list[str]]:
    """The table's rows; fills in the NixlConnector figures (results["nixl"]["holder_freed"])."""
    rows = [
        [
            f"broker, reader session TTL {int(ttl) / 1000:g} s",
            f"{len(results['broker'][ttl])}",
            _freed_cell(f["holder_freed"]),
            "yes",
        ]
        for ttl, f in per_ttl.items()
    ]
    rows += [
        [
            f"broker, reader hung (SIGSTOP), TTL {int(ttl) / 1000:g} s",
            f"{len(results['broker_hang'][ttl])}",
            _freed_cell(f["holder_freed"]),
            "yes",
        ]
        for ttl, f in per_ttl_hang.items()
    ]
    xr = results["broker_vllm_reader"]
    if xr is not None:
        freed = f"{xr['holder_freed_s']:.2f}" if xr["holder_freed_s"] is not None else "never"
        rows.append([f"broker, vLLM reader engine, TTL {xr['session_ttl_ms'] / 1000:g} s", "1", freed, "yes"])
    nx = results["nixl"]
    if nx is not None and nx.get("measured"):
        freed_s = [r["holder_freed_s"] for r in nx["runs"] if r["holder_freed_s"] is not None]
        nx["holder_freed"] = summary(freed_s) if freed_s else None
        rows.append(["vLLM NixlConnector", str(len(nx["runs"])), _freed_cell(nx["holder_freed"]), "yes"])
    elif nx is not None:
        lease = f"{NIXL_DEFAULT_LEASE_S} (documented default kv_lease_duration)"
        rows.append(["vLLM NixlConnector", "0", lease, "NO: " + nx["error"].splitlines()[0][:80]])
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start everything, measure every case, stop everything; the raw results."""
    work, model = prepare_workdir(args, "kvbroker-reclaim-bench-")
    broker = BrokerProcess(work).start()
    engines: list[EngineProcess] = []
    readers: list[ChildProcess] = []
    results: dict[str, Any] = {"broker": {}, "broker_hang": {}, "broker_vllm_reader": None, "nixl": None}
    try:
        eng = start_engines(model, work, broker, args, engines)
        with BrokerClient(broker.address) as client:
            wait_for(lambda: any(e.engine_id == "P" and e.ranks for e in client.list_engines().engines), 30)
            results["broker"], results["broker_hang"] = measure_session_readers(
                eng, client, broker, work, args, readers
            )
            results["broker_vllm_reader"] = measure_vllm_reader(eng, client, args.ttls_ms[0])
        results["nixl"] = measure_nixl_pair(eng, args.nixl_reps)
    finally:
        for proc in readers:
            proc.kill9()
        for engine in engines:
            engine.stop()
        broker.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ttls-ms", type=int, nargs="+", default=[1000, 3000, 5000])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hang-reps", type=int, default=3, help="repetitions of the SIGSTOP (hung reader) case")
    ap.add_argument("--nixl-reps", type=int, default=2)
    ap.add_argument("--skip-nixl", action="store_true")
    ap.add_argument("--skip-vllm-reader", action="store_true")
    add_run_arguments(ap)
    args = ap.parse_args(argv)

    results = run(args)
    per_ttl, per_ttl_hang = per_ttl_figures(results["broker"]), per_ttl_figures(results["broker_hang"])
    rows = table_rows(results, per_ttl, per_ttl_hang)
    table = format_table(
        ["holder / reader", "runs", "reader dies/hangs -> holder frees, s: med (min..max)", "measured"], rows
    )
    print(f"lease reclamation after the reader is killed -9 (or hung); machine shared, load {load_note()}")
    print(table)
    path = write_json(
        "reclaim",
        {
            "settings": {
                "prompt_tokens": PROMPT_TOKENS,
                "block_size": BLOCK_SIZE,
                "ttls_ms": args.ttls_ms,
                "reps": args.reps,
                "nixl_default_lease_s": NIXL_DEFAULT_LEASE_S,
                "nixl_config": NIXL_BASELINE,
                "holder_freed": "broker: P's connector counter holds_returned; nixl: P's log line "
                f"{NIXL_RELEASE_LINE!r}; both polled every 10 ms",
                "readers": "bench.fleet.reader_session processes (real broker sessions); plus one vLLM engine X",
            },
            "shared_machine": "other vLLM engines and test runs were using the same cores during the run",
            "broker": per_ttl,
            "broker_runs": results["broker"],
            "broker_reader_hung": per_ttl_hang,
            "broker_hang_runs": results["broker_hang"],
            "broker_vllm_reader": results["broker_vllm_reader"],
            "nixl": results["nixl"],
            "table": table,
        },
        args.out_dir,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What TLS costs the broker's paths: plaintext, TLS and mutual TLS side by side, in one run.

    python -m bench.control_plane.tls [--quick]

Three broker processes on this machine, one per transport (plaintext; TLS
with a server certificate; mutual TLS with client certificates, so the
broker also checks roles, tenants and quotas on every call). Rounds go
plaintext, TLS, mutual TLS, again and again, so the machine's drift spreads
over all three. Each figure is the median over rounds of:

- session resolve: one engine's EngineSession.resolve of a 64-block chain,
  one at a time (the engines' path without a synced mirror), p50 and p90;
- unary resolve: a router's Resolve call, p50;
- mirror resolve: the engine-local index mirror (fed by the Mirror stream
  over the same transport) answering the same chain, p50;
- session inventory: blocks/s one EngineSession announces, 64-block chains
  coalesced by the session, until a resolve sent after them is answered.
Besides wall-clock figures, each path reports its CPU per operation (the
broker process and this client together, all threads), which a busy machine
disturbs far less than latency. The mutual-TLS overhead target (< 15%) is on
the engine paths: the mirror resolve's p50 (in process) and the session
inventory's CPU per block (what the transport and the checks cost; its
blocks/s on a shared machine follow the other processes' load). Writes
bench/results/tls.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.control_plane.chains import CHAIN_LEN, make_chains
from bench.control_plane.driver import bench_engine
from bench.harness.loops import cpu_seconds
from bench.harness.output import log
from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.clients.credentials import ClientSecurity
from kvbroker.clients.engine_session import EngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit.certs import CertificateAuthority
from testkit.processes import BrokerProcess

RESULTS = Path(__file__).resolve().parents[1] / "results" / "tls.json"
MODES = ("plaintext", "tls", "mtls")
TENANT = "bench"
TARGET_OVERHEAD = 0.15


@dataclass
class Mode:
    name: str
    broker: BrokerProcess
    engine: ClientSecurity | None
    router: ClientSecurity | None


def _modes(pki: Path, log_dir: Path) -> list[Mode]:
    ca = CertificateAuthority.create(pki)
    server = ca.server()
    engine = ca.client("engine", f"kvbroker://{TENANT}/engine/bench-tls")
    router = ca.client("router", f"kvbroker://{TENANT}/router/bench")
    tls_args = ["--tls-cert", str(server.cert), "--tls-key", str(server.key)]
    plain = ClientSecurity()
    server_only = ClientSecurity(tls_ca=str(ca.cert))
    return [
        Mode("plaintext", BrokerProcess(log_dir, [], log_name="plaintext.log"), plain, plain),
        Mode("tls", BrokerProcess(log_dir, tls_args, log_name="tls.log"), server_only, server_only),
        Mode(
            "mtls",
            BrokerProcess(log_dir, [*tls_args, "--tls-ca", str(ca.cert)], log_name="mtls.log"),
            ClientSecurity(tls_ca=str(ca.cert), tls_cert=str(engine.cert), tls_key=str(engine.key)),
            ClientSecurity(tls_ca=str(ca.cert), tls_cert=str(router.cert), tls_key=str(router.key)),
        ),
    ]


class _Cpu:
    """CPU seconds the broker process and this client process used since it was made (all threads)."""

    def __init__(self, broker_pid: int) -> None:
        self.pid = broker_pid
        self.start = cpu_seconds(broker_pid) + time.process_time()

    def used(self) -> float:
        return cpu_seconds(self.pid) + time.process_time() - self.start


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _round(mode: Mode, ops: int, chains: int, seed: int) -> dict[str, float]:
    session = EngineSession(
        mode.broker.address, bench_engine("bench-tls"), ttl_ms=30_000, mirror_index=True, security=mode.engine
    )
    await session.start(wait_connected_s=30)
    try:
        ns = (session.layout_id, f"{TENANT}/s")
        held = make_chains(1, seed=seed)[0]
        session.announce_stored(ns, pb.TIER_GPU, held)
        await session.resolve(ns, [0])
        for _ in range(200):  # the mirror's snapshot and the announce arrive over the stream
            mirror = session.mirror
            if mirror is not None and mirror.synced and mirror.resolve(ns[1], held):
                break
            await asyncio.sleep(0.05)
        times: list[float] = []
        cpu = _Cpu(mode.broker.pid)
        for _ in range(ops):
            start = time.perf_counter()
            await session.resolve(ns, held)
            times.append(time.perf_counter() - start)
        out = {
            "session_resolve_p50_us": _pct(times, 0.5) * 1e6,
            "session_resolve_p90_us": _pct(times, 0.9) * 1e6,
            "session_resolve_cpu_us": cpu.used() / ops * 1e6,
        }
        mirror = session.mirror
        assert mirror is not None and mirror.resolve(ns[1], held), "the mirror never synced"
        times = []
        for _ in range(ops * 10):
            start = time.perf_counter()
            mirror.resolve(ns[1], held)
            times.append(time.perf_counter() - start)
        out["mirror_resolve_p50_us"] = _pct(times, 0.5) * 1e6
        async with AsyncBrokerClient(mode.broker.address, security=mode.router) as router:
            request = pb.ResolveRequest(
                namespace=pb.Namespace(layout_id=ns[0], tenant=ns[1]), block_hashes=held
            )
            await router.resolve(request)
            times = []
            cpu = _Cpu(mode.broker.pid)
            for _ in range(ops):
                start = time.perf_counter()
                await router.resolve(request)
                times.append(time.perf_counter() - start)
        out["unary_resolve_p50_us"] = _pct(times, 0.5) * 1e6
        out["unary_resolve_cpu_us"] = cpu.used() / ops * 1e6
        batch = make_chains(chains, seed=seed + 1)
        cpu = _Cpu(mode.broker.pid)
        start = time.perf_counter()
        for i, chain in enumerate(batch):
            session.announce_stored(ns, pb.TIER_GPU, chain)
            if i % 16 == 15:
                await asyncio.sleep(0)
        await session.resolve(ns, [0])
        out["session_inventory_blocks_per_s"] = chains * CHAIN_LEN / (time.perf_counter() - start)
        out["session_inventory_cpu_us_per_1k_blocks"] = cpu.used() / (chains * CHAIN_LEN) * 1e9
        return out
    finally:
        await session.close()


async def _run(rounds: int, ops: int, chains: int, log_dir: Path) -> dict[str, dict[str, Any]]:
    modes = _modes(log_dir / "pki", log_dir)
    samples: dict[str, dict[str, list[float]]] = {m.name: {} for m in modes}
    for m in modes:
        m.broker.start()
    try:
        for r in range(rounds):
            for m in modes:
                figures = await _round(m, ops, chains, seed=1000 * r + MODES.index(m.name))
                for key, value in figures.items():
                    samples[m.name].setdefault(key, []).append(value)
            log(f"round {r + 1}/{rounds} done")
    finally:
        for m in modes:
            m.broker.stop()
    return {
        name: {key: {"median": statistics.median(v), "min": min(v), "max": max(v)} for key, v in figs.items()}
        for name, figs in samples.items()
    }


# (label, key, unit, lower is better, judged against the target)
ROWS = (
    ("mirror resolve p50 (engine-local)", "mirror_resolve_p50_us", "us", True, True),
    ("session inventory CPU per 1k blocks", "session_inventory_cpu_us_per_1k_blocks", "us", True, True),
    ("session inventory (EngineSession)", "session_inventory_blocks_per_s", "blocks/s", False, False),
    ("session resolve CPU per resolve", "session_resolve_cpu_us", "us", True, False),
    ("session resolve p50", "session_resolve_p50_us", "us", True, False),
    ("session resolve p90", "session_resolve_p90_us", "us", True, False),
    ("unary resolve CPU per call", "unary_resolve_cpu_us", "us", True, False),
    ("unary resolve p50 (router)", "unary_resolve_p50_us", "us", True, False),
)


def overhead(plain: float, secure: float, lower_is_better: bool) -> float:
    """How much worse `secure` is than `plain` (0.10 = 10 % slower)."""
    return secure / plain - 1 if lower_is_better else plain / secure - 1


def report(results: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    lines = [
        f"{'figure':36}  {'plaintext':>14}  {'TLS':>14}  {'mutual TLS':>14}  {'mTLS overhead':>13}  target",
        "-" * 112,
    ]
    verdicts: dict[str, Any] = {}
    for label, key, unit, lower, engine_path in ROWS:
        cells = [results[m][key]["median"] for m in MODES]
        over = overhead(cells[0], cells[2], lower)
        target = ""
        if engine_path:
            met = over < TARGET_OVERHEAD
            target = "met" if met else "MISSED"
            verdicts[key] = {"mtls_overhead": over, "target": f"< {TARGET_OVERHEAD:.0%}", "met": met}
        text = [f"{c:,.1f} {unit}" if unit == "us" else f"{c:,.0f} {unit}" for c in cells]
        lines.append(f"{label:36}  {text[0]:>14}  {text[1]:>14}  {text[2]:>14}  {over:>+12.1%}  {target}")
    return "\n".join(lines), verdicts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run (smoke tests)")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 7)
    ops, chains = (50, 200) if args.quick else (1000, 2000)
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp:
        results = asyncio.run(_run(rounds, ops, chains, Path(tmp)))
    table, verdicts = report(results)
    load = os.getloadavg()
    table += f"\nmachine load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min)"
    print(table)
    doc = {
        "program": "bench/control_plane/tls.py",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mode": "quick" if args.quick else "full",
        "rounds": rounds,
        "ops_per_round": ops,
        "inventory_blocks_per_round": chains * CHAIN_LEN,
        "setting": "broker processes and one client on the same machine (loopback); ECDSA P-256 certificates, TLS 1.3",
        "results": results,
        "targets": verdicts,
        "load_average": list(load),
        "table": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

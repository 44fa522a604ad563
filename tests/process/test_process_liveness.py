"""Process-level tests: a real `kvbroker serve` process, real engine client processes, kill -9.

(a) kill -9 (or freeze) one side of a lease and the other side is told within
    the session TTL + 1 s; the measured delay is printed;
(b) kill -9 and restart the broker: an engine session re-registers and
    re-announces by itself, and resolve answers as before;
(c) starvation is not death: a broker paused (SIGSTOP) for two session TTLs,
    or CPU hogs beside broker and engines for three, ends no session and no
    lease, while a frozen engine (SIGSTOP, in (a)) is still caught by its TTL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from process_engine_client import engine_info
from process_harness import EngineProcess

from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.clients.clock import Backoff
from kvbroker.clients.engine_session import EngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit.processes import BrokerProcess

pytestmark = pytest.mark.timeout(90)

GPU = pb.TIER_GPU
TTL_MS = 1_500
BLOCKS = [101, 102, 103, 104, 105]


class Timeline:
    """Session callbacks with the monotonic time each arrived."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, Any]] = []

    def recorder(self, kind: str) -> Callable[[Any], None]:
        return lambda message: self.events.append((kind, time.monotonic(), message))

    def callbacks(self) -> dict[str, Callable[[Any], None]]:
        return {f"on_{k}": self.recorder(k) for k in ("revoked", "lease_ended", "connected", "disconnected")}

    async def wait_for(self, kind: str, count: int = 1, timeout: float = 10.0) -> tuple[float, Any]:
        deadline = time.monotonic() + timeout
        while True:
            found = [(t, m) for k, t, m in self.events if k == kind]
            if len(found) >= count:
                return found[count - 1]
            if time.monotonic() > deadline:
                raise AssertionError(f"no {kind!r} event #{count} within {timeout} s: {self.events}")
            await asyncio.sleep(0.005)


@pytest.fixture
async def open_session(broker_process: BrokerProcess) -> AsyncIterator[Callable[..., Any]]:
    opened: list[EngineSession] = []

    async def open_(engine_id: str, timeline: Timeline, **kwargs: Any) -> EngineSession:
        session = EngineSession(
            broker_process.address, engine_info(engine_id), ttl_ms=TTL_MS, **timeline.callbacks(), **kwargs
        )
        opened.append(session)
        await session.start(wait_connected_s=10.0)
        return session

    yield open_
    for session in opened:
        await session.close()


async def _reader_process_with_active_lease(
    broker_process: BrokerProcess, engines: list[EngineProcess], holder: EngineSession
) -> tuple[EngineProcess, pb.Lease]:
    reader = EngineProcess(broker_process.address, "d0", "reader", "--ttl-ms", str(TTL_MS))
    engines.append(reader)
    await asyncio.to_thread(reader.expect, "registered")
    lease = await holder.hold(
        (holder.layout_id, ""), GPU, BLOCKS, list(range(5)), 60_000, reader_engine_id="d0"
    )
    reader.send(lease.lease_id)
    acquired = await asyncio.to_thread(reader.expect, "acquired")
    assert acquired["state"] == "LEASE_ACTIVE"
    return reader, lease


async def test_kill9_reader_process_holder_told_within_ttl(
    broker_process: BrokerProcess, engine_processes: list[EngineProcess], open_session: Callable[..., Any]
) -> None:
    timeline = Timeline()
    holder = await open_session("p0", timeline)
    reader, lease = await _reader_process_with_active_lease(broker_process, engine_processes, holder)

    killed_at = reader.kill(signal.SIGKILL)
    told_at, ended = await timeline.wait_for("lease_ended", timeout=TTL_MS / 1000 + 5)
    delay = told_at - killed_at
    print(f"\nkill -9 reader: holder told after {delay * 1000:.0f} ms (session TTL {TTL_MS} ms)")
    assert ended.lease.lease_id == lease.lease_id
    assert ended.lease.cause == pb.REVOKE_READER_GONE
    assert delay < TTL_MS / 1000 + 1.0


async def test_frozen_reader_process_holder_told_when_ttl_runs_out(
    broker_process: BrokerProcess, engine_processes: list[EngineProcess], open_session: Callable[..., Any]
) -> None:
    """SIGSTOP keeps the socket open: only the missed TTL can reveal the dead reader."""
    timeline = Timeline()
    holder = await open_session("p0", timeline)
    reader, _ = await _reader_process_with_active_lease(broker_process, engine_processes, holder)

    stopped_at = reader.kill(signal.SIGSTOP)
    told_at, ended = await timeline.wait_for("lease_ended", timeout=TTL_MS / 1000 + 5)
    delay = told_at - stopped_at
    print(f"\nfrozen reader: holder told after {delay * 1000:.0f} ms (session TTL {TTL_MS} ms)")
    assert ended.lease.cause == pb.REVOKE_READER_GONE
    # The last sign of life came at most one heartbeat interval (TTL/3, plus a tick) before
    # the freeze, so the TTL path takes over half a TTL (a broken stream takes milliseconds);
    # and never more than TTL + 1 s.
    assert TTL_MS / 1000 / 2 < delay < TTL_MS / 1000 + 1.0


async def test_kill9_holder_process_reader_told_within_ttl(
    broker_process: BrokerProcess, engine_processes: list[EngineProcess], open_session: Callable[..., Any]
) -> None:
    timeline = Timeline()
    reader = await open_session("d0", timeline)
    holder = EngineProcess(
        broker_process.address,
        "p0",
        "holder",
        "--ttl-ms",
        str(TTL_MS),
        "--blocks",
        ",".join(map(str, BLOCKS)),
    )
    engine_processes.append(holder)
    await asyncio.to_thread(holder.expect, "registered")
    held = await asyncio.to_thread(holder.expect, "held")
    ns = (reader.layout_id, "")
    before = await reader.resolve(ns, BLOCKS)
    assert [(m.engine_id, m.matched_blocks) for m in before.matches] == [("p0", 5)]
    acquired = await reader.acquire(held["lease_id"], ttl_ms=60_000)
    assert acquired.lease.state == pb.LEASE_ACTIVE

    killed_at = holder.kill(signal.SIGKILL)
    told_at, revoked = await timeline.wait_for("revoked", timeout=TTL_MS / 1000 + 5)
    delay = told_at - killed_at
    print(f"\nkill -9 holder: reader told after {delay * 1000:.0f} ms (session TTL {TTL_MS} ms)")
    assert revoked.lease.lease_id == held["lease_id"]
    assert revoked.cause == pb.REVOKE_HOLDER_GONE
    assert delay < TTL_MS / 1000 + 1.0
    after = await reader.resolve(ns, BLOCKS)
    assert not after.matches  # the dead holder is no longer named


async def test_broker_restart_session_reregisters_and_reannounces(
    broker_process: BrokerProcess, open_session: Callable[..., Any]
) -> None:
    timeline = Timeline()
    holder = await open_session("p0", timeline, backoff=Backoff(initial_s=0.05, max_s=0.5))
    ns = pb.Namespace(layout_id=holder.layout_id, tenant="tenant-a")
    holder.announce_stored(ns, GPU, BLOCKS)
    holder.announce_stored(ns, pb.TIER_CPU, BLOCKS[:2])
    holder.flush()

    async def matches() -> list[tuple[str, int, int]]:
        async with AsyncBrokerClient(broker_process.address, timeout=2.0) as client:
            response = await client.resolve(namespace=ns, block_hashes=[*BLOCKS, 999])
        return [(m.engine_id, m.tier, m.matched_blocks) for m in response.matches]

    expected = [("p0", GPU, 5), ("p0", pb.TIER_CPU, 2)]
    await holder.applied()  # the broker has applied the announcements
    assert await matches() == expected

    await asyncio.to_thread(broker_process.kill9)
    await timeline.wait_for("disconnected")
    restarted_at = time.monotonic()
    await asyncio.to_thread(broker_process.start)
    await timeline.wait_for("connected", count=2, timeout=15.0)
    await holder.applied()  # the re-announcement went out before the session counted as connected
    assert await matches() == expected
    print(
        f"\nbroker restart: answers as before {time.monotonic() - restarted_at:.2f} s after the new broker started"
    )
    assert holder.registrations == 2


async def _assert_lease_still_active(address: str, lease: pb.Lease) -> None:
    async with AsyncBrokerClient(address) as client:
        leases = {le.lease_id: le for le in (await client.list_leases(engine_id="d0")).leases}
    assert leases[lease.lease_id].state == pb.LEASE_ACTIVE


async def test_a_paused_broker_ends_no_session_and_no_lease(
    broker_process: BrokerProcess, engine_processes: list[EngineProcess], open_session: Callable[..., Any]
) -> None:
    """The extreme of a starved broker host: the broker does not run at all (SIGSTOP) for two
    session TTLs. The engines' heartbeats wait unread in its sockets, so when it runs again
    the silence was its own: no session ends, no engine gives its session up, no lease is lost."""
    timeline = Timeline()
    holder = await open_session("p0", timeline)
    reader, lease = await _reader_process_with_active_lease(broker_process, engine_processes, holder)
    assert broker_process.proc is not None
    broker_process.proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(2 * TTL_MS / 1000)
    finally:
        broker_process.proc.send_signal(signal.SIGCONT)
    await asyncio.sleep(2 * TTL_MS / 1000)  # heartbeats flow again for a while
    assert [k for k, _, _ in timeline.events if k in ("disconnected", "revoked", "lease_ended")] == []
    assert holder.registrations == 1 and holder.connected
    await _assert_lease_still_active(broker_process.address, lease)
    assert reader.proc.poll() is None
    assert "did not run for" in broker_process.log_path.read_text()


async def test_sessions_survive_cpu_hogs_for_longer_than_a_ttl(
    broker_process: BrokerProcess, engine_processes: list[EngineProcess], open_session: Callable[..., Any]
) -> None:
    """Busy processes, two per core and ahead of the broker and the engines in CPU
    priority where this user may raise it, run for three session TTLs beside a broker, a
    holder session (this process) and a reader process with an active lease."""
    timeline = Timeline()
    holder = await open_session("p0", timeline)
    _reader, lease = await _reader_process_with_active_lease(broker_process, engine_processes, holder)
    hog = "import os, time\ntry:\n    os.nice(-10)\nexcept OSError:\n    pass\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"
    seconds = 3 * TTL_MS / 1000
    hogs = [
        await asyncio.create_subprocess_exec(sys.executable, "-c", hog.format(s=seconds))
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:
        for proc in hogs:
            await proc.wait()
    finally:
        for proc in hogs:
            if proc.returncode is None:
                proc.kill()
    await asyncio.sleep(TTL_MS / 1000)
    assert [k for k, _, _ in timeline.events if k in ("disconnected", "revoked", "lease_ended")] == []
    assert holder.registrations == 1
    await _assert_lease_still_active(broker_process.address, lease)

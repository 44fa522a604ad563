"""Quotas that one tenant cannot turn against another, or against its own engines, on real TLS brokers.

- Mirror (and Watch) slots: a tenant takes at most its share
  (--quota-tenant-slots) of the broker's --max-mirrors, so another tenant
  still gets one.
- The lease quota counts a resolve that leases (acquire) like a hold.
- The tenant rate quota never refuses the tenant's engines' housekeeping: a
  removal is applied however busy the tenant's routers are, so evicted blocks
  are never named.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvbroker.clients import errors
from kvbroker.clients.sync import BrokerClient
from kvbroker.clients.threaded_session import ThreadedEngineSession
from kvbroker.common.error_details import error_info
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.processes import BrokerProcess
from tests.broker.security.conftest import Pki, tls_args
from tests.broker.security.world import stub

pytestmark = pytest.mark.timeout(90)

HASHES = [0x5101, 0x5102, 0x5103, 0x5104, 0x5105, 0x5106, 0x5107, 0x5108]


def _broker(pki: Pki, tmp_path: Path, *flags: str) -> BrokerProcess:
    return BrokerProcess(tmp_path, [*tls_args(pki, mutual=True, tokens=False), *flags])


def _session(
    address: str, pki: Pki, who: str, engine_id: str = "", **options: object
) -> ThreadedEngineSession:
    s = ThreadedEngineSession(
        address, engine_info(engine_id or who), ttl_ms=30_000, security=pki.mtls(who), **options
    )
    s.start(wait_connected_s=15)
    return s


def test_one_tenant_cannot_take_every_mirror_slot(pki: Pki, tmp_path: Path) -> None:
    with _broker(pki, tmp_path, "--max-mirrors", "4") as proc:
        opened: list[tuple[grpc.Channel, Iterator[pb.MirrorUpdate]]] = []
        refusal: grpc.RpcError | None = None
        try:
            for who in ("router", "operator", "router", "operator"):  # acme's identities
                channel, s = stub(proc.address, pki.mtls(who))
                updates = s.Mirror(pb.MirrorRequest(layout_id="any-layout"), timeout=30)
                try:
                    assert next(updates).reset
                    opened.append((channel, updates))
                except grpc.RpcError as err:
                    refusal = err
                    channel.close()
                    break
            assert len(opened) == 1, "acme's share of 4 slots at --quota-tenant-slots 0.25"
            assert refusal is not None
            assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            info = error_info(refusal.trailing_metadata())  # type: ignore[attr-defined]
            assert info is not None and info.cause == "quota_exceeded"
            assert "--quota-tenant-slots" in refusal.details()  # type: ignore[attr-defined]
            # globex still gets a slot.
            channel, s = stub(proc.address, pki.mtls("other_router"))
            updates = s.Mirror(pb.MirrorRequest(layout_id="any-layout"), timeout=30)
            assert next(updates).reset
            opened.append((channel, updates))
        finally:
            for channel, updates in opened:
                updates.cancel()  # type: ignore[attr-defined]
                channel.close()


def test_one_tenant_cannot_take_every_watch_slot(pki: Pki, tmp_path: Path) -> None:
    with _broker(pki, tmp_path, "--max-watchers", "4") as proc:
        channels: list[grpc.Channel] = []
        sessions: list[ThreadedEngineSession] = []

        def watch(who: str, timeout: float) -> Iterator[pb.WatchEvent]:
            channel, s = stub(proc.address, pki.mtls(who))
            channels.append(channel)
            return s.Watch(pb.WatchRequest(engine_events=True), timeout=timeout)  # type: ignore[no-any-return]

        def first_event(stream: Iterator[pb.WatchEvent], who: str, engine_id: str) -> pb.WatchEvent:
            """The stream's first event, an engine of `who` registering; again until the broker
            serves the Watch (its call may reach the broker after a registration: no event)."""
            events: queue.Queue[pb.WatchEvent] = queue.Queue()
            threading.Thread(target=_drain, args=(stream, events), daemon=True).start()
            for _ in range(10):
                sessions.append(_session(proc.address, pki, who, engine_id))
                try:
                    return events.get(timeout=3.0)
                except queue.Empty:
                    sessions.pop().close()
            raise AssertionError(f"the Watch of {who!r}'s tenant never showed an event")

        try:
            acme = watch("operator", 60)
            assert first_event(acme, "p0", "p0").engine_id == "p0"  # acme's one watcher is open
            with pytest.raises(grpc.RpcError) as caught:
                next(watch("operator", 10))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            assert "--quota-tenant-slots" in caught.value.details()  # type: ignore[attr-defined]
            globex = watch("other_operator", 60)
            assert first_event(globex, "other_engine", "g1").engine_id == "g1"
        finally:
            for session in sessions:
                session.close()
            for channel in channels:
                channel.close()


def _drain(stream: Iterator[pb.WatchEvent], into: queue.Queue[pb.WatchEvent]) -> None:
    try:
        for event in stream:
            into.put(event)
    except grpc.RpcError:
        pass  # the test closed the channel


def _pin_ok(command: pb.PinCommand) -> pb.PinResult:
    lease = command.lease
    return pb.PinResult(lease_id=lease.lease_id, ok=True, block_ids=list(range(len(lease.block_hashes))))


def test_the_lease_quota_counts_resolves_that_lease(pki: Pki, tmp_path: Path) -> None:
    with _broker(pki, tmp_path, "--quota-leases", "3") as proc:
        p0 = _session(proc.address, pki, "p0", on_pin=_pin_ok)
        p1 = _session(proc.address, pki, "p1")
        try:
            ns = pb.Namespace(layout_id=p0.layout_id, tenant="acme/")
            p0.announce_stored(ns, pb.TIER_GPU, HASHES)
            p0.applied(10)
            leased: list[str] = []
            with BrokerClient(proc.address, security=pki.mtls("p1")) as reader:
                for i in range(3):
                    found = reader.resolve(
                        namespace=ns, block_hashes=HASHES, acquire=True, engine_id="p1", request_id=f"r{i}"
                    )
                    assert found.HasField("lease"), found
                    leased.append(found.lease.lease_id)
                with pytest.raises(errors.ResourceExhausted, match="--quota-leases 3") as caught:
                    reader.resolve(
                        namespace=ns, block_hashes=HASHES, acquire=True, engine_id="p1", request_id="r3"
                    )
                assert caught.value.cause == "quota_exceeded"
            with BrokerClient(proc.address, security=pki.mtls("operator")) as op:
                live = [lease for lease in op.list_leases().leases if lease.state == pb.LEASE_ACTIVE]
                assert len(live) == 3
        finally:
            p1.close()
            p0.close()


def test_the_tenant_rate_never_drops_an_engines_housekeeping(pki: Pki, tmp_path: Path) -> None:
    with _broker(pki, tmp_path, "--quota-tenant-rate", "20") as proc:
        p0 = _session(proc.address, pki, "p0")
        stop = threading.Event()
        refused = threading.Event()
        try:
            ns = pb.Namespace(layout_id=p0.layout_id, tenant="acme/")
            p0.announce_stored(ns, pb.TIER_GPU, HASHES)
            p0.applied(10)

            def busy_routers() -> None:  # acme's routers use up acme's rate, and keep it used up
                with BrokerClient(proc.address, security=pki.mtls("router")) as router:
                    while not stop.is_set():
                        try:
                            router.score(namespace=ns, block_hashes=HASHES[:1])
                        except errors.ResourceExhausted:
                            refused.set()

            thread = threading.Thread(target=busy_routers, daemon=True)
            thread.start()
            assert refused.wait(15)
            for h in HASHES:  # evicted one by one: eight inventory messages, each a removal
                p0.announce_removed(ns, pb.TIER_GPU, [h])
                p0.applied(15)  # a round trip on the session: housekeeping as well
            with BrokerClient(proc.address, security=pki.mtls("root")) as root:
                assert not root.resolve(namespace=ns, block_hashes=HASHES).matches  # nothing evicted is named
            assert p0.connected
        finally:
            stop.set()
            p0.close()


def test_the_block_quota_does_not_count_blocks_already_indexed(pki: Pki, tmp_path: Path) -> None:
    with _broker(pki, tmp_path, "--quota-blocks", "8") as proc:
        channel, s = stub(proc.address, pki.mtls("p0"))
        ups: queue.Queue[pb.SessionUp | None] = queue.Queue()
        downs = s.Session(iter(ups.get, None), timeout=30)
        try:
            ups.put(pb.SessionUp(seq=1, register=pb.Register(engine=engine_info("p0"))))
            layout = next(downs).registered.layout_id
            ns = pb.Namespace(layout_id=layout, tenant="acme/")

            def inventory(seq: int, hashes: list[int]) -> pb.SessionDown:
                """Send a raw inventory (a resync re-announces what is indexed) and a heartbeat after it:
                the first answer is the inventory's error, if any, else the heartbeat's."""
                ups.put(
                    pb.SessionUp(
                        seq=seq, inventory=pb.InventoryUpdate(namespace=ns, tier=pb.TIER_GPU, stored=hashes)
                    )
                )
                ups.put(pb.SessionUp(seq=seq + 1, heartbeat=pb.Heartbeat()))
                return next(downs)

            assert inventory(2, HASHES[:6]).WhichOneof("msg") == "heartbeat_ack"
            # The chain again, two blocks longer: six are indexed already, two are new (8 in all).
            answer = inventory(4, HASHES)
            assert answer.WhichOneof("msg") == "heartbeat_ack", answer
            # Past the quota, a new block is still refused.
            answer = inventory(6, [*HASHES, 0x5109])
            assert answer.seq == 6 and answer.error.cause == "quota_exceeded", answer
            with BrokerClient(proc.address, security=pki.mtls("root")) as root:
                (match,) = root.resolve(namespace=ns, block_hashes=[*HASHES, 0x5109]).matches
                assert match.matched_blocks == 8
        finally:
            ups.put(None)
            channel.close()

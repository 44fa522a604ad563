"""Unit tests of the client pieces that need no broker: errors, inventory mirror, back-off."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.clients import errors
from kvbroker.clients.aio import build_request, trace_metadata
from kvbroker.clients.clock import Backoff
from kvbroker.clients.inventory import InventoryMirror
from kvbroker.common.causes import Cause
from kvbroker.v1 import broker_pb2 as pb

GPU = pb.TIER_GPU
KEY = ("layout", "tenant", GPU)


@pytest.mark.parametrize(
    ("code", "cls", "retryable"),
    [
        (grpc.StatusCode.NOT_FOUND, errors.NotFound, False),
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument, False),
        (grpc.StatusCode.OUT_OF_RANGE, errors.OutOfRange, False),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition, False),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied, False),
        (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExists, True),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted, False),
        (grpc.StatusCode.INTERNAL, errors.Internal, True),
    ],
)
def test_status_maps_to_one_typed_error(code: grpc.StatusCode, cls: type, retryable: bool) -> None:
    err = errors.from_status(code, "lease l1 not found")
    assert type(err) is cls
    assert isinstance(err, errors.BrokerError)
    assert err.code == code
    assert err.message == "lease l1 not found"
    assert err.retryable is retryable
    assert str(err) == f"{code.name}: lease l1 not found"


def test_every_status_code_has_an_error_class() -> None:
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        assert code in errors.ERROR_OF_STATUS, code


def test_the_cause_is_data_and_never_read_from_the_message() -> None:
    err = errors.from_status(
        grpc.StatusCode.FAILED_PRECONDITION,
        "lease l1 was revoked (reader_gone): reader 'd' session ended; discard anything read under it",
    )
    assert isinstance(err, errors.FailedPrecondition) and err.cause == ""
    err = errors.from_status(grpc.StatusCode.FAILED_PRECONDITION, "lease l1 was already released")
    assert isinstance(err, errors.FailedPrecondition) and err.cause == ""
    err = errors.from_status(
        grpc.StatusCode.FAILED_PRECONDITION, "ended", cause="ttl_expired", metadata={"lease_id": "l1"}
    )
    assert isinstance(err, errors.FailedPrecondition)
    assert err.cause == "ttl_expired" == Cause.TTL_EXPIRED and err.metadata == {"lease_id": "l1"}
    # Every error type carries a cause; a cause this client does not know passes through.
    err = errors.from_status(grpc.StatusCode.NOT_FOUND, "x", cause="some_future_cause")
    assert isinstance(err, errors.NotFound) and err.cause == "some_future_cause"
    # The positional signature of FailedPrecondition is unchanged: (message, code, cause).
    assert errors.FailedPrecondition("m", None, "released").cause == "released"


def test_session_error_code_names() -> None:
    assert isinstance(errors.from_code_name("NOT_FOUND", "x"), errors.NotFound)
    assert isinstance(errors.from_code_name("invalid_argument", "x"), errors.InvalidArgument)
    assert isinstance(errors.from_code_name("NO_SUCH_CODE", "x"), errors.Unknown)
    err = errors.from_session_error(
        pb.SessionError(
            code="FAILED_PRECONDITION", message="m", cause="draining", metadata={"engine_id": "P"}
        )
    )
    assert isinstance(err, errors.FailedPrecondition)
    assert (err.cause, err.metadata, err.message) == ("draining", {"engine_id": "P"}, "m")


def test_build_request_from_fields_or_message() -> None:
    req = build_request(pb.RevokeRequest, None, {"lease_id": "l1", "reason": "test"})
    assert req.lease_id == "l1"
    given = pb.RevokeRequest(lease_id="l2")
    assert build_request(pb.RevokeRequest, given, {}) is given
    with pytest.raises(errors.InvalidArgument, match="RevokeRequest"):
        build_request(pb.RevokeRequest, None, {"no_such_field": 1})
    with pytest.raises(TypeError):
        build_request(pb.RevokeRequest, given, {"reason": "both"})


def test_trace_metadata_only_with_a_current_span() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    assert trace_metadata() is None
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("outer") as span:
        metadata = dict(trace_metadata() or ())
        trace_id = format(span.get_span_context().trace_id, "032x")
    assert metadata["traceparent"].split("-")[1] == trace_id


def test_backoff_grows_caps_and_jitters() -> None:
    backoff = Backoff(initial_s=0.1, max_s=2.0, multiplier=2.0, jitter=0.5)
    no_jitter = [backoff.delay(n, rand=lambda: 0.0) for n in range(8)]
    assert no_jitter == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0])
    full_jitter = [backoff.delay(n, rand=lambda: 1.0) for n in range(3)]
    assert full_jitter == pytest.approx([0.05, 0.1, 0.2])
    assert backoff.delay(10_000) <= 2.0  # no overflow for long outages


def _contents(updates: list[pb.InventoryUpdate]) -> tuple[set[int], set[int], list[bool]]:
    stored: set[int] = set()
    removed: set[int] = set()
    for u in updates:
        stored.update(u.stored)
        removed.update(u.removed)
    return stored, removed, [u.clear_all for u in updates]


def test_mirror_coalesces_stored_then_removed() -> None:
    mirror = InventoryMirror()
    mirror.stored(KEY, [1, 2, 3])
    mirror.stored(KEY, [3, 4])  # 3 again: no duplicate
    mirror.removed(KEY, [2, 99])  # 99 was never held: nothing to take back
    assert mirror.pending_count == 3
    stored, removed, clears = _contents(mirror.take_updates())
    assert stored == {1, 3, 4} and removed == set() and clears == [False]
    assert mirror.pending_count == 0
    mirror.removed(KEY, [1])
    mirror.stored(KEY, [1])  # back again before the flush: the broker need not hear of it
    mirror.removed(KEY, [3])
    mirror.stored(KEY, [5])
    mirror.removed(KEY, [5])  # came and went between flushes: nothing to send
    stored, removed, _ = _contents(mirror.take_updates())
    assert stored == set() and removed == {3}
    assert mirror.held(KEY) == {1, 4}
    assert mirror.take_updates() == []


def test_mirror_chunks_and_full_sync() -> None:
    mirror = InventoryMirror()
    other = ("layout", "tenant", pb.TIER_CPU)
    mirror.stored(KEY, range(10))
    mirror.stored(("layout", "other-tenant", GPU), [50])
    mirror.stored(other, [100])
    mirror.take_updates()
    mirror.removed(KEY, [0])
    updates = mirror.full_sync_updates(max_hashes=4)
    # One clear_all per tier, first, then the blocks in chunks.
    clears = [u for u in updates if u.clear_all]
    assert sorted(u.tier for u in clears) == [GPU, pb.TIER_CPU]
    assert all(not u.stored and not u.removed for u in clears)
    assert updates[: len(clears)] == clears
    gpu = [u for u in updates if u.tier == GPU and u.namespace.tenant == "tenant" and not u.clear_all]
    assert [len(u.stored) for u in gpu] == [4, 4, 1]
    assert set().union(*(set(u.stored) for u in gpu)) == set(range(1, 10))
    cpu = [u for u in updates if u.tier == pb.TIER_CPU and not u.clear_all]
    assert len(cpu) == 1 and list(cpu[0].stored) == [100]
    assert mirror.pending_count == 0


def test_mirror_clear_tier_then_store_keeps_clear_first() -> None:
    mirror = InventoryMirror()
    mirror.stored(KEY, [1, 2])
    mirror.take_updates()
    mirror.clear_tier(GPU)
    mirror.stored(KEY, [5])
    updates = mirror.take_updates()
    assert [u.clear_all for u in updates] == [True, False]
    assert list(updates[1].stored) == [5]
    assert mirror.held(KEY) == {5}


def test_mirror_clear_one_namespace_sends_removals() -> None:
    mirror = InventoryMirror()
    other = ("layout", "other", GPU)
    mirror.stored(KEY, [1, 2])
    mirror.stored(other, [3])
    mirror.take_updates()
    mirror.clear(KEY)
    updates = mirror.take_updates()
    assert len(updates) == 1 and not updates[0].clear_all
    assert sorted(updates[0].removed) == [1, 2]
    assert mirror.held(other) == {3}


def test_mirror_adopts_the_registered_layout() -> None:
    mirror = InventoryMirror()
    mirror.stored(("", "t", GPU), [7, 8])
    mirror.removed(("", "t", GPU), [8])
    mirror.adopt_layout("L")
    assert mirror.keys() == [("L", "t", GPU)]
    stored, removed, _ = _contents(mirror.take_updates())
    assert stored == {7} and removed == set()


def _apply(broker: dict[tuple[str, str, int], set[int]], updates: list[pb.InventoryUpdate]) -> None:
    """What the broker does with an InventoryUpdate: clear the whole tier first, then removed, stored."""
    for u in updates:
        key = (u.namespace.layout_id, u.namespace.tenant, u.tier)
        if u.clear_all:
            for other in broker:
                if other[2] == u.tier:
                    broker[other].clear()
        blocks = broker.setdefault(key, set())
        assert not set(u.stored) & set(u.removed)
        blocks.update(u.stored)
        blocks.difference_update(u.removed)


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["stored", "removed", "clear", "clear_tier", "flush", "resync"]),
        st.sampled_from([GPU, pb.TIER_CPU]),
        st.sampled_from(["", "t2"]),
        st.lists(st.integers(0, 12), max_size=6),
    ),
    max_size=40,
)


@given(_OPS)
def test_mirror_keeps_the_broker_equal_to_what_the_engine_holds(ops: list) -> None:
    mirror = InventoryMirror()
    broker: dict[tuple[str, str, int], set[int]] = {}
    keys = [("L", tenant, tier) for tenant in ("", "t2") for tier in (GPU, pb.TIER_CPU)]
    held: dict[tuple[str, str, int], set[int]] = {key: set() for key in keys}
    for op, tier, tenant, hashes in ops:
        key = ("L", tenant, tier)
        if op == "stored":
            mirror.stored(key, hashes)
            held[key].update(hashes)
        elif op == "removed":
            mirror.removed(key, hashes)
            held[key].difference_update(hashes)
        elif op == "clear":
            mirror.clear(key)
            held[key].clear()
        elif op == "clear_tier":
            mirror.clear_tier(tier)
            for other in keys:
                if other[2] == tier:
                    held[other].clear()
        elif op == "flush":
            _apply(broker, mirror.take_updates(max_hashes=3))
        else:  # a fresh broker after a restart
            broker = {}
            _apply(broker, mirror.full_sync_updates(max_hashes=3))
    _apply(broker, mirror.take_updates(max_hashes=3))
    for key in keys:
        assert broker.get(key, set()) == held[key]
        assert mirror.held(key) == held[key]


def test_several_broker_addresses_make_one_target_over_all_replicas() -> None:
    from kvbroker.clients.credentials import _authority, channel_target

    assert channel_target("localhost:50051") == "localhost:50051"  # one address: as given
    assert channel_target("127.0.0.1:1,localhost:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert _authority("localhost:50051") == []
    assert _authority("broker-a:1,broker-b:1", tls=True) == [
        ("grpc.default_authority", "broker-a"),
        ("grpc.ssl_target_name_override", "broker-a"),
    ]
    with pytest.raises(ValueError, match="not host:port"):
        channel_target("127.0.0.1:1,nohost")

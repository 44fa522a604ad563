"""Seeded wire fuzzing of a real `kvbroker serve` process (on its in-memory default, and as a replica
over a real redis-server): random, truncated and mutated bytes to every method the service
declares, unary and streaming alike.

Every call must end with a status that names the caller's mistake (or OK, where the bytes happen
to decode into a request the broker can answer), never INTERNAL, UNKNOWN or UNAVAILABLE; the
broker must stay up, answer an honest call afterwards and log no traceback. The client is grpc's
synchronous one: grpc-aio's client can report INTERNAL for a stream the server ended while the
client was still writing (grpc/grpc#36066), which says nothing about the server.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory

from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info
from testkit.processes import BrokerProcess
from testkit.redis_server import missing_reason, running_redis

pytestmark = pytest.mark.timeout(120)

SERVICE = pb.DESCRIPTOR.services_by_name["KVBroker"]
# What a call with bad bytes may end with: the caller's mistake, an answer, or (streams only, which
# stay open when the bytes decode into a valid request) the client's own deadline.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
}


@pytest.fixture(scope="module", params=["in-memory", "redis"])
def broker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BrokerProcess]:
    """The broker on its default state, and a replica over a real redis-server (the store's path)."""
    work = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    with contextlib.ExitStack() as stack:
        args = ["--register-timeout-ms", "500"]
        if request.param == "redis":
            reason = missing_reason()
            if reason:
                pytest.skip(reason)
            args += ["--state", stack.enter_context(running_redis(work / "redis")).url]
        proc = BrokerProcess(work, args).start()
        stack.callback(proc.stop)
        yield proc


def _payloads(rng: random.Random, valid: bytes) -> Iterator[bytes]:
    """Random bytes, a valid request cut short or with bytes flipped, a length that lies, nothing."""
    yield bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))
    big = pb.HoldRequest(holder_engine_id="E" * 40, block_hashes=list(range(1, 40))).SerializeToString()
    yield big[: rng.randint(1, len(big) - 1)]
    flipped = bytearray(valid or big)
    for _ in range(3):
        flipped[rng.randrange(len(flipped))] = rng.randrange(256)
    yield bytes(flipped)
    yield bytes([0x0A, 0xFF, 0xFF, 0xFF, 0xFF, 0x0F]) + b"x" * 8  # field 1 says 4 GiB follow
    yield bytes([rng.choice([0x08, 0x10, 0x1A, 0x22]), 0x80, 0x80, 0x80])  # a varint that never ends
    yield b""


def _valid(method: object) -> bytes:
    """A request of the method's type with every string field set: something to mutate."""
    cls = message_factory.GetMessageClass(method.input_type)  # type: ignore[attr-defined]
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if field.type == field.TYPE_STRING:
            with contextlib.suppress(AttributeError, TypeError):  # a repeated field: left empty
                setattr(msg, field.name, "fuzz")
    return msg.SerializeToString()  # type: ignore[no-any-return]


def _call(channel: grpc.Channel, method: object, data: bytes) -> grpc.StatusCode:
    path = f"/{SERVICE.full_name}/{method.name}"  # type: ignore[attr-defined]
    client_streams = method.client_streaming  # type: ignore[attr-defined]
    server_streams = method.server_streaming  # type: ignore[attr-defined]
    try:
        if not client_streams and not server_streams:
            channel.unary_unary(path)(data, timeout=5)
        elif not client_streams:
            for _ in channel.unary_stream(path)(data, timeout=1.5):
                break
        else:
            for _ in channel.stream_stream(path)(iter([data, data, b"\xff\xff"]), timeout=1.5):
                pass
    except grpc.RpcError as err:
        code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
        if code is grpc.StatusCode.DEADLINE_EXCEEDED and server_streams:
            return grpc.StatusCode.OK  # a stream the bytes opened validly, closed by our deadline
        return code
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
def test_bad_bytes_to_every_method_get_a_precise_status(broker: BrokerProcess, method: object) -> None:
    rng = random.Random(f"kvbroker-fuzz-{method.name}")  # type: ignore[attr-defined]
    seen: dict[str, int] = {}
    with grpc.insecure_channel(broker.address) as channel:
        for data in _payloads(rng, _valid(method)):
            code = _call(channel, method, data)
            seen[code.name] = seen.get(code.name, 0) + 1
            assert code in ALLOWED, f"{method.name}: {data[:40]!r} ended {code.name}; {seen}"  # type: ignore[attr-defined]
    assert broker.alive(), broker.log_tail()


def test_the_broker_still_serves_and_logged_no_traceback(broker: BrokerProcess) -> None:
    with grpc.insecure_channel(broker.address) as channel:
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        assert stub.Stats(pb.StatsRequest(), timeout=5).engines >= 0
        up = iter([pb.SessionUp(seq=1, register=pb.Register(engine=engine_info("fuzz-after")))])
        first = next(iter(stub.Session(up, timeout=5)))
        assert first.WhichOneof("msg") == "registered"
    log = Path(broker.log_path).read_text()
    assert "Traceback" not in log, log[-4000:]

"""A hostile, foreign client for the process tests: messages built from server reflection, raw bytes.

Nothing here imports the generated kvbroker code: what the broker's reflection
service describes is all this client knows, as a client written in another
language would. `ForeignClient.call` sends any unary request, `stream` opens a
server stream, and `raw_*` send bytes as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from testkit.ports import free_port
from testkit.processes import BrokerProcess

SERVICE = "kvbroker.v1.KVBroker"


class ForeignClient:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.pool = descriptor_pool.DescriptorPool()
        self.service: Any = None

    async def load(self) -> ForeignClient:
        stub = reflection_pb2_grpc.ServerReflectionStub(self.channel)
        call = stub.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE))
        answer = await call.read()
        await call.done_writing()
        for raw in answer.file_descriptor_response.file_descriptor_proto:
            self.pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
        self.service = self.pool.FindServiceByName(SERVICE)
        return self

    def message(self, name: str, **fields: Any) -> Any:
        cls = message_factory.GetMessageClass(self.pool.FindMessageTypeByName(f"kvbroker.v1.{name}"))
        return cls(**fields)

    def _method(self, name: str) -> Any:
        return self.service.methods_by_name[name]

    async def call(self, method: str, metadata: Sequence[tuple[str, str]] = (), **fields: Any) -> Any:
        m = self._method(method)
        request = self.message(m.input_type.name, **fields)
        response = message_factory.GetMessageClass(m.output_type)
        rpc = self.channel.unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=lambda msg: msg.SerializeToString(),
            response_deserializer=response.FromString,
        )
        return await rpc(request, metadata=tuple(metadata) or None, timeout=10)

    def stream(self, method: str, **fields: Any) -> Any:
        m = self._method(method)
        request = self.message(m.input_type.name, **fields)
        response = message_factory.GetMessageClass(m.output_type)
        rpc = self.channel.unary_stream(
            f"/{SERVICE}/{method}",
            request_serializer=lambda msg: msg.SerializeToString(),
            response_deserializer=response.FromString,
        )
        return rpc(request)

    def raw_stream(self, method: str, data: bytes) -> Any:
        return self.channel.unary_stream(f"/{SERVICE}/{method}")(data)


async def status_of(coro: Any) -> grpc.aio.AioRpcError:
    try:
        await coro
    except grpc.aio.AioRpcError as err:
        return err
    raise AssertionError("the call succeeded")


def dual_stack_broker(tmp_path: Path, *extra: str) -> BrokerProcess:
    """A `kvbroker serve` process listening on [::] (so ::1 and 127.0.0.1 are two hosts to it), plaintext."""
    port = free_port()
    broker = BrokerProcess(
        tmp_path,
        [
            "--address",
            f"[::]:{port}",
            "--insecure",
            "--session-ttl-min-ms",
            "100",
            "--expiry-interval-ms",
            "20",
            *extra,
        ],
        port=port,
        priority=None,
    )
    return broker.start()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")

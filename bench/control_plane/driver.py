"""Drive a real broker process over raw generated gRPC stubs.

The benchmark talks to the broker with the generated ``kvbroker.v1`` stubs, not the
client library, so the figures are the broker's (plus grpc.aio's) and not any
client-side bookkeeping. ``RawSession`` is a minimal engine session: register,
heartbeat at a third of the TTL, send inventory without waiting, and resolve with
replies matched by ``seq``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import grpc

from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info, fingerprint
from testkit.processes import BrokerProcess, python_env

# Messages of a 10M-block load are big; lift grpc's 4 MiB default on our side.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]


def bench_layout() -> pb.LayoutFingerprint:
    return fingerprint(model="bench/tiny", head_size=64, kv_layout="")


def bench_engine(engine_id: str) -> pb.EngineInfo:
    info = engine_info(
        engine_id,
        ranks=1,
        agent_name="{engine_id}-r0",
        agent_metadata=b"bench-agent-metadata",
        num_blocks=1 << 20,
        labels={"role": "bench"},
        model="bench/tiny",
        head_size=64,
        kv_layout="",
    )
    # Registered memory: one region per layer, far apart.
    info.ranks[0].tiers[0].regions.extend(
        [
            pb.MemoryRegion(layer=0, base_addr=1 << 20, block_stride=4096, block_bytes=4096),
            pb.MemoryRegion(layer=1, base_addr=1 << 32, block_stride=4096, block_bytes=4096),
        ]
    )
    return info


def start_broker(log_dir: Path, extra_args: Sequence[str] = ()) -> BrokerProcess:
    """``python -m kvbroker.broker --address 127.0.0.1:PORT [extra args]``, started.

    As the broker benchmark has always run it: its own log level, no priority
    change, the source tree on PYTHONPATH, a minute to start."""
    return BrokerProcess(log_dir, extra_args, log_level=None, priority=None, env=python_env()).start(
        timeout=60
    )


class RawSession:
    """One engine's session stream, driven directly with the generated stubs."""

    def __init__(self, stub: broker_pb2_grpc.KVBrokerAsyncStub, engine_id: str, ttl_ms: int = 30_000):
        self.stub = stub
        self.engine_id = engine_id
        self.ttl_ms = ttl_ms
        self.layout_id = ""
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future[pb.SessionDown]] = {}
        self._write_lock = asyncio.Lock()
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self.errors: list[pb.SessionError] = []

    async def open(self) -> None:
        self._call = self.stub.Session()
        self._reader = asyncio.create_task(self._read_loop())
        reg = await self.request(
            pb.SessionUp(
                register=pb.Register(engine=bench_engine(self.engine_id), session_ttl_ms=self.ttl_ms)
            )
        )
        if reg.WhichOneof("msg") != "registered":
            raise RuntimeError(f"{self.engine_id}: registration answered {reg}")
        self.layout_id = reg.registered.layout_id
        ttl = reg.registered.session_ttl_ms or self.ttl_ms
        interval = (reg.registered.heartbeat_interval_ms or ttl // 3) / 1000.0
        self._heartbeat = asyncio.create_task(self._heartbeat_loop(interval))

    async def _read_loop(self) -> None:
        assert self._call is not None
        while True:
            down = await self._call.read()
            if not isinstance(down, pb.SessionDown):  # grpc.aio.EOF: the stream ended
                break
            kind = down.WhichOneof("msg")
            fut = self._pending.pop(down.seq, None) if down.seq else None
            if fut is not None and not fut.done():
                fut.set_result(down)
            elif kind == "error":
                self.errors.append(down.error)
        err = RuntimeError(f"{self.engine_id}: session stream ended")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)

    async def _heartbeat_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.send(pb.SessionUp(heartbeat=pb.Heartbeat(load=0.0)))

    async def send(self, up: pb.SessionUp) -> None:
        """Write without waiting for an answer (inventory, heartbeats)."""
        assert self._call is not None
        if not up.seq:
            up.seq = next(self._seq)
        async with self._write_lock:
            await self._call.write(up)

    async def request(self, up: pb.SessionUp) -> pb.SessionDown:
        """Write and wait for the reply that carries the same seq."""
        up.seq = next(self._seq)
        fut: asyncio.Future[pb.SessionDown] = asyncio.get_running_loop().create_future()
        self._pending[up.seq] = fut
        await self.send(up)
        return await fut

    async def resolve(self, ns: pb.Namespace, hashes: Sequence[int]) -> pb.ResolveResponse:
        down = await self.request(pb.SessionUp(resolve=pb.ResolveRequest(namespace=ns, block_hashes=hashes)))
        if down.WhichOneof("msg") != "resolve":
            raise RuntimeError(f"{self.engine_id}: resolve answered {down}")
        return down.resolve

    async def announce(
        self, ns: pb.Namespace, stored: Sequence[int], tier: pb.Tier.ValueType = pb.TIER_GPU
    ) -> None:
        await self.send(pb.SessionUp(inventory=pb.InventoryUpdate(namespace=ns, tier=tier, stored=stored)))

    async def barrier(self, ns: pb.Namespace) -> None:
        """Wait until the broker has applied everything sent before (the stream is ordered)."""
        await self.resolve(ns, [0])
        if self.errors:
            raise RuntimeError(f"{self.engine_id}: broker reported {self.errors[0]}")

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._call is not None:
            with contextlib.suppress(Exception):
                await self._call.done_writing()
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader


async def open_sessions(
    stubs: Sequence[broker_pb2_grpc.KVBrokerAsyncStub], engine_ids: Sequence[str], parallel: int = 32
) -> list[RawSession]:
    """Register one session per engine id, spread round-robin over the given channels."""
    sessions = [RawSession(stubs[i % len(stubs)], e) for i, e in enumerate(engine_ids)]
    sem = asyncio.Semaphore(parallel)

    async def one(s: RawSession) -> None:
        async with sem:
            await s.open()

    await asyncio.gather(*(one(s) for s in sessions))
    return sessions


def async_stub(channel: grpc.aio.Channel) -> broker_pb2_grpc.KVBrokerAsyncStub:
    """The stub of an asyncio channel, typed as the generated stubs' __new__ overload says (mypy,
    which reads grpc as untyped here, picks the blocking overload)."""
    return cast("broker_pb2_grpc.KVBrokerAsyncStub", broker_pb2_grpc.KVBrokerStub(channel))


def make_channels(address: str, n: int) -> list[grpc.aio.Channel]:
    # Distinct channel args keep grpc from sharing one subchannel (one TCP connection).
    return [
        grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, ("bench.channel", i)]) for i in range(n)
    ]

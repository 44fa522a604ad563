"""--kv-events against a real broker process: a ZMQ publisher speaking vLLM's wire format.

The publisher here sends what vLLM's ZmqEventPublisher sends (three frames:
topic, 8-byte big-endian sequence number, a msgpack batch ``[ts, [events], dp_rank]``
with events as tagged maps, hashes as vLLM's int form). The real vLLM engine:
test_kv_events_vllm.py. Here: the CLI marks the engine, /metrics counts its
events, the connector's engine id wins, and a publisher that goes away is forgotten.
"""

from __future__ import annotations

import io
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import hash_block, none_hash, wire_chain
from kvbroker.tools import cli
from kvbroker.v1 import broker_pb2 as pb
from testkit.ports import free_port
from testkit.processes import SERVE, BrokerProcess
from testkit.waiting import wait_for

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

pytestmark = pytest.mark.timeout(60)

BLOCK = 32
PROMPT = [(i * 31) % 500 + 1 for i in range(4 * BLOCK)]


def vllm_int_hashes(tokens: list[int]) -> list[int]:
    parent = none_hash()
    out = []
    for i in range(0, len(tokens), BLOCK):
        parent = hash_block("sha256", parent, tokens[i : i + BLOCK])
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


class Publisher:
    """vLLM's side: a bound PUB socket, a sequence number, msgpack batches, and (with
    `replay_port`) a ROUTER socket answering replay requests from its buffer, as vLLM's does."""

    def __init__(self, port: int, replay_port: int = 0) -> None:
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.PUB)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replays: list[int] = []
        self._done = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_port:
            router = ctx.socket(zmq.ROUTER)
            router.bind(f"tcp://127.0.0.1:{replay_port}")
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(router,), daemon=True)
            self._replay_thread.start()

    def _serve_replay(self, router: Any) -> None:
        while not self._done.is_set():
            if not router.poll(50):
                continue
            client, _, start = router.recv_multipart()
            self.replays.append(int.from_bytes(start, "big"))
            for seq, payload in list(self.buffer):
                if seq >= self.replays[-1]:
                    router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        router.close(linger=0)

    def send(self, *events: dict[str, Any]) -> None:
        payload = msgspec.msgpack.encode([time.time(), list(events), None])
        self.buffer.append((self.seq, payload))
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self._done.set()
        if self._replay_thread is not None:
            self._replay_thread.join(5)
        self.sock.close(linger=0)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[BrokerProcess, Publisher, int]]:
    events, metrics = free_port(), free_port()
    spec = f"ev=tcp://127.0.0.1:{events}?model=tiny-llama&block_size={BLOCK}"
    broker = BrokerProcess(tmp_path, ["--kv-events", spec, "--metrics-port", str(metrics)], command=SERVE)
    broker.start()
    publisher = Publisher(events)
    try:
        yield broker, publisher, metrics
    finally:
        publisher.close()
        broker.stop()


def _cli(address: str, *argv: str) -> str:
    out = io.StringIO()
    assert cli.main(["--broker", address, *argv], out=out) == 0
    return out.getvalue()


def test_event_fed_engine_is_scored_marked_and_counted(stack: tuple[BrokerProcess, Publisher, int]) -> None:
    broker, publisher, metrics_port = stack
    hashes = vllm_int_hashes(PROMPT)
    with BrokerClient(broker.address) as client:
        assert wait_for(lambda: any(e.engine_id == "ev" for e in client.list_engines().engines), 10)
        # ZMQ's slow joiner: the subscription reaches the publisher a moment after the connection,
        # and a PUB socket drops what it sends before (the broker's `replay=` covers that case).
        time.sleep(0.3)
        layout = next(e.layout_id for e in client.list_engines().engines)
        ns = pb.Namespace(layout_id=layout, tenant="")
        stored = {
            "type": "BlockStored",
            "block_hashes": hashes[:3],
            "parent_block_hash": None,
            "token_ids": PROMPT[: 3 * BLOCK],
            "block_size": BLOCK,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        orphan = {**stored, "block_hashes": [12345], "parent_block_hash": 999, "token_ids": PROMPT[:BLOCK]}
        publisher.send(stored, orphan)

        def gpu_blocks() -> int:
            scores = client.score(namespace=ns, token_ids=PROMPT).scores
            return scores[0].gpu_blocks if scores else -1

        assert wait_for(lambda: gpu_blocks() == 3, 10), gpu_blocks()
        assert client.score(namespace=ns, block_hashes=wire_chain(PROMPT, BLOCK)).scores[0].engine_id == "ev"
        assert not client.resolve(namespace=ns, block_hashes=wire_chain(PROMPT, BLOCK)).matches
        engines = _cli(broker.address, "engines")
        assert "kv-events" in engines.splitlines()[1], engines
        score = _cli(broker.address, "score", "--layout-id", layout, "--tokens", ",".join(map(str, PROMPT)))
        assert "kv-events" in score.splitlines()[1], score
        # Evicted: gone from the index.
        publisher.send({"type": "BlockRemoved", "block_hashes": hashes[1:3], "medium": "GPU"})
        assert wait_for(lambda: gpu_blocks() == 1, 10), gpu_blocks()
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert 'kvbroker_kv_events_connected{engine="ev"} 1.0' in text
        assert 'kvbroker_kv_events_blocks_total{engine="ev",outcome="stored"} 3.0' in text
        assert 'kvbroker_kv_events_blocks_total{engine="ev",outcome="unknown_parent"} 1.0' in text
        assert 'kvbroker_kv_events_blocks_total{engine="ev",outcome="removed"} 2.0' in text
        # Everything cleared.
        publisher.send({"type": "AllBlocksCleared"})
        assert wait_for(lambda: gpu_blocks() == 0, 10), gpu_blocks()
        # The publisher goes away: the engine is forgotten.
        publisher.close()
        assert wait_for(lambda: not client.list_engines().engines, 10)


def test_malformed_frames_do_not_hurt_the_broker(stack: tuple[BrokerProcess, Publisher, int]) -> None:
    broker, publisher, _ = stack
    with BrokerClient(broker.address) as client:
        assert wait_for(lambda: bool(client.list_engines().engines), 10)
        publisher.sock.send_multipart([b"", b"short", b"x"])
        publisher.sock.send_multipart([b"", (5).to_bytes(8, "big"), b"\xc1not msgpack"])
        publisher.send({"type": "BlockStored", "block_hashes": "nope"}, ["Mystery", 1], 42)
        publisher.send(
            {"type": "BlockStored", "block_hashes": [1], "token_ids": [1] * BLOCK, "block_size": BLOCK}
        )
        time.sleep(0.5)
        assert broker.alive() and [e.engine_id for e in client.list_engines().engines] == ["ev"]


def test_watch_marks_the_engine_and_operators_can_drain_it(tmp_path: Path) -> None:
    events_port = free_port()
    spec = f"ev=tcp://127.0.0.1:{events_port}?model=tiny-llama&block_size={BLOCK}"
    with BrokerProcess(tmp_path, ["--kv-events", spec, "--metrics-port", "0"], command=SERVE) as broker:
        seen: list[Any] = []

        def follow() -> None:
            with BrokerClient(broker.address) as watcher:
                for event in watcher.watch():
                    seen.append(event)
                    if event.kind == "engine_gone":
                        return

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        time.sleep(0.5)  # the watch is open before the publisher comes
        publisher = Publisher(events_port)
        try:
            assert wait_for(lambda: any(e.kind == "engine_registered" for e in seen), 10), seen
            registered = next(e for e in seen if e.kind == "engine_registered")
            assert registered.engine_id == "ev" and registered.detail.endswith("(kv-events)")
            # Draining an engine that has no session is harmless: it stops being named.
            assert "draining" in _cli(broker.address, "drain", "ev")
            assert "draining" in _cli(broker.address, "engines").splitlines()[1]
        finally:
            publisher.close()
        thread.join(10)
        assert seen[-1].kind == "engine_gone" and broker.alive()


def _stored(tokens: list[int], hashes: list[int], first: int, count: int) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes[first : first + count],
        "parent_block_hash": hashes[first - 1] if first else None,
        "token_ids": tokens[first * BLOCK : (first + count) * BLOCK],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def test_batches_published_before_the_broker_came_are_replayed(tmp_path: Path) -> None:
    events_port, replay_port, metrics_port = free_port(), free_port(), free_port()
    publisher = Publisher(events_port, replay_port)
    hashes = vllm_int_hashes(PROMPT)
    try:
        # Published while nobody listens: lost on the PUB socket, kept in the replay buffer.
        publisher.send(_stored(PROMPT, hashes, 0, 2))
        publisher.send(_stored(PROMPT, hashes, 2, 1))
        spec = f"ev=tcp://127.0.0.1:{events_port}?model=tiny-llama&block_size={BLOCK}&replay=tcp://127.0.0.1:{replay_port}"
        args = ["--kv-events", spec, "--metrics-port", str(metrics_port)]
        with BrokerProcess(tmp_path, args, command=SERVE) as broker, BrokerClient(broker.address) as client:
            assert wait_for(lambda: bool(client.list_engines().engines), 10)
            time.sleep(0.3)  # the subscription is live (ZMQ's slow joiner)
            publisher.send(_stored(PROMPT, hashes, 3, 1))  # seq 2: the broker sees 0 and 1 are missing
            ns = pb.Namespace(layout_id=client.list_engines().engines[0].layout_id, tenant="")

            def gpu_blocks() -> int:
                scores = client.score(namespace=ns, token_ids=PROMPT).scores
                return scores[0].gpu_blocks if scores else -1

            assert wait_for(lambda: gpu_blocks() == 4, 10), (
                gpu_blocks(),
                publisher.replays,
                broker.log_tail(),
            )
            assert publisher.replays == [0]
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            )
            assert 'kvbroker_kv_events_replayed_total{engine="ev"} 2.0' in text
            assert 'kvbroker_kv_events_seq_gaps_total{engine="ev"} 0.0' in text
    finally:
        publisher.close()


async def test_an_index_mirror_scores_the_engine_but_never_resolves_it(tmp_path: Path) -> None:
    """In the layout of connector engines (the spec gives the full fingerprint), a router's or an
    engine's in-process index mirror ranks the event-fed engine in score, never in resolve."""
    import asyncio

    import grpc

    from kvbroker.clients.engine_session import EngineSession
    from kvbroker.clients.mirror import IndexMirror, follow
    from testkit import builders

    events_port = free_port()
    layout = "dtype=float32&num_layers=2&num_kv_heads=2&head_size=16&kv_layout="  # as builders registers
    spec = f"ev=tcp://127.0.0.1:{events_port}?model=tiny-llama&block_size={BLOCK}&{layout}"
    publisher = Publisher(events_port)
    hashes = vllm_int_hashes(PROMPT)
    with BrokerProcess(tmp_path, ["--kv-events", spec, "--metrics-port", "0"], command=SERVE) as broker:
        conn = EngineSession(broker.address, builders.engine_info("conn", ranks=1))
        await conn.start(wait_connected_s=10.0)
        channel = grpc.aio.insecure_channel(broker.address)
        mirror = IndexMirror(conn.layout_id)
        task = asyncio.create_task(follow(mirror, channel))
        try:
            conn.announce_stored((conn.layout_id, ""), pb.TIER_GPU, wire_chain(PROMPT, BLOCK)[:1])
            conn.flush()
            await asyncio.sleep(0.5)  # the publisher's subscription is live (ZMQ's slow joiner)
            publisher.send(_stored(PROMPT, hashes, 0, 3))
            chain = wire_chain(PROMPT, BLOCK)

            def scored() -> list[tuple[str, int]]:
                return [(s.engine_id, s.gpu_blocks) for s in mirror.score("", chain) or []]

            for _ in range(200):
                if scored()[:1] == [("ev", 3)]:
                    break
                await asyncio.sleep(0.05)
            assert scored() == [("ev", 3), ("conn", 1)], scored()
            resolved = mirror.resolve("", chain)
            assert resolved is not None and [m.engine_id for m in resolved] == ["conn"]
        finally:
            task.cancel()
            await channel.close()
            await conn.close()
            publisher.close()


# --------------------------------------------------------------------------- exactness (broker/exactness.py)


def _workers(port: int) -> dict[str, Any]:
    import json

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=5) as response:
        return {w["instance_id"]: w for w in json.loads(response.read())}


def test_lost_batches_degrade_the_engine_everywhere_until_a_clear(tmp_path: Path) -> None:
    events_port, metrics_port, http_port = free_port(), free_port(), free_port()
    publisher = Publisher(events_port)  # no replay endpoint: a gap is lost for good
    hashes = vllm_int_hashes(PROMPT)
    spec = f"ev=tcp://127.0.0.1:{events_port}?model=tiny-llama&block_size={BLOCK}"
    args = [
        "--kv-events",
        spec,
        "--metrics-port",
        str(metrics_port),
        "--indexer-http",
        f"127.0.0.1:{http_port}",
    ]
    try:
        with BrokerProcess(tmp_path, args, command=SERVE) as broker, BrokerClient(broker.address) as client:
            assert wait_for(lambda: bool(client.list_engines().engines), 10)
            time.sleep(0.3)  # the subscription is live (ZMQ's slow joiner)
            ns = pb.Namespace(layout_id=client.list_engines().engines[0].layout_id, tenant="")

            def score(**kw: Any) -> pb.EngineScore:
                return client.score(namespace=ns, token_ids=PROMPT, **kw).scores[0]

            publisher.send(_stored(PROMPT, hashes, 0, 2))
            assert wait_for(lambda: score().gpu_blocks == 2, 10)
            assert score().exactness == pb.INDEX_EXACT and _workers(http_port)["ev"]["exactness"] == "exact"
            publisher.seq += 1  # batch 1 never reaches the broker
            publisher.send(_stored(PROMPT, hashes, 2, 1))
            (engine,) = client.list_engines().engines
            assert wait_for(lambda: client.list_engines().engines[0].exactness == pb.INDEX_DEGRADED, 10)
            (engine,) = client.list_engines().engines
            assert "batches 1..1 were lost" in engine.exactness_reason
            assert score().exactness == pb.INDEX_DEGRADED
            assert score(require_exact=True).gpu_blocks == 0, "a router that requires exact counts nothing"
            worker = _workers(http_port)["ev"]
            assert worker["exactness"] == "degraded" and "lost" in worker["exactness_reason"]
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            )
            assert 'kvbroker_engines_by_exactness{exactness="degraded"} 1.0' in text
            assert 'kvbroker_engines_by_exactness{exactness="exact"} 0.0' in text
            assert _cli(broker.address, "engines").splitlines()[1].split()[7] == "degraded"
            # The engine starts its picture again from nothing: exact. The clear and the
            # store are two batches: exactness returns with the first, the block with the second.
            publisher.send({"type": "AllBlocksCleared"})
            publisher.send(_stored(PROMPT, hashes, 0, 1))
            assert wait_for(lambda: score(require_exact=True).gpu_blocks == 1, 10)
            assert score().exactness == pb.INDEX_EXACT
    finally:
        publisher.close()


def test_an_engine_is_lagging_while_its_missed_batches_are_replayed(tmp_path: Path) -> None:
    """The replay socket answers only once the test saw the engine lagging."""
    events_port, replay_port = free_port(), free_port()
    publisher = Publisher(events_port)
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    hashes = vllm_int_hashes(PROMPT)
    spec = f"ev=tcp://127.0.0.1:{events_port}?model=tiny-llama&block_size={BLOCK}&replay=tcp://127.0.0.1:{replay_port}"
    try:
        with (
            BrokerProcess(tmp_path, ["--kv-events", spec, "--metrics-port", "0"], command=SERVE) as broker,
            BrokerClient(broker.address) as client,
        ):
            assert wait_for(lambda: bool(client.list_engines().engines), 10)
            time.sleep(0.3)
            publisher.send(_stored(PROMPT, hashes, 0, 1))
            assert wait_for(lambda: client.list_engines().engines[0].blocks_gpu == 1, 10)
            missed = msgspec.msgpack.encode([time.time(), [_stored(PROMPT, hashes, 1, 1)], None])
            publisher.seq += 1  # batch 1 is lost on the PUB socket; the replay socket has it
            publisher.send(_stored(PROMPT, hashes, 2, 1))
            assert router.poll(10_000), "the broker did not ask for a replay"
            peer, _, start = router.recv_multipart()
            assert int.from_bytes(start, "big") == 1
            (engine,) = client.list_engines().engines
            assert engine.exactness == pb.INDEX_LAGGING, engine
            router.send_multipart([peer, b"", b"", (1).to_bytes(8, "big"), missed])
            router.send_multipart([peer, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
            assert wait_for(lambda: client.list_engines().engines[0].blocks_gpu == 3, 10)
            (engine,) = client.list_engines().engines
            assert (engine.exactness, engine.exactness_reason) == (pb.INDEX_EXACT, "")
    finally:
        router.close(linger=0)
        publisher.close()

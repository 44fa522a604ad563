"""A hostile KV-event publisher against a real broker process: a wildcard bind, a bad frame,
an oversized frame and a huge batch. The feed keeps following, memory and the event loop stay
bounded. (test_kv_events.py: the well-behaved publisher; test_kv_events_slices.py: a huge batch
and the event loop.)"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import wire_chain
from kvbroker.v1 import broker_pb2 as pb
from testkit.ports import free_port
from testkit.processes import SERVE, BrokerProcess
from testkit.waiting import wait_for
from tests.broker.indexer.test_kv_events import BLOCK, PROMPT, Publisher, vllm_int_hashes

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

pytestmark = pytest.mark.timeout(120)

HASHES = vllm_int_hashes(PROMPT)


def _stored(first: int, count: int) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": HASHES[first : first + count],
        "parent_block_hash": HASHES[first - 1] if first else None,
        "token_ids": PROMPT[first * BLOCK : (first + count) * BLOCK],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


class Stack:
    def __init__(self, broker: BrokerProcess, publisher: Publisher, metrics_port: int) -> None:
        self.broker, self.publisher, self.metrics_port = broker, publisher, metrics_port

    def metrics(self) -> str:
        return (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )

    def counted(self, name: str) -> float:
        """The sum of a counter family's samples for engine ev (0 if absent)."""
        pattern = re.compile(rf'^{name}_total\{{engine="ev"[^}}]*\}} ([0-9.e+]+)$', re.M)
        return sum(float(v) for v in pattern.findall(self.metrics()))

    def gpu_blocks(self, client: BrokerClient) -> int:
        engines = client.list_engines().engines
        if not engines:
            return -1
        ns = pb.Namespace(layout_id=engines[0].layout_id, tenant="")
        scores = client.score(namespace=ns, block_hashes=wire_chain(PROMPT, BLOCK)).scores
        return scores[0].gpu_blocks if scores else 0

    def subscribed(self, client: BrokerClient) -> None:
        """Wait until the broker follows the publisher, and its subscription is live."""
        assert wait_for(lambda: bool(client.list_engines().engines), 15), self.broker.log_tail()
        time.sleep(0.3)  # ZMQ's slow joiner: the subscription reaches the publisher a moment later


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    events, metrics = free_port(), free_port()
    spec = f"ev=tcp://127.0.0.1:{events}?model=tiny-llama&block_size={BLOCK}"
    broker = BrokerProcess(tmp_path, ["--kv-events", spec, "--metrics-port", str(metrics)], command=SERVE)
    broker.start()
    publisher = Publisher(events)
    try:
        yield Stack(broker, publisher, metrics)
    finally:
        publisher.close()
        broker.stop()


def test_a_wildcard_bind_needs_insecure(tmp_path: Path) -> None:
    spec = f"ev=tcp://*:{free_port()}?model=tiny-llama&block_size={BLOCK}"
    refused = BrokerProcess(tmp_path, ["--kv-events", spec], command=SERVE, log_name="refused.log")
    with pytest.raises(RuntimeError, match="--insecure"):
        refused.start(timeout=20)
    with BrokerProcess(tmp_path, ["--kv-events", spec, "--insecure"], command=SERVE, log_name="ok.log") as ok:
        assert ok.alive()
    # The same rule for a feed an operator registers over the indexer API.
    port = free_port()
    with BrokerProcess(tmp_path, ["--indexer-http", f"127.0.0.1:{port}"], log_name="api.log"):
        body = {
            "endpoint": f"tcp://*:{free_port()}?model=tiny-llama&block_size={BLOCK}",
            "instance_id": "bound",
            "modelname": "tiny-llama",
            "block_size": BLOCK,
        }
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/register", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        assert response.status == 403 and "--insecure" in answer["error"]["message"], answer


def _send_raw(publisher: Publisher, payload: bytes) -> None:
    publisher.sock.send_multipart([b"", publisher.seq.to_bytes(8, "big"), payload])
    publisher.seq += 1


def _deeply_nested_batch(depth: int = 100_000) -> bytes:
    # [ts, [[[[...]]]], dp_rank]: an array in an array, `depth` times.
    return b"\x93" + msgspec.msgpack.encode(1.0) + b"\x91" * depth + b"\xc0" + b"\xc0"


def test_bad_frames_are_skipped_and_the_feed_goes_on(stack: Stack) -> None:
    with BrokerClient(stack.broker.address) as client:
        stack.subscribed(client)
        publisher = stack.publisher
        _send_raw(publisher, _deeply_nested_batch())
        # A batch whose first event nests 100,000 deep (the rest of that frame is lost with it).
        nested_event = b"\x93" + msgspec.msgpack.encode(1.0) + b"\x92" + b"\x91" * 100_000 + b"\xc0"
        nested_event += msgspec.msgpack.encode(_stored(0, 1)) + b"\xc0"
        _send_raw(publisher, nested_event)
        publisher.send(_stored(0, 3))
        assert wait_for(lambda: stack.gpu_blocks(client) == 3, 15), stack.broker.log_tail()
        assert stack.broker.alive()
        assert stack.counted("kvbroker_kv_events_bad_frames") == 2
        assert stack.counted("kvbroker_kv_events_blocks") >= 3


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_an_oversized_frame_is_never_read_into_memory(stack: Stack) -> None:
    with BrokerClient(stack.broker.address) as client:
        stack.subscribed(client)
        before = _peak_rss_bytes(stack.broker.pid)
        frame = msgspec.msgpack.encode([time.time(), [b"\0" * (96 * 1024 * 1024)], None])
        _send_raw(stack.publisher, frame)
        del frame
        # The publisher is cut off and comes back (ZMQ reconnects); then it is followed as before.
        time.sleep(2.0)
        stack.subscribed(client)
        stack.publisher.send(_stored(0, 2))
        assert wait_for(lambda: stack.gpu_blocks(client) == 2, 15), stack.broker.log_tail()
        grown = _peak_rss_bytes(stack.broker.pid) - before
        assert grown < 32 * 1024 * 1024, f"the broker's peak memory grew by {grown / 2**20:.0f} MiB"

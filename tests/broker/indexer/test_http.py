"""The KV-indexer HTTP API against a real `kvbroker serve` process with engines registered.

The client below is written from Mooncake's indexer API (RFC #1403 as Dynamo
serves it): plain HTTP and JSON, no kvbroker code. Engines are real
EngineSession clients announcing real vLLM block hashes of known token ids.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbroker.clients.session import EngineSession
from kvbroker.common.hashing import wire_chain
from kvbroker.v1 import broker_pb2 as pb
from testkit import builders
from testkit.ports import free_port
from testkit.processes import SERVE, BrokerProcess

pytestmark = pytest.mark.timeout(90)

BLOCK = 32
PROMPT = [(i * 7919) % 32000 for i in range(6 * BLOCK + 5)]  # 6 full blocks and a partial one


class IndexerClient:
    """What a router written against the indexer API sends: JSON over HTTP/1.1."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def call(self, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        self.conn.request(method, path, body=data, headers=headers)
        response = self.conn.getresponse()
        return response.status, json.loads(response.read())

    def query(self, **body: Any) -> Any:
        status, answer = self.call("POST", "/query", {"model": "tiny-llama", "block_size": BLOCK, **body})
        assert status == 200, answer
        return answer


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[tuple[BrokerProcess, int]]:
    port = free_port()
    process = BrokerProcess(
        tmp_path, ["--indexer-http", f"127.0.0.1:{port}", "--metrics-port", "0"], command=SERVE
    )
    process.start()
    try:
        yield process, port
    finally:
        process.stop()


@pytest.fixture
async def engines(broker: tuple[BrokerProcess, int]) -> AsyncIterator[dict[str, EngineSession]]:
    """a: the prompt's 6 blocks on GPU and 4 on CPU; b: 2 blocks on GPU; c: salted 'acme' copy."""
    process, _ = broker
    sessions: dict[str, EngineSession] = {}
    chain = wire_chain(PROMPT, BLOCK)
    salted = wire_chain(PROMPT, BLOCK, cache_salt="acme")
    for engine_id, announce in {
        "a": [("", pb.TIER_GPU, chain), ("", pb.TIER_CPU, chain[:4])],
        "b": [("", pb.TIER_GPU, chain[:2])],
        "c": [("acme", pb.TIER_GPU, salted[:3])],
    }.items():
        session = EngineSession(process.address, builders.engine_info(engine_id, ranks=1))
        await session.start(wait_connected_s=10.0)
        for tenant, tier, hashes in announce:
            session.announce_stored((session.layout_id, tenant), tier, hashes)
        session.flush()
        await session.applied(timeout=10.0)
        sessions[engine_id] = session
    yield sessions
    for session in sessions.values():
        await session.close()


async def test_query_per_tier_and_rank(broker: tuple[BrokerProcess, int], engines: Any) -> None:
    client = IndexerClient(broker[1])
    answer = client.query(token_ids=PROMPT)
    assert answer == {
        "default": {
            "a": {
                "longest_matched": 6 * BLOCK,
                "GPU": 6 * BLOCK,
                "CPU": 4 * BLOCK,
                "DISK": 0,
                "DP": {"0": 192},
            },
            "b": {"longest_matched": 2 * BLOCK, "GPU": 2 * BLOCK, "CPU": 0, "DISK": 0, "DP": {"0": 64}},
        }
    }
    # One instance; a prompt that diverges in block 3 matches 3 blocks on a.
    diverged = PROMPT[: 3 * BLOCK] + [1] * (3 * BLOCK)
    assert client.query(token_ids=diverged, instance_id="a")["default"] == {
        "a": {"longest_matched": 96, "GPU": 96, "CPU": 96, "DISK": 0, "DP": {"0": 96}}
    }
    # cache_salt selects the salted namespace, where only c holds the prefix.
    assert client.query(token_ids=PROMPT, cache_salt="acme")["default"] == {
        "c": {"longest_matched": 96, "GPU": 96, "CPU": 0, "DISK": 0, "DP": {"0": 96}}
    }
    # Another model, another block size: nothing.
    assert client.query(token_ids=PROMPT, model="other") == {"default": {}}
    assert client.query(token_ids=PROMPT, block_size=16) == {"default": {}}


async def test_query_by_hash(broker: tuple[BrokerProcess, int], engines: Any) -> None:
    client = IndexerClient(broker[1])
    chain = wire_chain(PROMPT, BLOCK)
    status, answer = client.call(
        "POST", "/query_by_hash", {"model": "tiny-llama", "block_size": BLOCK, "seq_hashes": chain[:5]}
    )
    assert status == 200
    assert answer["default"]["a"]["longest_matched"] == 5 * BLOCK
    assert answer["default"]["b"]["GPU"] == 2 * BLOCK
    # Early drafts called the list block_hash.
    status, answer = client.call(
        "POST", "/query_by_hash", {"model": "tiny-llama", "block_size": BLOCK, "block_hash": chain[:1]}
    )
    assert status == 200 and set(answer["default"]) == {"a", "b"}


async def test_workers_and_bad_requests(broker: tuple[BrokerProcess, int], engines: Any) -> None:
    client = IndexerClient(broker[1])
    status, workers = client.call("GET", "/workers")
    assert status == 200
    assert {w["instance_id"]: w["source"] for w in workers} == {
        "a": "connector",
        "b": "connector",
        "c": "connector",
    }
    cases = [
        ("POST", "/query", {"token_ids": PROMPT}, 400, "'model' is required"),
        ("POST", "/query", {"model": "tiny-llama", "token_ids": [-1]}, 400, "integers in [0,"),
        ("POST", "/query", {"model": "tiny-llama", "token_ids": "abc"}, 400, "list of integers"),
        ("POST", "/query", {"model": "tiny-llama", "token_ids": [1], "lora_name": "x"}, 400, "LoRA"),
        ("POST", "/query_by_hash", {"model": "tiny-llama", "seq_hashes": [1 << 64]}, 400, "integers"),
        ("GET", "/query", None, 405, "takes POST"),
        ("POST", "/nope", {}, 404, "no such endpoint"),
        ("POST", "/register", {"endpoint": "tcp://127.0.0.1:1"}, 400, "'instance_id' is required"),
        ("POST", "/unregister", {"instance_id": "zz"}, 404, "not a registered"),
    ]
    for method, path, body, code, words in cases:
        status, answer = client.call(method, path, body)
        assert status == code, (path, body, answer)
        assert words in answer["error"]["message"], answer
    status, answer = client.call("POST", "/query", raw=b"{not json")
    assert status == 400 and "not JSON" in answer["error"]["message"]
    # The broker is unharmed: a good query still answers on the same connection.
    assert "a" in client.query(token_ids=PROMPT)["default"]


def _raw(port: int, data: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)  # then the server sees the end of what we send
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_hostile_http_is_refused_and_the_api_keeps_serving(broker: tuple[BrokerProcess, int]) -> None:
    port = broker[1]
    huge_head = b"POST /query HTTP/1.1\r\nX-Pad: " + b"a" * 20_000 + b"\r\n\r\n"
    assert _raw(port, huge_head).startswith(b"HTTP/1.1 413")
    assert _raw(port, b"POST /query HTTP/1.1\r\nContent-Length: lots\r\n\r\n").startswith(b"HTTP/1.1 411")
    too_big = b"POST /query HTTP/1.1\r\nContent-Length: 999999999999\r\n\r\n"
    assert _raw(port, too_big).startswith(b"HTTP/1.1 413")
    assert _raw(port, b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert _raw(port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 200")
    # A client that sends half a body and goes away costs nothing.
    assert _raw(port, b"POST /query HTTP/1.1\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{") == b""
    status, _ = IndexerClient(port).call("POST", "/query", {"model": "m", "token_ids": [1]})
    assert status == 200

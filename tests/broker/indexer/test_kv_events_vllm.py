"""A real vLLM engine WITHOUT our connector, known to the broker from its KV cache events only.

One real broker process (`kvbroker serve --kv-events ... --indexer-http ...`), one
real vLLM engine (CPU build, tiny model) started with `--kv-events-config` and no
kv-transfer-config, and one connector-style engine session in the same layout.
After the vLLM engine serves a prompt, Score ranks it first for that prompt, the
indexer API lists it, Resolve never names it (nobody pulls from it), and when it
dies the broker forgets it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("zmq")

from kvbroker.clients.session import EngineSession
from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import wire_chain
from kvbroker.tools.launch import EngineProcess
from kvbroker.v1 import broker_pb2 as pb
from testkit import builders
from testkit.engines import BLOCK_SIZE, complete, prompt_of
from testkit.ports import free_port
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

# The tiny model's layout as our connector would register it (tools/tiny_model.py: 2 layers, 2 KV heads of 32).
LAYOUT = dict(dtype="float32", num_layers=2, num_kv_heads=2, head_size=32, kv_layout="tiny")


@dataclass
class Stack:
    broker: BrokerProcess
    engine: EngineProcess
    indexer_port: int
    model: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from kvbroker.tools.tiny_model import build_tiny_model

    log_dir = tmp_path_factory.mktemp("kv-events")
    model = build_tiny_model(log_dir / "model")
    events_port, indexer_port = free_port(), free_port()
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
    }
    engine = EngineProcess(
        model,
        name="ev",
        extra_args=["--kv-events-config", json.dumps(events_config)],
        log_path=log_dir / "ev.log",
    )
    layout = "&".join(f"{k}={v}" for k, v in LAYOUT.items())
    spec = f"ev=tcp://127.0.0.1:{events_port}?model={model}&block_size={BLOCK_SIZE}&{layout}&url={engine.url}"
    broker = BrokerProcess(
        log_dir, ["--kv-events", spec, "--indexer-http", f"127.0.0.1:{indexer_port}", "--metrics-port", "0"]
    ).start()
    try:
        engine.start()
        engine.wait_ready(timeout=400, progress=print)
        print(f"kv-events e2e logs in {log_dir}")
        yield Stack(broker, engine, indexer_port, str(model))
    finally:
        engine.stop()
        broker.stop()


def _engines(client: BrokerClient) -> dict[str, pb.EngineInfo]:
    return {e.engine_id: e for e in client.list_engines().engines}


def _query(port: int, body: dict[str, Any]) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/query", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return json.loads(conn.getresponse().read())


def test_scored_from_its_events_never_pulled_from(stack: Stack) -> None:
    served = prompt_of(5 * BLOCK_SIZE + 7, seed=1)  # 5 full blocks
    other = prompt_of(3 * BLOCK_SIZE, seed=2)
    with BrokerClient(stack.broker.address) as client:
        assert wait_for(lambda: "ev" in _engines(client), 30), stack.broker.log_tail()
        info = _engines(client)["ev"]
        assert info.labels["kvbroker.source"] == "kv-events" and info.labels["url"] == stack.engine.url
        # A connector engine in the same layout holds another prompt (and could be pulled from).
        conn_info = builders.engine_info("conn", ranks=1, model=stack.model, **LAYOUT)
        assert builders.engine_info("x", model=stack.model, **LAYOUT).layout == conn_info.layout
        asyncio.run(_with_connector_engine(stack, client, conn_info, served, other, info.layout_id))


async def _with_connector_engine(
    stack: Stack,
    client: BrokerClient,
    conn_info: pb.EngineInfo,
    served: list[int],
    other: list[int],
    layout: str,
) -> None:
    session = EngineSession(stack.broker.address, conn_info)
    await session.start(wait_connected_s=10.0)
    try:
        assert session.layout_id == layout, "the spec's layout fields must give the connector's layout"
        session.announce_stored((layout, ""), pb.TIER_GPU, wire_chain(other, BLOCK_SIZE))
        session.flush()
        await session.applied(timeout=10.0)
        ns = pb.Namespace(layout_id=layout, tenant="")

        def score(prompt: list[int]) -> list[tuple[str, int]]:
            return [(s.engine_id, s.gpu_blocks) for s in client.score(namespace=ns, token_ids=prompt).scores]

        assert all(blocks == 0 for _, blocks in score(served))  # nothing served yet
        await asyncio.to_thread(complete, stack.engine, served, max_tokens=4)
        assert await asyncio.to_thread(wait_for, lambda: score(served)[0] == ("ev", 5), 10), score(served)
        assert score(served)[1] == ("conn", 0)
        assert score(other)[0] == ("conn", 3)  # the connector engine still wins its own prompt
        # Resolve names only engines one may pull from: the connector engine, never the event-fed one.
        for prompt in (served, other):
            holders = [
                m.engine_id
                for m in client.resolve(namespace=ns, block_hashes=wire_chain(prompt, BLOCK_SIZE)).matches
            ]
            assert "ev" not in holders
        assert [
            m.engine_id
            for m in client.resolve(namespace=ns, block_hashes=wire_chain(other, BLOCK_SIZE)).matches
        ] == ["conn"]
        answer = _query(
            stack.indexer_port, {"model": stack.model, "block_size": BLOCK_SIZE, "token_ids": served}
        )
        assert answer["default"]["ev"]["GPU"] == 5 * BLOCK_SIZE
        # The engine dies: the broker forgets it and its blocks at once (the publisher's connection drops).
        stack.engine.kill9()
        assert await asyncio.to_thread(wait_for, lambda: "ev" not in _engines(client), 15)
        assert [s.engine_id for s in client.score(namespace=ns, token_ids=served).scores] == ["conn"]
    finally:
        await session.close()

"""The indexer HTTP API and KV-event feeds keep tenants apart as gRPC does, on a real TLS broker process.

- A tenant literally named ``default`` is a tenant like any other: its
  ``cache_salt`` subdivides it and never names another tenant's index.
- An operator files a KV-event feed only into its own tenant, and cannot
  unregister another tenant's feed; the body docs/indexer.md shows is accepted.
- A feed without a tenant files no salted block into the tenant its salt
  names; a feed of a tenant is that tenant's engine (its Score, its /workers).
"""

from __future__ import annotations

import http.client
import json
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbroker.clients.session import EngineSession
from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import hash_block, none_hash, wire_chain
from kvbroker.v1 import broker_pb2 as pb
from testkit import builders
from testkit.ports import free_port
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for
from tests.broker.security.conftest import Pki, tls_args

zmq = pytest.importorskip("zmq")
from tests.broker.indexer.test_kv_events import Publisher  # noqa: E402  (needs zmq)

pytestmark = pytest.mark.timeout(90)

BLOCK = 32
PROMPT = list(range(1, 3 * BLOCK + 1))
MODEL = "tiny-llama"
MASK64 = (1 << 64) - 1


@pytest.fixture(scope="module")
def broker(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess, int]]:
    port = free_port()
    args = [*tls_args(pki, mutual=True, tokens=True), "--indexer-http", f"127.0.0.1:{port}"]
    with BrokerProcess(tmp_path_factory.mktemp("indexer-tenants"), args) as proc:
        yield proc, port


def call(pki: Pki, port: int, method: str, path: str, body: Any = None, *, token: str) -> tuple[int, Any]:
    context = ssl.create_default_context(cafile=str(pki.ca.cert))
    conn = http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {Path(pki.tokens[token]).read_text().strip()}",
    }
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def register_body(instance: str, endpoint: str, **more: Any) -> dict[str, Any]:
    """The /register body as docs/indexer.md (and the Mooncake RFC) show it."""
    return {
        "type": "vLLM",
        "endpoint": endpoint,
        "replay_endpoint": "",
        "modelname": MODEL,
        "lora_name": "",
        "instance_id": instance,
        "block_size": BLOCK,
        "dp_rank": 0,
        "additionalsalt": "",
        **more,
    }


@pytest.fixture
async def globex_engine(pki: Pki, broker: tuple[BrokerProcess, int]) -> AsyncIterator[None]:
    """globex's engine g1 holds the prompt, salted as its tenant's prompts are."""
    session = EngineSession(
        broker[0].address, builders.engine_info("g1", ranks=1), security=pki.mtls("other_engine")
    )
    await session.start(wait_connected_s=10.0)
    session.announce_stored(
        (session.layout_id, "globex"), pb.TIER_GPU, wire_chain(PROMPT, BLOCK, cache_salt="globex")
    )
    session.flush()
    await session.applied(timeout=10.0)
    yield
    await session.close()


@pytest.mark.usefixtures("globex_engine")
def test_a_tenant_named_default_cannot_read_another_tenant_by_its_salt(
    pki: Pki, broker: tuple[BrokerProcess, int]
) -> None:
    port = broker[1]
    query = {"model": MODEL, "block_size": BLOCK, "token_ids": PROMPT}
    # globex's own router finds g1 (the blocks are there to find).
    status, answer = call(pki, port, "POST", "/query", query, token="other_router")
    assert status == 200 and "g1" in answer["globex"], answer
    # The router of tenant "default" names globex as its salt: its own namespace default/globex.
    status, answer = call(
        pki, port, "POST", "/query", {**query, "cache_salt": "globex"}, token="default_router"
    )
    assert status == 200 and answer == {"default": {}}, answer
    status, answer = call(
        pki,
        port,
        "POST",
        "/query",
        {**query, "tenant_id": "default", "cache_salt": "globex"},
        token="default_router",
    )
    assert status == 200 and answer == {"default": {}}, answer
    status, answer = call(
        pki, port, "POST", "/query", {**query, "tenant_id": "globex"}, token="default_router"
    )
    assert status == 403 and "rule" in answer["error"]["message"]


def test_an_operator_files_feeds_only_into_its_own_tenant(
    pki: Pki, broker: tuple[BrokerProcess, int]
) -> None:
    port = broker[1]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    status, answer = call(
        pki,
        port,
        "POST",
        "/register",
        register_body("acme-into-globex", endpoint, tenant_id="globex"),
        token="operator",
    )
    assert status == 403 and "own tenant" in answer["error"]["message"], answer
    # The documented body is accepted (root may file into any tenant).
    status, answer = call(
        pki,
        port,
        "POST",
        "/register",
        register_body("globex-feed", endpoint, tenant_id="globex"),
        token="root",
    )
    assert status == 200 and answer["instance_id"] == "globex-feed", answer
    # acme's operator cannot stop globex's feed: it is not one of acme's.
    status, answer = call(pki, port, "POST", "/unregister", {"instance_id": "globex-feed"}, token="operator")
    assert status == 404, answer
    status, answer = call(
        pki, port, "POST", "/unregister", {"instance_id": "globex-feed"}, token="other_operator"
    )
    assert status == 200, answer
    # acme's operator files into acme without naming it.
    status, answer = call(
        pki, port, "POST", "/register", register_body("acme-feed", endpoint), token="operator"
    )
    assert status == 200, answer
    status, answer = call(pki, port, "POST", "/unregister", {"instance_id": "acme-feed"}, token="operator")
    assert status == 200, answer


def _vllm_chain(tokens: list[int], salt: str | None = None) -> list[int]:
    """The block hashes vLLM publishes (the last 8 bytes of each digest), `salt` in block 0."""
    parent, out = none_hash(), []
    for i in range(0, len(tokens), BLOCK):
        extra = (("cache_salt", salt),) if salt and i == 0 else None
        parent = hash_block("sha256", parent, tokens[i : i + BLOCK], extra)
        out.append(int.from_bytes(parent, "big") & MASK64)
    return out


def _stored(tokens: list[int], salt: str | None = None) -> dict[str, Any]:
    n = len(tokens) // BLOCK
    return {
        "type": "BlockStored",
        "block_hashes": _vllm_chain(tokens, salt),
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [[salt] if salt and i == 0 else None for i in range(n)],
    }


def _publish_until(publisher: Publisher, events: list[dict[str, Any]], seen: Any) -> None:
    """Publish until `seen()` (a PUB socket drops what it sends before the subscriber joined)."""

    def again() -> bool:
        publisher.send(*events)
        time.sleep(0.05)
        return bool(seen())

    assert wait_for(again, 15)


def test_a_feed_without_a_tenant_files_no_salted_block_into_a_tenant(
    pki: Pki, broker: tuple[BrokerProcess, int]
) -> None:
    port = broker[1]
    events_port = free_port()
    publisher = Publisher(events_port)
    try:
        status, answer = call(
            pki,
            port,
            "POST",
            "/register",
            register_body("free", f"tcp://127.0.0.1:{events_port}"),
            token="root",
        )
        assert status == 200, answer
        plain = [t + 1000 for t in PROMPT]  # an unsalted prompt: proof that the feed's batches arrive
        query = {"model": MODEL, "block_size": BLOCK, "instance_id": "free"}

        def unsalted_seen() -> bool:
            status, answer = call(pki, port, "POST", "/query", {**query, "token_ids": plain}, token="root")
            return status == 200 and answer["default"].get("free", {}).get("GPU") == len(plain)

        # A publisher salts its prompt with acme's name, in the same batch as the proof.
        _publish_until(publisher, [_stored(PROMPT, salt="acme"), _stored(plain)], unsalted_seen)
        status, answer = call(pki, port, "POST", "/query", {**query, "token_ids": PROMPT}, token="router")
        assert status == 200 and answer == {"acme": {}}, answer
    finally:
        call(pki, port, "POST", "/unregister", {"instance_id": "free"}, token="root")
        publisher.close()


def test_a_feed_of_a_tenant_is_that_tenants_engine(pki: Pki, broker: tuple[BrokerProcess, int]) -> None:
    port = broker[1]
    events_port = free_port()
    publisher = Publisher(events_port)
    try:
        body = register_body("acme-events", f"tcp://127.0.0.1:{events_port}", tenant_id="acme")
        status, answer = call(pki, port, "POST", "/register", body, token="operator")
        assert status == 200, answer
        with BrokerClient(broker[0].address, security=pki.mtls("router")) as router:

            def scored() -> bool:
                engines = router.list_engines().engines
                layout = next((e.layout_id for e in engines if e.engine_id == "acme-events"), "")
                if not layout:
                    return False
                ns = pb.Namespace(layout_id=layout, tenant="acme")
                scores = router.score(namespace=ns, block_hashes=wire_chain(PROMPT, BLOCK)).scores
                return any(s.engine_id == "acme-events" and s.gpu_blocks == 3 for s in scores)

            _publish_until(publisher, [_stored(PROMPT)], scored)
        status, workers = call(pki, port, "GET", "/workers", token="router")
        assert status == 200 and "acme-events" in {w["instance_id"] for w in workers}, workers
        status, workers = call(pki, port, "GET", "/workers", token="other_router")
        assert status == 200 and "acme-events" not in {w["instance_id"] for w in workers}, workers
    finally:
        call(pki, port, "POST", "/unregister", {"instance_id": "acme-events"}, token="operator")
        publisher.close()

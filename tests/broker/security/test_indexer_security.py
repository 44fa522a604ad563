"""The KV-indexer HTTP API under the broker's security: HTTPS, identities, roles, tenants.

A real TLS broker process with mutual TLS and tokens serves --indexer-http; an
engine of tenant acme announces a prompt. Callers are plain HTTPS clients.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbroker.clients.session import EngineSession
from kvbroker.common.hashing import wire_chain
from kvbroker.v1 import broker_pb2 as pb
from testkit import builders
from testkit.ports import free_port
from testkit.processes import BrokerProcess
from tests.broker.security.conftest import Pki, tls_args

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(1, 3 * 32 + 1))


@pytest.fixture(scope="module")
def broker(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess, int]]:
    port = free_port()
    args = [*tls_args(pki, mutual=True, tokens=True), "--indexer-http", f"127.0.0.1:{port}"]
    with BrokerProcess(tmp_path_factory.mktemp("indexer-tls"), args) as proc:
        yield proc, port


@pytest.fixture
async def acme_engine(pki: Pki, broker: tuple[BrokerProcess, int]) -> AsyncIterator[None]:
    session = EngineSession(broker[0].address, builders.engine_info("p0", ranks=1), security=pki.mtls("p0"))
    await session.start(wait_connected_s=10.0)
    session.announce_stored(
        (session.layout_id, "acme"), pb.TIER_GPU, wire_chain(PROMPT, 32, cache_salt="acme")
    )
    session.flush()
    await session.applied(timeout=10.0)
    yield
    await session.close()


def call(
    pki: Pki, port: int, path: str, body: Any, *, token: str | None = None, cert: str | None = None
) -> Any:
    context = ssl.create_default_context(cafile=str(pki.ca.cert))
    if cert is not None:
        issued = pki.clients[cert]
        context.load_cert_chain(str(issued.cert), str(issued.key))
    conn = http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {Path(pki.tokens[token]).read_text().strip()}"
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


QUERY = {"model": "tiny-llama", "block_size": 32, "token_ids": PROMPT}


@pytest.mark.usefixtures("acme_engine")
def test_identities_roles_and_tenants(pki: Pki, broker: tuple[BrokerProcess, int]) -> None:
    port = broker[1]
    status, answer = call(pki, port, "/query", QUERY)
    assert status == 401 and "Bearer" in answer["error"]["message"]
    status, answer = call(pki, port, "/query", QUERY, token="wrong_token")
    assert status == 401
    # A router of acme, by token and by certificate: acme's prefix, under acme.
    for creds in ({"token": "router"}, {"cert": "router"}):
        status, answer = call(pki, port, "/query", QUERY, **creds)
        assert status == 200, answer
        assert answer == {
            "acme": {"p0": {"longest_matched": 96, "GPU": 96, "CPU": 0, "DISK": 0, "DP": {"0": 96}}}
        }
    # Another tenant's name is refused; another tenant's router sees nothing of acme.
    status, answer = call(pki, port, "/query", {**QUERY, "tenant_id": "globex"}, token="router")
    assert status == 403 and "is the caller's" in answer["error"]["message"]
    status, answer = call(pki, port, "/query", QUERY, token="other_router")
    assert status == 200 and answer == {"globex": {}}
    # Engines may not query; only operators register publishers.
    status, answer = call(pki, port, "/query", QUERY, token="engine")
    assert status == 403 and "router or operator" in answer["error"]["message"]
    status, answer = call(pki, port, "/register", {"endpoint": "tcp://127.0.0.1:1"}, token="router")
    assert status == 403 and "operator" in answer["error"]["message"]
    status, answer = call(pki, port, "/register", {"endpoint": "tcp://127.0.0.1:1"}, token="operator")
    assert status == 400 and "instance_id" in answer["error"]["message"]
    # An operator of every tenant may name any tenant.
    status, answer = call(pki, port, "/query", {**QUERY, "tenant_id": "acme"}, token="root")
    assert status == 200 and answer["acme"]["p0"]["GPU"] == 96


def test_plaintext_is_not_answered(broker: tuple[BrokerProcess, int]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", broker[1], timeout=5)
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        conn.request("POST", "/query", body=json.dumps(QUERY))
        conn.getresponse().read()

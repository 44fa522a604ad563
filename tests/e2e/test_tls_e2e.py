"""P -> D and the next turn D -> P over mutual TLS: a real broker with --tls-ca, two real vLLM engines whose
adapters take their certificates in kv_connector_extra_config (identities kvbroker://acme/engine/P and
.../D, tenant acme), real NIXL. The answers match a recompute; the leases live in acme's namespace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip("cryptography")

from kvbroker.clients.credentials import ClientSecurity
from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import wire_chain
from kvbroker.tools.launch import EngineProcess
from kvbroker.v1 import broker_pb2 as pb
from testkit.certs import CertificateAuthority
from testkit.engines import (
    BLOCK_SIZE,
    complete,
    handover_blocks,
    output_ids,
    prompt_of,
    read_stats,
    recompute_reference,
    start_engine,
)
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 6


@dataclass
class SecureCluster:
    broker: BrokerProcess
    p: EngineProcess
    d: EngineProcess
    stats: dict[str, Path]
    operator: ClientSecurity

    def stat(self, name: str, key: str) -> int:
        return int(read_stats(self.stats[name]).get(key, 0))


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    from kvbroker.tools.tiny_model import build_tiny_model

    log_dir = tmp_path_factory.mktemp("tls-e2e")
    model = build_tiny_model(log_dir / "model")
    ca = CertificateAuthority.create(log_dir / "pki")
    server = ca.server()
    args = ["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-ca", str(ca.cert)]
    broker = BrokerProcess(log_dir, args).start()
    engines: list[EngineProcess] = []
    try:
        stats = {}
        for name, role, multi_turn in (("P", "prefill", False), ("D", "decode", True)):
            issued = ca.client(name, f"kvbroker://acme/engine/{name}")
            engine, stats[name] = start_engine(
                model,
                log_dir,
                name=name,
                broker_address=broker.address,
                role=role,
                multi_turn=multi_turn,
                tenant="acme",
                tls_ca=str(ca.cert),
                tls_cert=str(issued.cert),
                tls_key=str(issued.key),
            )
            engines.append(engine)
        for engine in engines:
            engine.wait_ready(timeout=400, progress=print)
        op = ca.client("operator", "kvbroker://acme/operator/op")
        operator = ClientSecurity(tls_ca=str(ca.cert), tls_cert=str(op.cert), tls_key=str(op.key))
        with BrokerClient(broker.address, security=operator) as client:
            assert wait_for(
                lambda: (
                    sum(1 for e in client.list_engines().engines if e.ranks and e.ranks[0].agent_name) == 2
                ),
                30,
            ), broker.log_tail()
        yield SecureCluster(broker, engines[0], engines[1], stats, operator)
    finally:
        for engine in engines:
            engine.stop()
        broker.stop()


def test_p_to_d_and_the_next_turn_over_mutual_tls(secure_cluster: SecureCluster) -> None:
    c = secure_cluster
    prompt = prompt_of(150, seed=12)
    reference = recompute_reference(c.d, prompt, MAX_TOKENS)
    pulled_before = c.stat("D", "pulled_blocks")
    first = complete(c.p, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first.get("kv_transfer_params")
    assert params and params["remote_engine_id"] == "P"
    answer = complete(c.d, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    assert output_ids(answer) == reference
    assert c.stat("D", "pulled_blocks") - pulled_before == handover_blocks(len(prompt))

    # The next turn on P: D holds turn 1 (prompt + answer); P pulls the answer's blocks from D.
    turn1 = prompt_of(200, seed=7)
    first = complete(c.p, turn1, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    answer1 = output_ids(
        complete(c.d, turn1, max_tokens=100, kv_transfer_params=first.get("kv_transfer_params"))
    )
    history = turn1 + answer1
    turn2 = history + prompt_of(20, seed=8)
    reference2 = recompute_reference(c.p, turn2, MAX_TOKENS)
    with BrokerClient(c.broker.address, security=c.operator) as client:
        layout = next(e.layout_id for e in client.list_engines().engines if e.engine_id == "D")
        namespace = pb.Namespace(layout_id=layout, tenant="acme/")
        hashes = wire_chain(turn2, BLOCK_SIZE)
        blocks = (len(history) - 1) // BLOCK_SIZE

        def d_named() -> bool:
            matches = client.resolve(namespace=namespace, block_hashes=hashes).matches
            return any(m.engine_id == "D" and m.matched_blocks >= blocks for m in matches)

        assert wait_for(d_named, 10), "the broker never named D for the finished turn"
    time.sleep(0.5)  # P's index mirror hears it a moment later
    pulled_p = c.stat("P", "pulled_blocks")
    assert output_ids(complete(c.p, turn2, max_tokens=MAX_TOKENS)) == reference2
    assert c.stat("P", "pulled_blocks") - pulled_p == blocks - len(turn1) // BLOCK_SIZE

    with BrokerClient(c.broker.address, security=c.operator) as client:
        leases = client.list_leases(include_ended=True).leases
    assert leases and all(lease.namespace.tenant.startswith("acme/") for lease in leases)

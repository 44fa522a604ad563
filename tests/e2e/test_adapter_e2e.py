"""The adapter end to end: one real broker process, three real vLLM engines
(CPU build, tiny random model) with BrokerConnector, real NIXL over UCX.

P prefills, D decodes (multi_turn: it keeps finished conversations for the
next turn), X is a spare reader that the death test kills. Engines start once
for the module; the death tests run last because they kill engines.

Every engine verifies what it pulls (verify_bytes): holders state a digest per
block and layer, readers check it before the release commits, so every pull
below is a verified one, and one test corrupts held bytes on purpose.

Every output is compared token for token with a recompute on one engine: the
same prompt under a fresh cache_salt, a namespace nobody holds, so neither a
local prefix hit nor a pull can supply any of it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvbroker.clients.sync import BrokerClient
from kvbroker.clients.threaded_session import ThreadedEngineSession
from kvbroker.common.hashing import wire_chain
from kvbroker.common.layout import KV_PROTOCOL_VERSION
from kvbroker.tools.launch import EngineProcess
from kvbroker.v1 import broker_pb2 as pb
from testkit.engines import (
    BLOCK_SIZE,
    SESSION_TTL_MS,
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
class Cluster:
    broker: BrokerProcess
    p: EngineProcess
    d: EngineProcess
    x: EngineProcess
    stats: dict[str, Path]
    log_dir: Path

    def stat(self, name: str, key: str) -> int:
        return int(read_stats(self.stats[name]).get(key, 0))

    def skips(self, name: str, reason: str) -> int:
        return int(read_stats(self.stats[name]).get("skips", {}).get(reason, 0))

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from kvbroker.tools.tiny_model import build_tiny_model

    log_dir = tmp_path_factory.mktemp("e2e")
    model = build_tiny_model(log_dir / "model")
    broker = BrokerProcess(log_dir).start()
    engines: list[EngineProcess] = []
    running: Cluster | None = None
    try:
        p, p_stats = start_engine(
            model, log_dir, name="P", broker_address=broker.address, role="prefill", verify_bytes=True
        )
        engines.append(p)
        d, d_stats = start_engine(
            model,
            log_dir,
            name="D",
            broker_address=broker.address,
            role="decode",
            multi_turn=True,
            verify_bytes=True,
        )
        engines.append(d)
        x, x_stats = start_engine(
            model, log_dir, name="X", broker_address=broker.address, role="decode", verify_bytes=True
        )
        engines.append(x)
        for engine in engines:
            engine.wait_ready(timeout=400, progress=print)
        with BrokerClient(broker.address) as client:
            assert wait_for(lambda: len(_ranked_engines(client)) == 3, 20), (
                "engines did not register their ranks"
            )
        print(f"e2e logs in {log_dir}")
        running = Cluster(broker, p, d, x, {"P": p_stats, "D": d_stats, "X": x_stats}, log_dir)
        yield running
    finally:
        for engine in engines:
            engine.stop()
        broker.stop()
        if running is not None:
            running.broker.stop()  # the outage test replaces the broker with a restarted one


def _ranked_engines(client: BrokerClient) -> list[str]:
    return [e.engine_id for e in client.list_engines().engines if e.ranks and e.ranks[0].agent_name]


def _p_to_d(
    cluster: Cluster, prompt: list[int], extra: dict[str, Any] | None = None
) -> tuple[dict[str, Any], Any]:
    params: dict[str, Any] = {"do_remote_decode": True}
    if extra:
        params["kvbroker"] = extra
    first = complete(cluster.p, prompt, max_tokens=1, kv_transfer_params=params)
    return first, first.get("kv_transfer_params")


# --------------------------------------------------------------------------- 1. P -> D


@pytest.mark.parametrize("length", [100, 128, 150, 257])
def test_p_to_d_pulls_the_prompt_and_matches_recompute(cluster: Cluster, length: int) -> None:
    """D reads every block P computed, its partial last block included, and computes only
    the prompt's last token; its output equals a recompute token for token."""
    prompt = prompt_of(length, seed=length)
    reference = recompute_reference(cluster.d, prompt, MAX_TOKENS)
    pulled_before = cluster.stat("D", "pulled_blocks")
    tokens_before = cluster.stat("D", "pulled_tokens")
    failed_before = cluster.stat("D", "pulls_failed")
    returned_before = cluster.stat("P", "holds_returned")

    _, params = _p_to_d(cluster, prompt)
    assert params and params["do_remote_prefill"] is True and params["remote_engine_id"] == "P"
    answer = complete(cluster.d, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)

    assert output_ids(answer) == reference
    assert cluster.stat("D", "pulled_blocks") - pulled_before == handover_blocks(length)
    assert cluster.stat("D", "pulled_tokens") - tokens_before == length - 1
    assert cluster.stat("D", "pulls_failed") == failed_before
    # D's release ended P's hold; P gave the blocks back to vLLM.
    assert wait_for(lambda: cluster.stat("P", "holds_returned") > returned_before, 5)
    with BrokerClient(cluster.broker.address) as client:
        leases = client.list_leases(engine_id="D", include_ended=True).leases
    released = [le for le in leases if le.holder_engine_id == "P" and le.state == pb.LEASE_RELEASED]
    assert released, "the broker recorded no released P->D lease"


def test_a_reader_that_has_the_prompt_declines_the_hold_and_the_holder_frees_at_once(
    cluster: Cluster,
) -> None:
    prompt = prompt_of(150, seed=151)
    complete(cluster.d, prompt, max_tokens=1)  # D computes the prompt itself first
    declined_before = cluster.stat("D", "holds_declined")
    returned_before = cluster.stat("P", "holds_returned")
    pulled_before = cluster.stat("D", "pulled_blocks")

    _, params = _p_to_d(cluster, prompt)
    complete(cluster.d, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    answered = time.monotonic()

    # D's own prefix cache covers what P holds: D reads nothing and tells the broker so.
    assert cluster.stat("D", "pulled_blocks") == pulled_before
    assert cluster.stat("D", "holds_declined") == declined_before + 1
    assert wait_for(lambda: cluster.stat("P", "holds_returned") > returned_before, 1.0, 0.01), (
        "P kept the declined blocks for more than a second"
    )
    print(f"\nP freed the declined hold {time.monotonic() - answered:.3f} s after D answered")
    with BrokerClient(cluster.broker.address) as client:
        leases = client.list_leases(engine_id="P", include_ended=True).leases
    hold_request_id = params["kvbroker"]["hold_request_id"]
    (lease,) = [le for le in leases if le.request_id == hold_request_id]
    assert lease.state == pb.LEASE_REVOKED and lease.cause == pb.REVOKE_DECLINED


def test_held_bytes_corrupted_before_the_read_are_recomputed_counted_and_logged(cluster: Cluster) -> None:
    """Verified bytes: P states its held blocks' digests; the test then flips bytes of one held
    block in P's memory (through /proc/PID/mem, at the address P registered). D reads it, finds
    the mismatch before its release commits, recomputes (its output equals a recompute) and
    counts it; a clean pull before it checks every block it read."""
    from testkit import process_memory

    clean = prompt_of(140, seed=141)
    verified_before = cluster.stat("D", "verify_verified_blocks")
    _, params = _p_to_d(cluster, clean)
    assert output_ids(complete(cluster.d, clean, max_tokens=MAX_TOKENS, kv_transfer_params=params)) == (
        recompute_reference(cluster.d, clean, MAX_TOKENS)
    )
    assert cluster.stat("D", "verify_verified_blocks") - verified_before == handover_blocks(len(clean))

    prompt = prompt_of(150, seed=153)
    reference = recompute_reference(cluster.d, prompt, MAX_TOKENS)
    mismatches_before = cluster.stat("D", "verify_mismatches")
    failed_before = cluster.stat("D", "pulls_failed")
    _, params = _p_to_d(cluster, prompt)
    with BrokerClient(cluster.broker.address) as client:

        def hold() -> list[pb.Lease]:
            leases = client.list_leases(engine_id="P").leases
            return [le for le in leases if le.request_id == params["kvbroker"]["hold_request_id"]]

        assert wait_for(lambda: bool(hold()), 10), "P's hold never reached the broker"
        (lease,) = hold()
        p_info = next(e for e in client.list_engines().engines if e.engine_id == "P")
    (gpu,) = [t for t in p_info.ranks[0].tiers if t.tier == pb.TIER_GPU]
    block_id, block_hash = lease.block_ids[1], lease.block_hashes[1]
    pids = process_memory.descendants(cluster.p.pid or 0)

    def stated() -> int | None:  # the process with P's KV memory, once it stated the block's digest
        return process_memory.stated_block(pids, gpu, block_id, block_hash)

    assert wait_for(lambda: stated() is not None, 10), "P never stated the held block's digest"
    pid = stated()
    assert pid is not None
    region = gpu.regions[0]
    addr = region.base_addr + block_id * region.block_stride + 64
    original = process_memory.read(pid, addr, 16)
    process_memory.write(pid, addr, bytes(b ^ 0x5A for b in original))
    try:
        answer = complete(cluster.d, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    finally:
        process_memory.write(pid, addr, original)  # P's prefix cache keeps this prompt's block
    assert output_ids(answer) == reference
    assert cluster.stat("D", "verify_mismatches") == mismatches_before + 1
    assert cluster.stat("D", "pulls_failed") == failed_before + 1
    assert f"differ from the holder's digests (first: holder block {block_id}, layer 0)" in cluster.log("D")


# --------------------------------------------------------------------------- 2. multi-turn D -> P

# How long a change takes to reach an engine's index mirror after the broker has it:
# about 1 ms (p99) on a quiet host; this covers a loaded 2-core test machine.
MIRROR_SETTLE_S = 0.5


def _wait_until_d_holds(cluster: Cluster, prompt: list[int], blocks: int) -> None:
    """D announces a finished turn a moment after it answered: wait until the broker
    names D for the turn's blocks, then for P's index mirror to have it too. (A turn
    that comes sooner is recomputed: correct, just not pulled.)"""
    with BrokerClient(cluster.broker.address) as client:
        layout = next(e.layout_id for e in client.list_engines().engines if e.engine_id == "D")
        namespace = pb.Namespace(layout_id=layout, tenant="")
        hashes = wire_chain(prompt, BLOCK_SIZE)

        def named() -> bool:
            matches = client.resolve(namespace=namespace, block_hashes=hashes).matches
            return any(m.engine_id == "D" and m.matched_blocks >= blocks for m in matches)

        assert wait_for(named, 10), "the broker never named D for the finished turn"
    time.sleep(MIRROR_SETTLE_S)


def test_multi_turn_turn_two_on_p_pulls_history_from_d(cluster: Cluster) -> None:
    turn1 = prompt_of(200, seed=7)
    _, params = _p_to_d(cluster, turn1)
    answer1 = output_ids(complete(cluster.d, turn1, max_tokens=100, kv_transfer_params=params))
    history = turn1 + answer1  # D computed all but the last answer token
    turn2 = history + prompt_of(20, seed=8)
    # P still has turn 1's prompt in its own prefix cache; it pulls the rest (the answer) from D.
    expected_blocks = (len(history) - 1) // BLOCK_SIZE - len(turn1) // BLOCK_SIZE
    assert (expected_blocks * BLOCK_SIZE) >= 64
    reference = recompute_reference(cluster.p, turn2, MAX_TOKENS)

    pulls_before = cluster.stat("P", "pulled_blocks")
    mirror_before = cluster.stat("P", "mirror_answers")
    assert wait_for(lambda: cluster.stat("D", "held_requests") > 0, 5), "D holds no finished conversation"
    _wait_until_d_holds(cluster, turn2, (len(history) - 1) // BLOCK_SIZE)
    answer2 = complete(cluster.p, turn2, max_tokens=MAX_TOKENS)
    assert output_ids(answer2) == reference
    assert cluster.stat("P", "pulled_blocks") - pulls_before == expected_blocks
    # P found D's blocks on its own index mirror, without asking the broker first.
    assert cluster.stat("P", "mirror_answers") > mirror_before


def test_multi_turn_short_history_is_recomputed(cluster: Cluster) -> None:
    turn1 = prompt_of(40, seed=11)
    answer1 = output_ids(complete(cluster.d, turn1, max_tokens=10))  # 49 computed: one 32-token block
    turn2 = turn1 + answer1 + prompt_of(10, seed=12)
    reference = recompute_reference(cluster.p, turn2, MAX_TOKENS)
    _wait_until_d_holds(cluster, turn2, 1)
    below_before = cluster.skips("P", "below_threshold")
    pulls_before = cluster.stat("P", "pulls")
    assert output_ids(complete(cluster.p, turn2, max_tokens=MAX_TOKENS)) == reference
    assert cluster.skips("P", "below_threshold") == below_before + 1
    assert cluster.stat("P", "pulls") == pulls_before


# --------------------------------------------------------------------------- 5. bad input


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": "yes"},
        {"do_remote_prefill": True, "kvbroker": "not an object"},
        ["not", "a", "dict"],
    ],
    ids=["flag-not-bool", "kvbroker-not-object", "params-not-object"],
)
def test_malformed_transfer_params_recompute(cluster: Cluster, params: Any) -> None:
    prompt = prompt_of(130, seed=len(str(params)))
    reference = recompute_reference(cluster.d, prompt, MAX_TOKENS)
    if not isinstance(params, dict):
        # vLLM's own request validation refuses a non-object with HTTP 400; the engine stays healthy.
        import urllib.error

        with pytest.raises(urllib.error.HTTPError):
            complete(cluster.d, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)  # type: ignore[arg-type]
    else:
        before = cluster.skips("D", "malformed_kv_transfer_params")
        answer = complete(cluster.d, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
        assert output_ids(answer) == reference
        assert cluster.skips("D", "malformed_kv_transfer_params") == before + 1
        assert "malformed_kv_transfer_params" in cluster.log("D")
    assert cluster.d.is_healthy()


def test_unknown_lease_and_holder_recompute(cluster: Cluster) -> None:
    prompt = prompt_of(140, seed=31)
    reference = recompute_reference(cluster.d, prompt, MAX_TOKENS)
    params = {
        "do_remote_prefill": True,
        "kvbroker": {"holder_engine_id": "ghost", "lease_id": "no-such-lease"},
    }
    answer = complete(cluster.d, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    assert output_ids(answer) == reference
    assert "ghost (lease no-such-lease)" in cluster.log("D")
    assert cluster.d.is_healthy()


def test_incompatible_holder_is_not_read(cluster: Cluster) -> None:
    """A holder with the same layout id but another TP size announces and holds
    the prompt's blocks; D must not read them (different head split)."""
    prompt = prompt_of(160, seed=41)
    reference = recompute_reference(cluster.d, prompt, MAX_TOKENS)
    with BrokerClient(cluster.broker.address) as client:
        d_info = next(e for e in client.list_engines().engines if e.engine_id == "D")
    import vllm

    # The engine states its vLLM version and our block format: both are part of its layout id.
    assert d_info.layout.engine_version == f"vllm {vllm.__version__}"
    assert d_info.layout.kv_protocol == KV_PROTOCOL_VERSION
    layout = pb.LayoutFingerprint()
    layout.CopyFrom(d_info.layout)
    layout.tp_size = 2
    rank = pb.RankInfo(
        pp_rank=0,
        tp_rank=0,
        agent_name="fake-tp2-agent",
        agent_metadata=b"not nixl",
        start_layer=0,
        end_layer=layout.num_layers,
        tiers=[pb.TierInfo(tier=pb.TIER_GPU, mem_type="DRAM", num_blocks=64)],
    )
    fake_id = f"fake-tp2-{uuid.uuid4().hex[:6]}"
    fake = ThreadedEngineSession(
        cluster.broker.address,
        pb.EngineInfo(engine_id=fake_id, layout=layout, ranks=[rank]),
        ttl_ms=SESSION_TTL_MS,
    )
    fake.start(wait_connected_s=10)
    try:
        assert fake.layout_id == d_info.layout_id
        namespace = pb.Namespace(layout_id=fake.layout_id, tenant="")
        hashes = wire_chain(prompt, BLOCK_SIZE)
        fake.announce_stored(namespace, pb.TIER_GPU, hashes)
        fake.hold(namespace, pb.TIER_GPU, hashes, list(range(len(hashes))), 30000).result(5)
        fake.applied(timeout=5)  # the broker has applied the announcement
        with BrokerClient(cluster.broker.address) as client:
            # The fake really holds the prompt (an anonymous resolve names it) ...
            assert any(
                m.engine_id == fake_id and m.matched_blocks == len(hashes)
                for m in client.resolve(namespace=namespace, block_hashes=hashes).matches
            )
        failed_before = cluster.stat("D", "pulls_failed")
        no_holder_before = cluster.skips("D", "no_holder")
        pulls_before = cluster.stat("D", "pulls")
        answer = complete(cluster.d, prompt, max_tokens=MAX_TOKENS)
        assert output_ids(answer) == reference
        # ... but D never reads it: the broker does not name an incompatible holder to D
        # (or, if it did, the adapter's own topology check would refuse the lease).
        assert cluster.stat("D", "pulls") == pulls_before, "D read blocks of an incompatible holder"
        refused = (
            cluster.stat("D", "pulls_failed")
            - failed_before
            + cluster.skips("D", "no_holder")
            - no_holder_before
        )
        assert refused == 1
        assert cluster.d.is_healthy()
    finally:
        fake.close()


# --------------------------------------------------------------------------- liveness


def test_broker_outage_recompute_then_rejoin(cluster: Cluster) -> None:
    """Broker down: engines keep serving by recomputing. Broker back (empty, same
    address): engines re-register, re-publish their ranks, and pulls work again."""
    prompt = prompt_of(170, seed=71)
    reference = recompute_reference(cluster.d, prompt, MAX_TOKENS)
    cluster.broker.stop()
    unavailable_before = cluster.skips("D", "broker_unavailable")
    answer = complete(
        cluster.d, prompt, max_tokens=MAX_TOKENS, kv_transfer_params={"do_remote_prefill": True}
    )
    assert output_ids(answer) == reference
    assert cluster.skips("D", "broker_unavailable") == unavailable_before + 1

    started = time.monotonic()
    cluster.broker = BrokerProcess(cluster.log_dir, port=cluster.broker.port).start()
    with BrokerClient(cluster.broker.address) as client:
        assert wait_for(lambda: len(_ranked_engines(client)) == 3, 30, 0.2), "engines did not rejoin"
    print(f"engines rejoined the restarted broker after {time.monotonic() - started:.1f} s")

    prompt2 = prompt_of(160, seed=72)
    reference2 = recompute_reference(cluster.d, prompt2, MAX_TOKENS)
    pulled_before = cluster.stat("D", "pulled_blocks")
    _, params = _p_to_d(cluster, prompt2)
    assert (
        output_ids(complete(cluster.d, prompt2, max_tokens=MAX_TOKENS, kv_transfer_params=params))
        == reference2
    )
    assert cluster.stat("D", "pulled_blocks") - pulled_before == handover_blocks(len(prompt2))


# --------------------------------------------------------------------------- 6. death (kills engines: last)


def test_reader_killed_holder_frees_within_ttl(cluster: Cluster) -> None:
    prompt = prompt_of(190, seed=51)
    returned_before = cluster.stat("P", "holds_returned")
    _, params = _p_to_d(cluster, prompt, extra={"reader_engine_id": "X"})
    assert params
    assert wait_for(lambda: cluster.stat("P", "held_requests") > 0, 5), "P is not holding for X"
    killed = time.monotonic()
    cluster.x.kill9()
    freed = wait_for(
        lambda: cluster.stat("P", "holds_returned") > returned_before, SESSION_TTL_MS / 1000 + 5, 0.02
    )
    elapsed = time.monotonic() - killed
    print(
        f"reader killed -9: holder's blocks back in vLLM's free pool after {elapsed:.3f} s (session TTL {SESSION_TTL_MS} ms)"
    )
    assert freed
    assert elapsed <= SESSION_TTL_MS / 1000 + 1.0
    assert "REVOKE_READER_GONE" in cluster.log("P")


def test_holder_killed_before_pull_reader_recomputes(cluster: Cluster) -> None:
    prompt = prompt_of(220, seed=61)
    reference = recompute_reference(cluster.d, prompt, MAX_TOKENS)
    _, params = _p_to_d(cluster, prompt)
    assert wait_for(lambda: cluster.stat("P", "held_requests") > 0, 5)
    cluster.p.kill9()
    answer = complete(cluster.d, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    assert output_ids(answer) == reference
    assert cluster.d.is_healthy()

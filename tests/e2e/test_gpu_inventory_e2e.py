"""The broker knows what real vLLM engines cache, not only what they hold.

One real broker process and two real vLLM engines (CPU build, tiny model):
D keeps finished conversations (multi_turn) under holds that end after one
second; P has a small KV cache, so vLLM evicts from it. A conversation idle
for longer than its hold is still scored to D and pulled from there (pinned on
demand through D's session); a block vLLM evicts stops being named within a
second; P's own /metrics shows the pull. Unit tests with vLLM's real block
pool: tests/engine_adapter/test_gpu_inventory.py. A retained conversation (Retain) outlives
eviction pressure on P that drops an unretained one; retentions that leave too little memory
for a waiting request are given up, the oldest first (memory_pressure).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvbroker.clients.errors import FailedPrecondition
from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import wire_chain
from kvbroker.tools.launch import EngineProcess
from kvbroker.v1 import broker_pb2 as pb
from testkit.engines import (
    BLOCK_SIZE,
    complete,
    output_ids,
    prompt_of,
    read_stats,
    recompute_reference,
    start_engine,
)
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(600)]

HOLD_TTL_MS = 1000
# The tiny model: 2 layers x 2 KV heads x head size 32 x 32 tokens x K and V x 4 bytes.
BLOCK_BYTES = 2 * 2 * 32 * BLOCK_SIZE * 2 * 4
P_BLOCKS = 40
RETAIN_SHARE = 0.9  # retentions may pin most of P's cache: memory pressure must give them up
MAX_MODEL_LEN = 512


@dataclass
class Pair:
    broker: BrokerProcess
    p: EngineProcess
    d: EngineProcess
    stats: dict[str, Path]

    def stat(self, name: str, key: str) -> int:
        return int(read_stats(self.stats[name]).get(key, 0))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    from kvbroker.tools.tiny_model import build_tiny_model

    log_dir = tmp_path_factory.mktemp("inventory")
    model = build_tiny_model(log_dir / "model")
    broker = BrokerProcess(log_dir).start()
    engines: list[EngineProcess] = []
    try:
        p, p_stats = start_engine(
            model,
            log_dir,
            name="P",
            broker_address=broker.address,
            role="prefill",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=P_BLOCKS * BLOCK_BYTES,
            log_stats=True,
            retain_gpu_fraction=RETAIN_SHARE,
        )
        engines.append(p)
        d, d_stats = start_engine(
            model,
            log_dir,
            name="D",
            broker_address=broker.address,
            role="decode",
            max_model_len=MAX_MODEL_LEN,
            multi_turn=True,
            hold_ttl_ms=HOLD_TTL_MS,
        )
        engines.append(d)
        for engine in engines:
            engine.wait_ready(timeout=400, progress=print)
        with BrokerClient(broker.address) as client:
            assert wait_for(lambda: _ranked(client) == 2, 20), "engines did not register their ranks"
        print(f"inventory e2e logs in {log_dir}")
        yield Pair(broker, p, d, {"P": p_stats, "D": d_stats})
    finally:
        for engine in engines:
            engine.stop()
        broker.stop()


def _ranked(client: BrokerClient) -> int:
    return sum(1 for e in client.list_engines().engines if e.ranks and e.ranks[0].agent_name)


def _named_blocks(client: BrokerClient, engine_id: str, prompt: list[int]) -> int:
    layout = next(e.layout_id for e in client.list_engines().engines if e.engine_id == engine_id)
    namespace = pb.Namespace(layout_id=layout, tenant="")
    matches = client.resolve(namespace=namespace, block_hashes=wire_chain(prompt, BLOCK_SIZE)).matches
    return max((m.matched_blocks for m in matches if m.engine_id == engine_id), default=0)


def test_a_conversation_idle_longer_than_its_hold_is_still_scored_to_d_and_pulled_from_there(
    pair: Pair,
) -> None:
    turn1 = prompt_of(200, seed=31)
    history = turn1 + output_ids(complete(pair.d, turn1, max_tokens=100))
    turn2 = history + prompt_of(20, seed=32)
    d_blocks = (len(history) - 1) // BLOCK_SIZE  # D computed all but the last answer token
    with BrokerClient(pair.broker.address) as client:
        assert wait_for(lambda: _named_blocks(client, "D", turn2) >= d_blocks, 10), "D's turn never named"
        # The hold ends (its TTL), vLLM keeps the blocks cached: the broker keeps naming D.
        assert wait_for(lambda: pair.stat("D", "holds_freed") >= 1 and pair.stat("D", "held_blocks") == 0, 10)
        time.sleep(2 * HOLD_TTL_MS / 1000)
        assert _named_blocks(client, "D", turn2) == d_blocks
        layout = next(e.layout_id for e in client.list_engines().engines if e.engine_id == "D")
        scores = client.score(namespace=pb.Namespace(layout_id=layout), token_ids=turn2).scores
        assert scores[0].engine_id == "D" and scores[0].gpu_blocks == d_blocks
    reference = recompute_reference(pair.p, turn2, 6)
    pulled_before, pins_before = pair.stat("P", "pulled_blocks"), pair.stat("D", "gpu_pins")
    assert output_ids(complete(pair.p, turn2, max_tokens=6)) == reference
    # No hold covered them: D pinned its cached blocks for P's lease on demand (D was idle).
    assert pair.stat("P", "pulled_blocks") - pulled_before == d_blocks
    assert pair.stat("D", "gpu_pins") == pins_before + 1
    # P's pull shows in vLLM's own /metrics, through the connector stats interface.
    metrics = lambda: urllib.request.urlopen(f"{pair.p.url}/metrics", timeout=5).read().decode()  # noqa: E731
    assert wait_for(lambda: "vllm:kvbroker_pulls_total{" in metrics(), 15), "no kvbroker series in /metrics"
    text = metrics()
    pulls = [line for line in text.splitlines() if line.startswith("vllm:kvbroker_pulls_total{")]
    blocks = [line for line in text.splitlines() if line.startswith("vllm:kvbroker_pulled_blocks_total{")]
    assert float(pulls[0].rsplit(" ", 1)[1]) >= 1
    assert float(blocks[0].rsplit(" ", 1)[1]) >= d_blocks
    assert "vllm:kvbroker_pulled_bytes_total{" in text and "vllm:kvbroker_skips_total" in text


def test_a_block_vllm_evicts_stops_being_named_within_a_second(pair: Pair) -> None:
    first = prompt_of(8 * BLOCK_SIZE + 1, seed=41)
    complete(pair.p, first, max_tokens=1)
    with BrokerClient(pair.broker.address) as client:
        assert wait_for(lambda: _named_blocks(client, "P", first) == 8, 10), "P's cached prompt never named"
        evicted_before = pair.stat("P", "gpu_evicted_blocks")
        # Twice P's KV cache of other prompts: vLLM evicts every block of the first one.
        for seed in range(6):
            complete(pair.p, prompt_of(12 * BLOCK_SIZE + 1, seed=50 + seed), max_tokens=1)
        done = time.monotonic()
        assert wait_for(lambda: _named_blocks(client, "P", first) == 0, 1.0), (
            f"still named {time.monotonic() - done:.2f} s after vLLM evicted it"
        )
    assert pair.stat("P", "gpu_evicted_blocks") > evicted_before


def _prefix_hits(engine: EngineProcess) -> float:
    """Tokens vLLM's prefix cache supplied so far (its own /metrics counter)."""
    text = urllib.request.urlopen(f"{engine.url}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total{")
    )


def test_a_retained_prefix_survives_eviction_pressure_that_drops_an_unretained_one(pair: Pair) -> None:
    """Retain (broker/retention.py): the broker pins P's cached blocks of one conversation with no
    reader; filler traffic twice P's KV cache evicts another conversation but not that one, whose
    next turn P serves from its prefix cache; once unretained, the same pressure evicts it too."""
    kept, dropped = prompt_of(6 * BLOCK_SIZE + 1, seed=61), prompt_of(6 * BLOCK_SIZE + 1, seed=62)
    for prompt in (kept, dropped):
        complete(pair.p, prompt, max_tokens=1)
    seeds = iter(range(70, 200))

    def pressure(until: Callable[[], bool]) -> None:
        """Other prompts on P until `until` (at most 4 times P's KV cache of them)."""
        for _ in range(4 * P_BLOCKS // 12):
            complete(pair.p, prompt_of(12 * BLOCK_SIZE + 1, seed=next(seeds)), max_tokens=1)
            if until():
                return

    with BrokerClient(pair.broker.address) as client:
        assert wait_for(lambda: min(_named_blocks(client, "P", p) for p in (kept, dropped)) == 6, 10)
        layout = next(e.layout_id for e in client.list_engines().engines if e.engine_id == "P")
        pins = pair.stat("P", "gpu_pins")
        answer = client.retain(
            namespace=pb.Namespace(layout_id=layout),
            token_ids=kept,
            ttl_ms=300_000,
            engine_id="P",
            key="agent-1",
        )
        lease = answer.lease
        assert (lease.state, lease.tier, len(lease.block_hashes)) == (pb.LEASE_ACTIVE, pb.TIER_GPU, 6)
        assert wait_for(
            lambda: pair.stat("P", "gpu_pins") == pins + 1, 10
        )  # P took a pool reference on its cached blocks
        pressure(lambda: _named_blocks(client, "P", dropped) == 0)
        assert wait_for(lambda: _named_blocks(client, "P", dropped) == 0, 10), "no eviction pressure on P"
        assert _named_blocks(client, "P", kept) == 6, "vLLM evicted a retained block"
        # The conversation comes back: P serves its prefix from its own cache.
        hits = _prefix_hits(pair.p)
        complete(pair.p, kept + prompt_of(20, seed=63), max_tokens=2)
        assert wait_for(lambda: _prefix_hits(pair.p) - hits >= 6 * BLOCK_SIZE, 10)
        hits = _prefix_hits(pair.p)
        complete(pair.p, dropped + prompt_of(20, seed=64), max_tokens=2)  # recomputed: nothing kept it
        assert wait_for(lambda: _named_blocks(client, "P", dropped) > 0, 10)
        assert _prefix_hits(pair.p) - hits < BLOCK_SIZE
        # Unretained, the blocks are vLLM's again: the same pressure evicts them.
        assert client.unretain(lease_id=lease.lease_id).lease.state == pb.LEASE_RELEASED
        pressure(lambda: _named_blocks(client, "P", kept) == 0)
        assert wait_for(lambda: _named_blocks(client, "P", kept) == 0, 10), "the pin outlived its retention"


def test_retentions_that_leave_a_waiting_prompt_too_little_memory_are_given_up_oldest_first(
    pair: Pair,
) -> None:
    """Four retained conversations pin 24 of P's 40 blocks; a 16-block prompt cannot be allocated
    beside them. P gives retentions back (engine_adapter/retention_pressure.py), the oldest
    first, the prompt is answered, and the broker ends each given-up retention as memory_pressure
    (a renewal says so) while the newest stays pinned."""
    convs = [prompt_of(6 * BLOCK_SIZE + 1, seed=90 + n) for n in range(4)]
    for prompt in convs:
        complete(pair.p, prompt, max_tokens=1)
    with BrokerClient(pair.broker.address) as client:
        assert wait_for(lambda: min(_named_blocks(client, "P", c) for c in convs) == 6, 10)
        ns = pb.Namespace(
            layout_id=next(e.layout_id for e in client.list_engines().engines if e.engine_id == "P")
        )
        leases = [
            client.retain(namespace=ns, token_ids=c, ttl_ms=300_000, engine_id="P", key=f"agent-{n}").lease
            for n, c in enumerate(convs)
        ]
        assert all(lease.state == pb.LEASE_ACTIVE for lease in leases)
        given_before = pair.stat("P", "gpu_retentions_given_up")
        big = prompt_of(15 * BLOCK_SIZE + 1, seed=99)
        reference = recompute_reference(pair.d, big, 2)
        assert output_ids(complete(pair.p, big, max_tokens=2)) == reference

        def ended(lease: pb.Lease) -> str:
            try:
                client.retain(lease_id=lease.lease_id, ttl_ms=300_000)
            except FailedPrecondition as err:  # the renewal's answer names the cause
                return err.cause
            return ""

        causes = [ended(lease) for lease in leases]
        given = causes.index("") if "" in causes else len(causes)
        assert given >= 1 and causes[:given] == ["memory_pressure"] * given, causes
        assert causes[3] == "" and set(causes[given:]) == {""}, f"not the oldest first: {causes}"
        assert pair.stat("P", "gpu_retentions_given_up") - given_before == given
        for lease in leases[given:]:
            client.unretain(lease_id=lease.lease_id)

"""Eviction recovery from a CPU tier, end to end (DESIGN flow 3): one real broker
process, two real vLLM engines (CPU build, tiny random model), real NIXL.

A has a CPU offload tier (`cpu_tier_blocks`) and holds nothing on its GPU tier
for readers (no multi_turn, no remote decode), so once A has served a prompt
the broker knows the prompt's blocks only on A's CPU tier. B then gets the
same prompt: it resolves, the broker names A on tier CPU, B's lease makes A
pin the CPU-tier slots (PinCommand -> PinResult with slot ids), B NIXL-READs
A's CPU tier into its own KV cache, releases, and its greedy output must equal
a recompute token for token. Both run with verify_bytes: B's pull from A's CPU
tier is checked against the digests A states when it pins the slots, sampled
(B's verify_sample 0.5: one layer of each block, drawn per pull; test_adapter_e2e
checks every byte).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import wire_chain
from kvbroker.tools.launch import EngineProcess, engine_environment
from kvbroker.v1 import broker_pb2 as pb
from testkit.engines import (
    BLOCK_SIZE,
    complete,
    output_ids,
    prompt_of,
    read_stats,
    recompute_reference,
    reset_prefix_cache,
    start_engine,
)
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 6
CPU_TIER_BLOCKS = 64


@dataclass
class Pair:
    broker: BrokerProcess
    a: EngineProcess
    b: EngineProcess
    stats: dict[str, Path]

    def stat(self, name: str, key: str) -> int:
        return int(read_stats(self.stats[name]).get(key, 0))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    from kvbroker.tools.tiny_model import build_tiny_model

    log_dir = tmp_path_factory.mktemp("e2e-cpu-tier")
    model = build_tiny_model(log_dir / "model")
    broker = BrokerProcess(log_dir).start()
    engines: list[EngineProcess] = []
    # Both can empty their prefix cache (vLLM's dev endpoint) to serve a prompt they
    # have seen again from somewhere else: a peer, or their own CPU tier.
    dev_env = {**engine_environment(), "VLLM_SERVER_DEV_MODE": "1"}
    try:
        a, a_stats = start_engine(
            model,
            log_dir,
            name="A",
            broker_address=broker.address,
            role="both",
            cpu_tier_blocks=CPU_TIER_BLOCKS,
            env=dev_env,
            verify_bytes=True,
        )
        engines.append(a)
        b, b_stats = start_engine(
            model,
            log_dir,
            name="B",
            broker_address=broker.address,
            role="both",
            env=dev_env,
            verify_bytes=True,
            verify_sample=0.5,  # a sampled check: one of the tiny model's two layers per block
        )
        engines.append(b)
        for engine in engines:
            engine.wait_ready(timeout=400, progress=print)
        with BrokerClient(broker.address) as client:
            assert wait_for(lambda: len(client.list_engines().engines) == 2, 30)
            engines_pb = {e.engine_id: e for e in client.list_engines().engines}
        tiers = {t.tier for r in engines_pb["A"].ranks for t in r.tiers}
        assert pb.TIER_CPU in tiers, "A publishes its CPU tier's regions in RegisterRank"
        yield Pair(broker, a, b, {"A": a_stats, "B": b_stats})
    finally:
        for engine in engines:
            engine.stop()
        broker.stop()
        print("e2e logs in", log_dir)


def broker_matches(pair: Pair, prompt: list[int]) -> list[tuple[str, int, int]]:
    """(engine, tier, matched blocks) the broker names for `prompt` (tenant "")."""
    with BrokerClient(pair.broker.address) as client:
        layout = next(e.layout_id for e in client.list_engines().engines if e.engine_id == "A")
        namespace = pb.Namespace(layout_id=layout, tenant="")
        matches = client.resolve(namespace=namespace, block_hashes=wire_chain(prompt, BLOCK_SIZE)).matches
    return [(m.engine_id, int(m.tier), m.matched_blocks) for m in matches]


def test_reader_pulls_a_prefix_held_only_on_the_holders_cpu_tier(pair: Pair) -> None:
    prompt = prompt_of(200, seed=31)
    full_blocks = len(prompt) // BLOCK_SIZE  # 6 full blocks; the 8-token tail is computed
    reference = recompute_reference(pair.b, prompt, MAX_TOKENS)

    first = complete(pair.a, prompt, max_tokens=MAX_TOKENS)
    assert output_ids(first) == reference
    # The finished request's full blocks reach A's CPU tier, then the broker.
    assert wait_for(lambda: pair.stat("A", "cpu_stored_blocks") >= full_blocks, 30), read_stats(
        pair.stats["A"]
    )
    assert wait_for(lambda: any(m[:2] == ("A", pb.TIER_CPU) for m in broker_matches(pair, prompt)), 30), (
        "the broker names A's CPU tier"
    )
    # A's prefix cache has it too (and the broker names that first); A forgets it, and
    # vLLM's eviction events take the GPU copy out of the index at once (A is idle).
    reset_prefix_cache(pair.a)
    assert wait_for(lambda: [m[:2] for m in broker_matches(pair, prompt)] == [("A", pb.TIER_CPU)], 5), (
        broker_matches(pair, prompt)
    )

    second = complete(pair.b, prompt, max_tokens=MAX_TOKENS)
    assert output_ids(second) == reference, "B's output from A's CPU tier equals a recompute"
    assert wait_for(lambda: pair.stat("B", "pulled_blocks_tier_cpu") == full_blocks, 15), read_stats(
        pair.stats["B"]
    )
    assert pair.stat("B", "pulls_failed") == 0
    # verify_bytes: A stated its CPU-tier slots' digests when it pinned them; B checked every block.
    assert pair.stat("B", "verify_verified_blocks") == full_blocks

    with BrokerClient(pair.broker.address) as client:
        leases = client.list_leases(engine_id="B", include_ended=True).leases
    pulled = [lease for lease in leases if lease.holder_engine_id == "A" and lease.reader_engine_id == "B"]
    assert pulled, "the broker shows B's lease on A"
    assert all(lease.tier == pb.TIER_CPU for lease in pulled)
    assert any(lease.state == pb.LEASE_RELEASED for lease in pulled), "release committed the read"
    released = [lease for lease in pulled if lease.state == pb.LEASE_RELEASED]
    assert len(released[-1].block_ids) == full_blocks, "A answered the pin with one slot id per block"

    # A answered the PinCommand and unpinned when the lease ended; its stats file is
    # rewritten on its next step, so give it one.
    complete(pair.a, prompt_of(40, seed=32), max_tokens=1)
    assert wait_for(lambda: pair.stat("A", "cpu_pins") >= 1, 15), read_stats(pair.stats["A"])
    assert wait_for(lambda: int(read_stats(pair.stats["A"]).get("cpu_tier_pinned_slots", -1)) == 0, 15)


def test_a_reader_takes_a_busy_holders_cpu_copy_instead_of_waiting_for_its_step(pair: Pair) -> None:
    """A holds a prompt on both tiers. Idle, the broker names its GPU copy first; busy (a long
    generation running), its CPU copy, which A pins on its session thread at once where a GPU pin
    waits for A's scheduler step; B reads that copy and its output equals a recompute."""
    prompt = prompt_of(200, seed=81)
    full_blocks = len(prompt) // BLOCK_SIZE
    reference = recompute_reference(pair.b, prompt, MAX_TOKENS)
    assert output_ids(complete(pair.a, prompt, max_tokens=MAX_TOKENS)) == reference
    both = [("A", pb.TIER_GPU, full_blocks), ("A", pb.TIER_CPU, full_blocks)]
    assert wait_for(lambda: broker_matches(pair, prompt)[:2] == both, 30), broker_matches(pair, prompt)

    def a_load() -> float:
        with BrokerClient(pair.broker.address) as client:
            return next(e.load for e in client.list_engines().engines if e.engine_id == "A")

    long_run = threading.Thread(
        target=complete, args=(pair.a, prompt_of(40, seed=82)), kwargs={"max_tokens": 1900}, daemon=True
    )
    long_run.start()
    try:
        assert wait_for(lambda: a_load() >= 1, 30), "A never reported the long generation as load"
        assert broker_matches(pair, prompt)[:2] == both[::-1], "a busy holder: its CPU copy first"
        cpu_before = pair.stat("B", "pulled_blocks_tier_cpu")
        assert output_ids(complete(pair.b, prompt, max_tokens=MAX_TOKENS)) == reference
        assert long_run.is_alive(), "the long generation ended before B's pull: A was not busy"
        assert wait_for(lambda: pair.stat("B", "pulled_blocks_tier_cpu") == cpu_before + full_blocks, 15), (
            read_stats(pair.stats["B"])
        )
    finally:
        long_run.join(timeout=120)
    # A idle again for the next test (the long answer's blocks then fill most of A's CPU tier).
    assert wait_for(lambda: a_load() < 1, 30)


def test_remote_decode_request_is_offloaded_whole_and_stays_after_the_gpu_hold_ends(pair: Pair) -> None:
    """vLLM PR 40346 / DESIGN flow 4: a do_remote_decode request's blocks all go to the
    CPU tier, so once the reader has taken the GPU copy and A's prefix cache lost it,
    the broker still names A, on tier CPU, for the whole prompt."""
    prompt = prompt_of(160, seed=41)
    full_blocks = len(prompt) // BLOCK_SIZE
    reference = recompute_reference(pair.b, prompt, MAX_TOKENS)
    pulls_before = pair.stat("B", "pulled_blocks_tier_gpu")
    first = complete(pair.a, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill") is True
    second = complete(pair.b, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    assert output_ids(second) == reference
    assert wait_for(lambda: pair.stat("B", "pulled_blocks_tier_gpu") == pulls_before + full_blocks, 15), (
        "B took the GPU hold first (the broker ranks GPU before CPU)"
    )

    def only_cpu_left() -> bool:
        return [m for m in broker_matches(pair, prompt) if m[0] == "A"] == [("A", pb.TIER_CPU, full_blocks)]

    # The hold ended with B's read, but A's prefix cache still has the prompt (named on
    # tier GPU) until A forgets it; then only the CPU copy is left.
    reset_prefix_cache(pair.a)
    assert wait_for(only_cpu_left, 30), broker_matches(pair, prompt)

    # ... and a reader takes it from there: B forgets the prompt and reads it again,
    # this time from A's CPU copy.
    reset_prefix_cache(pair.b)
    cpu_before = pair.stat("B", "pulled_blocks_tier_cpu")
    third = complete(pair.b, prompt, max_tokens=MAX_TOKENS)
    assert output_ids(third) == reference, "B's output from A's CPU copy equals a recompute"
    assert wait_for(lambda: pair.stat("B", "pulled_blocks_tier_cpu") == cpu_before + full_blocks, 15), (
        read_stats(pair.stats["B"])
    )


def test_engine_restores_a_prefix_from_its_own_cpu_tier(pair: Pair) -> None:
    """A's GPU copy is gone (prefix cache emptied); its own CPU tier still has the
    prompt, so A copies it back instead of recomputing: no broker lease, no NIXL."""
    prompt = prompt_of(200, seed=51)
    full_blocks = len(prompt) // BLOCK_SIZE
    reference = recompute_reference(pair.a, prompt, MAX_TOKENS)
    assert output_ids(complete(pair.a, prompt, max_tokens=MAX_TOKENS)) == reference
    assert wait_for(lambda: ("A", pb.TIER_CPU, full_blocks) in broker_matches(pair, prompt), 30), (
        "A's copy reached its CPU tier"
    )
    reset_prefix_cache(pair.a)
    restored = pair.stat("A", "cpu_restored_blocks")
    pulled = pair.stat("A", "pulled_blocks")
    again = complete(pair.a, prompt, max_tokens=MAX_TOKENS)
    assert output_ids(again) == reference, "A's output from its own CPU tier equals a recompute"
    assert wait_for(lambda: pair.stat("A", "cpu_restored_blocks") == restored + full_blocks, 15), read_stats(
        pair.stats["A"]
    )
    assert pair.stat("A", "pulled_blocks") == pulled, "nothing was read from another engine"


def test_a_retention_pins_the_cpu_tier_copy_through_pressure_that_evicts_an_unretained_one(
    pair: Pair,
) -> None:
    """Retain on an engine with a CPU tier pins its CPU copy (GPU memory stays vLLM's to evict): the
    conversation survives traffic that overflows A's CPU tier and evicts another one from it, and
    after its GPU copy is gone A restores it from the pinned copy instead of recomputing."""
    kept, dropped = prompt_of(200, seed=61), prompt_of(200, seed=62)
    full_blocks = len(kept) // BLOCK_SIZE
    reference = recompute_reference(pair.b, kept + prompt_of(20, seed=63), MAX_TOKENS)
    for prompt in (kept, dropped):
        complete(pair.a, prompt, max_tokens=1)
    on_cpu = lambda p: max((m[2] for m in broker_matches(pair, p) if m[:2] == ("A", pb.TIER_CPU)), default=0)  # noqa: E731
    assert wait_for(lambda: on_cpu(kept) == on_cpu(dropped) == full_blocks, 30), "A's CPU tier never had them"
    with BrokerClient(pair.broker.address) as client:
        layout = next(e.layout_id for e in client.list_engines().engines if e.engine_id == "A")
        pins = pair.stat("A", "cpu_pins")
        lease = client.retain(
            namespace=pb.Namespace(layout_id=layout), token_ids=kept, ttl_ms=300_000, key="agent-cpu"
        ).lease
        assert (lease.holder_engine_id, lease.tier, len(lease.block_hashes)) == (
            "A",
            pb.TIER_CPU,
            full_blocks,
        )
        # Other prompts, more than A's CPU tier holds: its least recently used slots go, the pinned ones stay.
        for seed in range(70, 70 + 2 * CPU_TIER_BLOCKS // 12):
            complete(pair.a, prompt_of(12 * BLOCK_SIZE + 1, seed=seed), max_tokens=1)
        assert wait_for(lambda: on_cpu(dropped) == 0, 30), "no pressure on A's CPU tier"
        assert on_cpu(kept) == full_blocks, "a retained CPU-tier block was evicted"
        # A pinned the slots on its session thread; its counters went out with its next step.
        assert (
            pair.stat("A", "cpu_pins") == pins + 1 and pair.stat("A", "cpu_tier_pinned_slots") == full_blocks
        )
        # The GPU copy goes too; the conversation comes back from the pinned CPU copy.
        reset_prefix_cache(pair.a)
        restored = pair.stat("A", "cpu_restored_blocks")
        assert output_ids(complete(pair.a, kept + prompt_of(20, seed=63), max_tokens=MAX_TOKENS)) == reference
        assert wait_for(lambda: pair.stat("A", "cpu_restored_blocks") == restored + full_blocks, 15)
        client.unretain(lease_id=lease.lease_id)

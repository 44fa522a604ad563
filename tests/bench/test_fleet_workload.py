"""The fleet benchmark's workload (bench/fleet/workload.py): seeded, skewed, bursty; the ideal reuse."""

from __future__ import annotations

from bench.fleet.workload import IdealCache, WorkloadSpec, build


def test_the_same_seed_gives_the_same_sessions_and_shared_system_prompts() -> None:
    spec = WorkloadSpec(sessions=40, classes=4, rate=2.0, burst=4)
    a, b = build(spec), build(spec)
    assert a == b
    assert len(a.system_prompts) == 4 and all(len(p) == spec.system_tokens for p in a.system_prompts)
    # Bursts of 4 sessions, 2 per second on average: a burst every 2 s.
    assert [s.arrival_s for s in a.sessions[:9]] == [0.0] * 4 + [2.0] * 4 + [4.0]
    counts = [sum(1 for s in a.sessions if s.agent_class == k) for k in range(4)]
    assert counts[0] == max(counts)  # the hot class (Zipf-like skew)
    assert all(len(s.user_turns) == spec.turns and len(s.think_s) == spec.turns - 1 for s in a.sessions)


def test_the_ideal_reuse_counts_full_blocks_a_finished_request_computed() -> None:
    cache = IdealCache(32)
    system = list(range(100, 200))  # 100 tokens: 3 full blocks
    assert cache.reused([*system, 1, 2]) == 0
    cache.add(system + [7] * 28)  # prompt and answer: 128 tokens, 4 full blocks
    assert cache.reused(system + [1] * 40) == 96  # the next session of the class shares 3 blocks
    assert cache.reused(system + [7] * 28 + [5] * 10) == 128  # the next turn shares all 4
    assert cache.reused([9, *system]) == 0  # a prefix, not any block

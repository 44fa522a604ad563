"""Local on D or P then pull: the proxy weighs P's queue (p_queue.py)."""

from __future__ import annotations

import pytest

from kvbroker.clients.proxy.p_queue import (
    LOCAL_FEW_TOKENS,
    LOCAL_P_BUSY,
    PD_D_HOLDS_NOTHING,
    PD_P_IDLE,
    PD_P_QUICKER,
    PrefillQueues,
)

# SmolLM2-like figures on the CPU build: 30 ms a step, 1.1 s per 1k tokens.
P_PARAMS = {
    "kvbroker": {"prefill_model": {"step_ms": 30.0, "ms_per_1k_tokens": 1100.0, "ms_per_1m_pairs": 50.0}}
}


def choose(q: PrefillQueues, **kw: object):  # type: ignore[no-untyped-def]
    args = {"p_engine_id": "P", "p_load": 0.0, "num_tokens": 2000, "held_on_d": 1900, "held_on_p": 0}
    args.update(kw)
    return q.choose(local_limit=int(args.pop("local_limit", 0)), **args)  # type: ignore[arg-type]


def test_an_idle_p_prefills_a_busy_one_is_skipped_when_d_holds_the_history() -> None:
    q = PrefillQueues()
    q.learn("P", P_PARAMS)
    assert choose(q).reason == PD_P_IDLE
    q.started("P", "other-chat", 2000, 0)  # another conversation's 2k-token prefill
    busy = choose(q)
    assert busy.local and busy.reason == LOCAL_P_BUSY and busy.p_wait_ms == pytest.approx(2335, rel=0.05)
    assert "P's queue (1)" in busy.detail
    q.finished("P", "other-chat")
    assert choose(q).reason == PD_P_IDLE


def test_the_broker_reported_load_counts_other_proxies_prefills() -> None:
    q = PrefillQueues()
    assert choose(q, p_load=1.0).reason == LOCAL_P_BUSY  # no timing yet: D holds most of the prompt
    assert choose(q, p_load=1.0, held_on_d=500).reason == PD_P_QUICKER  # under half: P


def test_a_long_new_part_still_goes_to_p_when_its_queue_is_short() -> None:
    q = PrefillQueues()
    q.learn("P", P_PARAMS)
    q.started("P", "short", 20, 0)  # a 20-token prefill: P is almost free
    # D decodes another chat: computing 2,800 tokens there would stall it; P is quicker.
    choice = choose(q, num_tokens=3000, held_on_d=200, held_on_p=200, d_load=1.0)
    assert not choice.local and choice.reason == PD_P_QUICKER
    assert choose(q, num_tokens=3000, held_on_d=2900, held_on_p=200, d_load=1.0).local


def test_few_tokens_left_and_nothing_held() -> None:
    q = PrefillQueues()
    assert choose(q, held_on_d=1990, local_limit=16).reason == LOCAL_FEW_TOKENS
    assert choose(q, held_on_d=0, p_load=5.0).reason == PD_D_HOLDS_NOTHING


def test_malformed_prefill_models_are_ignored() -> None:
    q = PrefillQueues()
    for bad in (None, {}, {"kvbroker": "x"}, {"kvbroker": {"prefill_model": {"step_ms": -1}}}):
        q.learn("P", bad)  # type: ignore[arg-type]
    assert q.coefficients("P") is None

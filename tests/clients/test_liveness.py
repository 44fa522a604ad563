"""clients/liveness.py: when a session gives its broker up (times on the session's clock)."""

from __future__ import annotations

import asyncio

import pytest

from kvbroker.clients.liveness import SILENCE_TTLS, GaveUp, Liveness, Silent, register_timeout_s

TTL_S = 2.0


def test_several_replicas_move_on_a_heartbeat_unanswered_for_a_quarter_ttl() -> None:
    live = Liveness()
    live.connected(0.0)
    live.asked(1.0)
    live.asked(1.2)  # the oldest unanswered message counts
    live.check(1.5, TTL_S, several=True)
    with pytest.raises(Silent):
        live.check(1.51, TTL_S, several=True)


def test_any_message_heard_answers_what_waits() -> None:
    live = Liveness()
    live.connected(0.0)
    live.asked(1.0)
    live.heard(1.4)
    live.check(3.0, TTL_S, several=True)
    live.asked(3.0)
    with pytest.raises(Silent):
        live.check(3.6, TTL_S, several=True)


def test_one_address_waits_silence_ttls_whatever_is_unanswered() -> None:
    live = Liveness()
    live.connected(0.0)
    live.asked(0.1)
    live.check(SILENCE_TTLS * TTL_S, TTL_S, several=False)
    with pytest.raises(GaveUp) as raised:
        live.check(SILENCE_TTLS * TTL_S + 0.01, TTL_S, several=False)
    assert not isinstance(raised.value, Silent)


def test_a_stall_of_this_process_is_not_the_brokers_silence() -> None:
    live = Liveness()
    live.connected(0.0)
    live.asked(1.0)
    live.stalled(3.0, 2.0)  # we did not run from 1.0 to 3.0
    live.check(3.4, TTL_S, several=True)
    assert live.last_heard == 2.0


def test_registration_waits_at_most_half_the_ttl_with_several_replicas() -> None:
    assert register_timeout_s(5.0, 2.0, several=True) == 1.0
    assert register_timeout_s(5.0, 30.0, several=True) == 5.0
    assert register_timeout_s(5.0, 0.5, several=True) == 1.0  # a floor, for a busy replica
    assert register_timeout_s(5.0, 2.0, several=False) == 5.0


async def test_an_answer_read_in_the_passes_before_the_verdict_keeps_the_replica() -> None:
    """The heartbeat loop's verdict: an answer the read loop takes from the socket within
    READ_PASSES passes of the event loop counts; without one the replica is given up."""
    live = Liveness()
    live.connected(0.0)
    live.asked(1.0)

    async def read_loop() -> None:  # the answer was in the socket; its read runs next pass
        await asyncio.sleep(0)
        live.heard(1.6)

    reader = asyncio.ensure_future(read_loop())
    await live.check_after_reads(1.6, lambda: 1.6, TTL_S, several=True)  # no Silent
    await reader
    live.asked(2.0)
    with pytest.raises(Silent):
        await live.check_after_reads(2.6, lambda: 2.6, TTL_S, several=True)

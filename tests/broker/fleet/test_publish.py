"""PUBLISH without waiting for its answer (`RedisState.publish`): the notice arrives, and the
answers the replica does wait for are never mixed up with the ones it did not read yet."""

from __future__ import annotations

import secrets

import redis

from kvbroker.broker.fleet import wire
from kvbroker.broker.fleet.conn import _MOST_UNREAD
from testkit.redis_server import RedisServer
from tests.broker.helpers import redis_state


def test_published_notices_arrive_and_later_answers_stay_in_order(redis_server: RedisServer) -> None:
    state = redis_state(redis_server)
    listener = redis.Redis.from_url(redis_server.url).pubsub(ignore_subscribe_messages=True)
    channel = f"ch-{secrets.token_hex(3)}"
    key = f"k-{secrets.token_hex(3)}"
    try:
        listener.subscribe(channel)
        listener.get_message(timeout=1.0)  # the subscription confirmed
        for i in range(3):
            state.publish(channel, f"notice {i}")
        # Three answers (the listener counts, 1 each) are still unread: this one is SET's.
        assert state.command("SET", key, "v") == b"OK"
        assert state.command("GET", key) == b"v"
        got = []
        while len(got) < 3:
            message = listener.get_message(timeout=2.0)
            assert message is not None, got
            got.append(message["data"])
        assert got == [b"notice 0", b"notice 1", b"notice 2"]
        script = state.script("return redis.call('GET', KEYS[1])")
        state.publish(channel, "one more")
        assert state.run(script, [key], []) == b"v"
    finally:
        listener.close()
        state.close()


def test_a_burst_of_notices_leaves_at_most_the_bound_of_answers_unread(redis_server: RedisServer) -> None:
    state = redis_state(redis_server)
    key = f"k-{secrets.token_hex(3)}"
    try:
        state.command("SET", key, "v")
        for i in range(3 * _MOST_UNREAD + 1):
            state.publish("ch", f"notice {i}")
            assert state._unread <= _MOST_UNREAD
        assert state._unread > 0  # read with the next command's answer, not one by one
        assert state.command("GET", key) == b"v"
        assert state._unread == 0
    finally:
        state.close()


def test_a_publish_whose_connection_broke_is_unavailable_then_the_next_call_reconnects(
    redis_server: RedisServer,
) -> None:
    state = redis_state(redis_server)
    try:
        state.publish("ch", "first")  # opens the replica's own connection
        assert state.command("PING") in (b"PONG", True)
        admin = redis.Redis.from_url(redis_server.url)
        mine = [c["id"] for c in admin.client_list() if c.get("cmd") in ("ping", "publish")]
        assert mine
        state.publish("ch", "second")  # its answer unread when the connection is cut
        for client_id in mine:
            admin.client_kill_filter(_id=client_id)
        admin.close()
        # The unread answer is gone with the connection: the call reconnects once and answers.
        assert state.command("PING") in (b"PONG", True)
        state.publish("ch", "third")
        assert state.command("PING") in (b"PONG", True)
    finally:
        state.close()


def test_several_unwaited_commands_go_in_one_write_and_their_answers_are_skipped(
    redis_server: RedisServer,
) -> None:
    state = redis_state(redis_server)
    key = f"k-{secrets.token_hex(3)}"
    try:
        state.command("PING")  # connected: the next sends take the one-write path (fleet/wire.py)
        writes = []
        real = wire._write
        wire._write = lambda fd, data: writes.append(data) or real(fd, data)  # type: ignore[assignment]
        try:
            state.send_unwaited(("RPUSH", key, b"a\x00b"), ("PEXPIRE", key, 60_000))
        finally:
            wire._write = real
        assert len(writes) == 1 and writes[0].count(b"*") == 2  # both commands, one write
        assert state._unread == 2
        assert state.command("LRANGE", key, 0, -1) == [b"a\x00b"]  # the two answers were skipped
        assert 0 < state.command("PTTL", key) <= 60_000
        assert state._unread == 0
    finally:
        state.close()

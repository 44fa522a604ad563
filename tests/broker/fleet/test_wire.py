"""broker/fleet/wire.py on a real redis-server: a round trip straight on the socket answers as
redis-py would (values, error answers as their exceptions, a timeout, a closed connection), leaves
the connection usable, and the pub/sub read hands over each message."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest
import redis
import redis.asyncio
from redis.exceptions import NoScriptError

from kvbroker.broker.fleet import wire
from kvbroker.broker.fleet.conn import RedisState
from testkit.redis_server import RedisServer
from tests.broker.helpers import redis_state


def _connected(state: RedisState) -> object:
    state.command("PING")  # makes the replica's own connection (redis-py's way, the first time)
    return state._conn


def test_a_round_trip_answers_values_and_errors_as_redis_py_does(redis_server: RedisServer) -> None:
    state = redis_state(redis_server)
    conn = _connected(state)
    key = f"{state.prefix}:h"
    assert wire.round_trip(conn, ("HSET", key, "a", 1)) == 1
    assert wire.round_trip(conn, ("HGET", key, "a")) == b"1"
    with pytest.raises(NoScriptError):
        wire.round_trip(conn, ("EVALSHA", "0" * 40, 0))
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        wire.round_trip(conn, ("GET", key))
    assert wire.round_trip(conn, ("PING",)) == b"PONG"  # error answers are read whole
    assert state.command("HGET", key, "a") == b"1"  # and redis-py's way still works on it


def test_a_round_trip_drops_the_answers_it_was_told_to_skip_error_answers_too(
    redis_server: RedisServer,
) -> None:
    state = redis_state(redis_server)
    conn = _connected(state)
    key = f"{state.prefix}:h"
    wire.round_trip(conn, ("HSET", key, "a", 1))
    conn.send_command("GET", key)  # type: ignore[attr-defined]  # WRONGTYPE, not waited for
    conn.send_command("HGET", key, "a")  # type: ignore[attr-defined]
    assert wire.round_trip(conn, ("PING",), skip=2) == b"PONG"
    assert wire.round_trip(conn, ("HGET", key, "a")) == b"1"  # nothing left over from them


def test_a_round_trip_over_tls_goes_through_the_tls_socket(tmp_path: Path) -> None:
    """A TLS connection's bytes are encrypted by its socket: never written on the descriptor raw."""
    from testkit.redis_sentinel import _Server, _Tls

    tls = _Tls(tmp_path / "pki")
    server = _Server(tmp_path / "redis", tls)
    server.start()
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5, **tls.options())
    try:
        conn = client.connection_pool.get_connection()
        conn.connect()
        assert wire.round_trip(conn, ("SET", "k", "v" * 1000)) == b"OK"
        conn.send_command("PUBLISH", "ch", "not waited for")
        assert wire.round_trip(conn, ("GET", "k"), skip=1) == b"v" * 1000
        client.connection_pool.release(conn)
        assert client.get("k") == b"v" * 1000
    finally:
        client.close()
        server.stop()


def test_a_connection_it_cannot_use_is_left_to_redis_py(redis_server: RedisServer) -> None:
    state = redis_state(redis_server)
    conn = _connected(state)
    conn.disconnect()  # type: ignore[attr-defined]
    assert wire.round_trip(conn, ("PING",)) is wire.UNSENT
    assert wire.round_trip(_connected(state), ("SPACE IN NAME",)) is wire.UNSENT


def test_a_store_that_does_not_answer_is_a_timeout_and_the_connection_is_dropped(
    redis_server: RedisServer,
) -> None:
    state = redis_state(redis_server)
    conn = _connected(state)
    other = redis.Redis.from_url(redis_server.url)
    other.execute_command("CLIENT", "PAUSE", 5_000, "ALL")
    try:
        with pytest.raises(redis.TimeoutError):
            wire.round_trip(conn, ("PING",))
    finally:
        other.execute_command("CLIENT", "UNPAUSE")
        other.close()
    assert conn._sock is None  # type: ignore[attr-defined]  # a late answer is never read as the next one's
    assert state.command("PING") == b"PONG"  # the next call connects again


def test_a_closed_connection_is_a_connection_error(redis_server: RedisServer) -> None:
    state = redis_state(redis_server)
    conn = _connected(state)
    name = f"{state.prefix}-victim"
    wire.round_trip(conn, ("CLIENT", "SETNAME", name))
    other = redis.Redis.from_url(redis_server.url)
    try:
        listing = other.execute_command("CLIENT", "LIST")
        listing = listing.decode() if isinstance(listing, bytes) else listing
        mine = [line for line in listing.splitlines() if f"name={name}" in line]
        client_id = mine[0].split("id=")[1].split()[0]
        other.execute_command("CLIENT", "KILL", "ID", client_id)
    finally:
        other.close()
    with pytest.raises(redis.ConnectionError):
        wire.round_trip(conn, ("PING",))
    assert conn._sock is None  # type: ignore[attr-defined]


async def test_pushed_hands_over_each_message_of_a_subscription(redis_server: RedisServer) -> None:
    # What is read is under test, not how fast: a loaded CI machine once took the broker's 250 ms.
    state = RedisState(redis_server.url, prefix=f"t{secrets.token_hex(4)}", timeout_s=5.0)
    channel = f"{state.prefix}:ch"
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        pubsub = client.pubsub()
        await pubsub.subscribe(channel)
        conn = pubsub.connection
        confirmation = await asyncio.wait_for(wire.pushed(conn), 10)
        assert confirmation[0] == b"subscribe"  # from now on the channel's messages reach it
        assert state.command("PUBLISH", channel, "one") == 1
        state.command("PUBLISH", channel, "two")
        got = [await asyncio.wait_for(wire.pushed(conn), 10) for _ in range(2)]
        assert [list(m) for m in got] == [
            [b"message", channel.encode(), b"one"],
            [b"message", channel.encode(), b"two"],
        ]
    finally:
        await client.aclose()

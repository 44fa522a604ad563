"""One command's round trip on a replica's own Redis connection, straight on its socket.

A replica's lease calls are one script each, sent and answered on one blocking
connection (`RedisState._command`). redis-py's layers per call (the health
check's clock read, the error text of the host built before every read, the
parser's and the connection's read_response, the push and error checks) cost
more Python than packing, sending and parsing together. Here the command is
packed by hiredis, written with one `sendall`, and its answer read with
`recv_into` into the connection's own hiredis reader: the same socket, the
same reader and buffer, so the connection stays usable by redis-py for
anything else.

The errors are redis-py's: a timeout is `redis.TimeoutError`, a broken or
closed socket `redis.ConnectionError` (the connection is disconnected first,
so that a half-read answer is never read as the next one's), and an error
answer is raised as the exception the reader built (`NoScriptError`,
`ResponseError`, ...). When the connection is not in the shape this relies on
(not connected, another parser, a health check due), `round_trip`
answers `UNSENT` and sends nothing: the caller takes redis-py's way.

Answers of commands sent earlier without waiting (a `PUBLISH`: `skip` of them)
are read in the same reads as the command's own answer and dropped, so they
cost no read of their own. The command is written straight on the socket's
file descriptor (a plain socket's; TLS goes through its socket), which a
socket with a timeout keeps non-blocking: Python's `sendall` asks `poll`
first whether the socket can take it, a system call per command that a few
hundred bytes into an idle connection never need; what the kernel does not
take at once goes by `sendall`.
"""

from __future__ import annotations

import math
import os
import socket
import time
from typing import Any

import redis

try:
    from hiredis import PushNotification
    from hiredis import pack_command as _pack
    from redis._parsers.hiredis import NOT_ENOUGH_DATA, _HiredisParser  # NOT_ENOUGH_DATA: half an answer
except ImportError:  # pragma: no cover - redis-py without hiredis, or another layout of redis-py
    _pack = None  # type: ignore[assignment]

UNSENT: Any = object()  # nothing was sent: use redis-py's path
_write = os.write
_PLAIN = socket.socket  # a TLS socket (ssl.SSLSocket) is a subclass: its bytes must go through it


def _lost(conn: Any, err: OSError, timed_out: str) -> redis.RedisError:
    """The connection is dropped (a half-read answer must never be read as the next one's); the
    error as redis-py's: a timeout, or a broken connection."""
    conn.disconnect()
    if isinstance(err, TimeoutError):
        return redis.TimeoutError(f"{timed_out} within {conn.socket_timeout} s")
    return redis.ConnectionError(f"the connection to the store failed: {err}")


def _write_all(sock: Any, packed: bytes) -> None:
    try:  # not TLS: its bytes go on the descriptor as they are
        sent = _write(sock.fileno(), packed) if type(sock) is _PLAIN else 0
    except BlockingIOError:
        sent = 0
    if sent < len(packed):
        sock.sendall(packed[sent:])


def round_trip(conn: Any, command: tuple[Any, ...], skip: int = 0) -> Any:
    """Send `command` on `conn` and return its answer, after dropping `skip` answers of commands
    sent before it without waiting (error answers too); `UNSENT` when this path does not apply
    (then nothing was sent or read)."""
    if _pack is None or " " in command[0]:
        return UNSENT
    parser = conn._parser
    sock = conn._sock
    if (
        sock is None
        or type(parser) is not _HiredisParser
        or parser._reader is None
        or (conn.health_check_interval and time.monotonic() > conn.next_health_check)
    ):
        return UNSENT  # redis-py's path connects, checks health, and moves the next check on
    try:
        packed = _pack(command)
    except TypeError:  # an argument hiredis does not pack: redis-py's packer will
        return UNSENT
    reader = parser._reader
    buffer = parser._buffer
    try:
        _write_all(sock, packed)
        while True:
            answer = reader.gets()
            while answer is NOT_ENOUGH_DATA:
                n = sock.recv_into(buffer)
                if n == 0:
                    raise redis.ConnectionError("the store closed the connection")
                reader.feed(buffer, 0, n)  # type: ignore[arg-type]  # redis-py feeds its buffer so too
                answer = reader.gets()
            if isinstance(answer, PushNotification):
                parser.handle_push_response(answer)  # RESP3: a notice of the server's, not our answer
            elif skip:
                skip -= 1  # an earlier command's answer, not waited for
            else:
                break
    except OSError as err:
        raise _lost(conn, err, "no answer from the store") from None
    except BaseException:
        conn.disconnect()
        raise
    if isinstance(answer, redis.ResponseError):
        raise answer  # read whole: the connection stays good
    if isinstance(answer, redis.ConnectionError):  # how the reader reports a broken protocol
        conn.disconnect()
        raise answer
    return answer


def send_only(conn: Any, commands: tuple[tuple[Any, ...], ...]) -> bool:
    """Write `commands` on `conn` at once, their answers left to be read later (`skip` above);
    False when this path does not apply (then nothing was sent)."""
    sock = conn._sock
    if (
        _pack is None
        or sock is None
        or (conn.health_check_interval and time.monotonic() > conn.next_health_check)
    ):
        return False
    parts = []
    for command in commands:
        if " " in command[0]:
            return False
        try:
            parts.append(_pack(command))
        except TypeError:
            return False
    packed = parts[0] if len(parts) == 1 else b"".join(parts)
    try:
        _write_all(sock, packed)
    except OSError as err:
        raise _lost(conn, err, "the store took no command") from None
    return True


async def pushed(conn: Any) -> Any:
    """The next message on an asyncio pub/sub connection (redis.asyncio), read from its stream into
    its hiredis reader without redis-py's layers per message; no timeout (an idle subscription
    waits). A closed stream is `redis.ConnectionError`."""
    parser = conn._parser
    reader = getattr(parser, "_reader", None)
    stream = conn._reader
    if _pack is None or reader is None or stream is None or not hasattr(reader, "gets"):
        return await conn.read_response(timeout=math.inf, push_request=True)
    answer = reader.gets()
    while answer is NOT_ENOUGH_DATA:
        data = await stream.read(65536)
        if not data:
            raise redis.ConnectionError("the store closed the connection")
        reader.feed(data)
        answer = reader.gets()
    if isinstance(answer, redis.ConnectionError):  # how the reader reports a broken protocol
        raise answer
    return answer

"""The connection to the shared state store (Redis or Valkey) behind `kvbroker serve --state`.

One blocking client per replica: the core is synchronous, and each call is
one round trip on a local network (a Lua script, a pipeline), well under the
few milliseconds a request may hold the event loop. A store that does not
answer turns into `Unavailable` (gRPC UNAVAILABLE, cause `state_unavailable`):
the broker refuses what it cannot record instead of guessing.

A store that hangs (paused, overloaded, partitioned: no reset) must not freeze
the replica: every call waits at most ``CALL_TIMEOUT_S`` and is never retried
by the client library behind our back; on a single Redis, the first call that
times out marks the store away (``kvbroker.broker.fleet.health``) and every
later call fails at once with Unavailable until a probe off the event loop
finds it answering again. The loop therefore waits on a hung store once per
outage, for one call's timeout, not once per call. On a Cluster the same holds
per node (``kvbroker.broker.fleet.nodes``): a hung node fails fast, the others
serve on.

A Redis Cluster is named by its seed nodes (`redis+cluster://H1:P1,H2:P2`).
Every script and transaction touches the keys of one hash slot (their keys
share a hash tag), and on a Cluster each script starts with `#!lua`, which
makes the server refuse any access outside that slot instead of allowing it
when the slots happen to share a node. A redirect (MOVED, ASK) is followed by
the client; one it cannot follow, a slot no primary serves, a node that is
down or a Cluster that is down is `Unavailable` like a standalone store away.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.sentinel
from redis.backoff import ConstantBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterError,
    NoScriptError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry

from kvbroker.broker.errors import InvalidArgument, Unavailable
from kvbroker.broker.fleet.health import StoreHealth
from kvbroker.broker.fleet.nodes import ClusterNodes, online_replicas
from kvbroker.broker.fleet.urls import (
    CLUSTER_SCHEMES,
    SCHEMES,
    SENTINEL_SCHEMES,
    USAGE,
    parse_cluster_url,
    parse_sentinel_url,
    shown_url,
    tls_options,
)
from kvbroker.broker.fleet.wire import UNSENT, round_trip, send_only

T = TypeVar("T")
log = logging.getLogger("kvbroker.broker.fleet")
# The longest a call to the store may hold the event loop (a socket timeout; nothing retried).
CALL_TIMEOUT_S = 0.25
# Where the store has replicas: how long a lease's end waits for one to have it before its notice goes.
DURABLE_WAIT_MS = 50
_NO_RETRY = redis.asyncio.retry.Retry(NoBackoff(), retries=0)
# Answers of unwaited commands (PUBLISH) left on a connection until its next command reads them.
_MOST_UNREAD = 64

# Answers that mean "not now" rather than "never": a replica or a loading store, and a Cluster
# failing over or resharding (a script whose slot is half moved meets a key on another node; with
# `#!lua` a key of another slot is refused earlier, as "do not hash to the same slot").
_TRANSIENT = ("READONLY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN")
# Answers of a Cluster node for a command it did not run: left to the client, which knows what to do.
_NOT_HERE = ("MOVED", "ASK", "NOSCRIPT", "TRYAGAIN", "CLUSTERDOWN")
_TRANSIENT_IN_SCRIPT = ("access a non local key", "while the cluster is down")


def _hiredis_packer() -> Callable[[tuple[Any, ...]], bytes] | None:
    """hiredis' packing, in C (redis-py's own is Python per argument); it comes with
    kvbroker[redis], but redis-py works without it."""
    try:
        from hiredis import pack_command
    except ImportError:  # pragma: no cover
        return None
    return pack_command


_pack_command = _hiredis_packer()


def own_connection(pool: Any) -> Any:
    """A connection of this replica's own, made with the pool's settings but outside its count:
    redis-py counts every connection its pool's make_connection() made against max_connections
    (100 since redis-py 8) and is never told when we drop one, so a replica that dialled a node
    again after each broken connection (a failover, a store restart) ran out after 100."""
    return pool.connection_class(**pool.connection_kwargs)


def _send(conn: Any, command: tuple[Any, ...]) -> None:
    """Send one command on `conn`, packed by hiredis when it can (names without a space; str,
    bytes, int and float arguments), else by redis-py."""
    if _pack_command is not None and " " not in command[0]:
        try:
            packed = _pack_command(command)
        except TypeError:
            pass
        else:
            conn.send_packed_command([packed])
            return
    conn.send_command(*command)


def _raw(answer: Any) -> Any:
    """One shape whatever parsed it (RESP3 or the client): HGETALL's map and SMEMBERS' set as lists."""
    if isinstance(answer, dict):
        return [x for kv in answer.items() for x in kv]
    if isinstance(answer, set):
        return list(answer)
    return answer


class RedisState:
    """A Redis (or Cluster) client, the fleet's key prefix, and the one place Redis errors become broker
    errors."""

    def __init__(self, url: str, prefix: str = "kvb", timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.url = url
        self.shown = shown_url(url)
        self.prefix = prefix
        self.cluster = url.startswith(CLUSTER_SCHEMES)
        self._timeout_s = timeout_s
        self.client: Any  # redis.Redis or redis.RedisCluster: the same commands, scripts and pipelines
        self._conn: Any = None  # on one Redis: the connection `run` and `command` use
        self._node_conns: dict[str, Any] = {}  # on a Cluster: one per primary, by node name
        self._unread = 0  # answers of commands sent on `_conn` without waiting (see `publish`)
        # Those connections carry one command at a time: only the thread that made this state
        # (the event loop's) uses them; any other goes through the client's pool.
        self._thread = threading.get_ident()
        self._sentinel: Any = None
        self._undurable_logged = -math.inf
        self._last_key: Any = None  # on a Cluster: the key of the last call on our own connections
        self._last_conn: Any = None  # and the connection it went over (None: the client's way)
        if self.cluster:
            self.seeds, self._options = parse_cluster_url(url)
            self.client = self._connect_cluster()
            self.nodes = ClusterNodes(self.shown, self._node_client, self.client.nodes_manager.initialize)
            self.nodes.guard(self.client)
        elif url.startswith(SENTINEL_SCHEMES):
            self.sentinels, self.service, self._options = parse_sentinel_url(url)
            # A primary that fails over is found again through the Sentinels at each new connection.
            self._sentinel = redis.sentinel.Sentinel(self.sentinels, sentinel_kwargs=self._sentinel_options())
            self.client = self._standalone(url)
        elif url.startswith(SCHEMES):
            self.client = self._standalone(url)
        else:
            raise InvalidArgument(f"--state {self.shown!r} is not a Redis URL: {USAGE}")
        # On a Cluster a node away is one slot range away, not the store: `self.nodes` fails fast
        # per node instead (broker/fleet/nodes.py).
        self.health = StoreHealth(self.shown, self._probe)
        self._prober: Any = None

    def _standalone(self, url: str) -> redis.Redis:
        # No retries in the client: each would hold the event loop another timeout and back-off.
        options: dict[str, Any] = {
            "socket_timeout": self._timeout_s,
            "socket_connect_timeout": self._timeout_s,
            "health_check_interval": 10,
            "retry": Retry(NoBackoff(), retries=0),
        }
        if url.startswith(SENTINEL_SCHEMES):
            return self._sentinel.master_for(self.service, **options, **self._options)
        return redis.Redis.from_url(url, **options)

    def _async_client(self, **options: Any) -> redis.asyncio.Redis:
        """An asyncio client to the (current) primary of a single Redis or a Sentinel's service."""
        if not self.url.startswith(SENTINEL_SCHEMES):
            return redis.asyncio.Redis.from_url(self.url, **options)
        sentinel = redis.asyncio.sentinel.Sentinel(self.sentinels, sentinel_kwargs=self._sentinel_options())
        return sentinel.master_for(self.service, **options, **self._options)

    def _sentinel_options(self) -> dict[str, Any]:
        """A Sentinel's connection: the call timeout, and TLS as the primary's (rediss+sentinel)."""
        t = self._timeout_s
        return {"socket_timeout": t, "socket_connect_timeout": t, **tls_options(self._options)}

    def _probe(self) -> None:
        """One ping on the probe thread's own connection (never the loop's)."""
        if self._prober is None:
            self._prober = self._standalone(self.url)
        self._prober.ping()

    def _node_client(self, host: str, port: int) -> redis.Redis:
        """A client of one Cluster node's own (a probe's), never retried."""
        t = self._timeout_s
        options: dict[str, Any] = {"socket_timeout": t, "socket_connect_timeout": t}
        options["retry"] = Retry(NoBackoff(), retries=0)
        return redis.Redis(host=host, port=port, **options, **self._options)

    def back_for(self) -> float:
        """Seconds since the store (on a Cluster: the last node that hung) answered again."""
        if self.cluster:
            return self.nodes.back_for()
        return self.health.back_for()

    def _connect_cluster(self) -> RedisCluster:
        try:
            return RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in self.seeds],
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                # One quick retry after refreshing the slot map: the event loop waits on every call,
                # so a node that is down must become UNAVAILABLE now, not after seconds of backoff.
                retry=Retry(ConstantBackoff(0.01), retries=1),
                **self._options,
            )
        except (RedisClusterException, redis.RedisError) as err:
            raise Unavailable(f"the Redis Cluster {self.shown} does not answer: {err}") from None

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if not self.cluster:
            self.health.check()
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as err:
            if not self.cluster:
                self.health.failed(f"{type(err).__name__}: {err}")
            raise Unavailable(f"the shared state store {self.shown} does not answer: {err}") from None
        except (ClusterError, TryAgainError, AskError, SlotNotCoveredError) as err:
            # A Cluster resharding or failing over: what the call touches has no primary to answer now.
            raise Unavailable(f"the Redis Cluster {self.shown} cannot serve this now: {err}") from None
        except redis.ResponseError as err:
            if str(err).startswith(_TRANSIENT):
                raise Unavailable(
                    f"the shared state store {self.shown} cannot take writes now: {err}"
                ) from None
            if self.cluster and any(words in str(err) for words in _TRANSIENT_IN_SCRIPT):
                raise Unavailable(f"the Redis Cluster {self.shown} is moving this slot: {err}") from None
            raise
        except RedisClusterException as err:
            if "connect" in str(err).lower():  # every known node is down
                raise Unavailable(f"the Redis Cluster {self.shown} does not answer: {err}") from None
            raise

    def run(self, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run a script from `script()` over a connection of this replica's own: the client's
        layers per command cost more CPU than the round trip itself. On a Cluster, to the primary
        the cached slot map names for the first key; a redirect goes the client's way."""
        if threading.get_ident() != self._thread:  # e.g. a /metrics scrape: the client's own pool
            return self.call(script, keys=keys, args=args)
        if self.cluster:
            evalsha = ("EVALSHA", script.sha, len(keys), *keys, *args)
            return self.call(self._on_node, keys[0], evalsha, lambda: script(keys=keys, args=args))
        return self.call(self._command, "EVALSHA", script, len(keys), *keys, *args)

    def command(self, *command: Any) -> Any:
        """One command, its raw answer (HGETALL: a flat list), over the same connections; on a
        Cluster, routed by its first argument (its key; PUBLISH's channel: any node forwards a
        classic PUBLISH to all)."""
        if threading.get_ident() != self._thread:
            return _raw(self.call(self.client.execute_command, *command))
        if not self.cluster:
            return _raw(self.call(self._command, *command))
        answer = self.call(self._on_node, command[1], command, lambda: self.client.execute_command(*command))
        return _raw(answer)

    def publish(self, channel: str, body: str) -> None:
        self.send_unwaited(("PUBLISH", channel, body))

    def send_unwaited(self, *commands: tuple[Any, ...]) -> None:
        """Commands whose answers nobody uses (PUBLISH: how many listened), sent without waiting:
        on one Redis over this replica's own connection, their answers read with the next
        command's (at most _MOST_UNREAD wait so), so the event loop does not wait a round trip
        for them. Elsewhere, each by `command`."""
        if self.cluster or threading.get_ident() != self._thread:
            for command in commands:
                self.command(*command)
            return
        self.call(self._send_only, commands)

    def _send_only(self, commands: tuple[tuple[Any, ...], ...]) -> None:
        conn = self._conn
        if conn is None:
            conn = self._conn = own_connection(self.client.connection_pool)
        if self._sentinel is not None and conn._sock is None:
            conn.connect()  # see _command: only connect() asks the Sentinels for the primary
        if self._unread + len(commands) > _MOST_UNREAD:  # a burst: answers must not fill a buffer
            self._read_unread(conn)
        try:
            if not send_only(conn, commands):  # one write for all (fleet/wire.py), else redis-py's
                for command in commands:
                    _send(conn, command)
        except BaseException:
            conn.disconnect()
            raise
        self._unread += len(commands)

    def _read_unread(self, conn: Any) -> None:
        """Read (and drop) the answers of commands sent without waiting, before the next one."""
        while self._unread:
            self._unread -= 1
            try:
                conn.read_response()
            except redis.ResponseError:
                pass  # an answer, read whole: the connection stays good
            except BaseException:
                self._unread = 0  # gone with the connection
                conn.disconnect()
                raise

    def _on_node(self, key: Any, command: tuple[Any, ...], slow: Callable[[], Any]) -> Any:
        """On a Cluster: straight to the key's primary. A redirect, an unknown script, a slot not
        served now or a node away is left to the client (`slow`): it follows redirects, refreshes
        the slot map, loads scripts, and its errors become Unavailable as before."""
        node = self.client.get_node_from_key(key)
        self.nodes.check(node.name)  # a node that hung: Unavailable at once until it answers
        self._last_key, self._last_conn = key, None
        conn = self._node_conns.get(node.name)
        if conn is None:
            if node.redis_connection is None:
                return slow()
            conn = self._node_conns[node.name] = own_connection(node.redis_connection.connection_pool)
        try:
            _send(conn, command)
            answer = conn.read_response()
            self._last_conn = conn
            return answer
        except redis.ResponseError as err:
            if str(err).startswith(_NOT_HERE) or isinstance(err, (NoScriptError, AskError, ClusterError)):
                return slow()  # the command did not run on this node
            raise
        except redis.ConnectionError:
            conn.disconnect()
            self._node_conns.pop(node.name, None)
            return slow()
        except redis.TimeoutError as err:
            conn.disconnect()
            self.nodes.failed(node.name, f"TimeoutError: {err}")
            raise
        except BaseException:
            conn.disconnect()  # a half-read answer must not be read as the next one's
            raise

    def _command(self, *command: Any) -> Any:
        script = command[1] if command[0] == "EVALSHA" else None
        if script is not None:
            command = ("EVALSHA", script.sha, *command[2:])
        conn = self._conn
        if conn is None:
            conn = self._conn = own_connection(self.client.connection_pool)
        loaded = reconnected = False
        while True:
            try:
                if self._sentinel is not None and conn._sock is None:
                    # Only connect() asks the Sentinels for the primary (send_command would dial
                    # the default address): after a failover this finds the new primary.
                    conn.connect()
                # Straight on the socket (fleet/wire.py), reading the unwaited answers with this one's.
                unread, self._unread = self._unread, 0
                answer = round_trip(conn, command, unread)
                if answer is UNSENT:  # nothing sent or read: redis-py's way
                    self._unread = unread
                    self._read_unread(conn)
                    _send(conn, command)
                    answer = conn.read_response()
                return answer
            except NoScriptError:  # first use, or a store restarted empty
                if script is None or loaded:
                    raise
                loaded = True
                script.sha = self.call(self.client.script_load, script.script)
                command = ("EVALSHA", script.sha, *command[2:])
            except redis.ConnectionError:
                conn.disconnect()
                if reconnected:  # once more on a new connection: the store may have restarted
                    raise
                reconnected = True
            except redis.ResponseError:
                raise  # an answer, read whole: the connection stays good
            except BaseException:
                conn.disconnect()  # a half-read answer must not be read as the next one's
                raise

    def durable(self) -> bool:
        """Wait (at most DURABLE_WAIT_MS) until a replica has every write made so far over the
        connection of this replica's last call (under Sentinel: its own; on a Cluster: the one to
        the primary of the last key it wrote: every lease key shares one slot); whether one has.
        A holder frees a lease's blocks when told the lease ended, so that end must survive a
        failover: a promoted replica that missed it would let the reader's release commit a read
        of freed blocks. A single Redis, or a Cluster primary with no replica online: True at once."""
        if threading.get_ident() != self._thread:
            return True
        if self.cluster:
            acked = self._cluster_wait()
        elif self._sentinel is None or self._conn is None:
            return True
        else:
            acked = self.call(self._command, "WAIT", 1, DURABLE_WAIT_MS)
        if acked is None or int(acked) >= 1:
            return True
        now = time.monotonic()
        if now - self._undurable_logged > 5.0:
            self._undurable_logged = now
            log.warning("no replica of %s confirmed a lease's end within %d ms", self.shown, DURABLE_WAIT_MS)
        return False

    def _cluster_wait(self) -> int | None:
        """WAIT on the Cluster primary that took the last call; None where it has no replica."""
        if self._last_key is None:
            return None
        node = self.client.get_node_from_key(self._last_key)
        self.nodes.check(node.name)

        def replicas() -> int:
            return online_replicas(self.call(self.client.get_redis_connection(node).info, "replication"))

        if self.nodes.replicas(node.name, replicas) < 1:
            return None
        conn = self._last_conn
        if conn is None:  # it went the client's way: its pool hands the same connection back first
            return int(self.call(self.client.execute_command, "WAIT", 1, DURABLE_WAIT_MS, target_nodes=node))
        return int(self.call(self._wait_on, conn, node.name))

    def _wait_on(self, conn: Any, name: str) -> Any:
        try:
            _send(conn, ("WAIT", 1, DURABLE_WAIT_MS))
            return conn.read_response()
        except redis.TimeoutError as err:
            conn.disconnect()
            self.nodes.failed(name, f"TimeoutError: {err}")
            raise
        except BaseException:
            conn.disconnect()
            raise

    def script(self, text: str) -> Any:
        """A Lua script; on a Cluster, one the server confines to the hash slot of its first key."""
        return self.client.register_script(("#!lua\n" + text) if self.cluster else text)

    def now(self) -> float:
        """Seconds of wall-clock time: deadlines in the store must mean the same on every replica."""
        return time.time()

    def ping(self) -> None:
        self.call(self.client.ping)

    async def subscriber(self) -> redis.asyncio.Redis:
        """An asyncio connection for pub/sub. On a Cluster a classic PUBLISH reaches every node, so
        any live primary will do: the first that answers a ping, from the current slot map, then the
        seeds."""
        if not self.cluster:
            return self._async_client()
        candidates = [(n.host, n.port) for n in self.client.get_primaries()]  # the cached slot map
        candidates += [s for s in self.seeds if s not in candidates]
        for host, port in candidates:
            client = redis.asyncio.Redis(
                host=host, port=port, socket_connect_timeout=self._timeout_s, **self._options
            )
            try:
                await client.ping()
            except redis.RedisError:
                await client.aclose()
                continue
            return client
        raise redis.ConnectionError(f"no node of the Redis Cluster {self.shown} answers")

    def stream_reader(
        self, key: str, block_ms: int, node: tuple[str, int] | None = None, name: str | None = None
    ) -> redis.asyncio.Redis:
        """An asyncio client for XREAD BLOCK on `key` (its reads wait up to block_ms longer than
        others; a lost connection is the caller's to handle: it reads on from its last entry). On a Cluster: a connection to `node` (where a MOVED pointed), else to the primary
        that serves the key's slot in the current slot map."""
        timeout = self._timeout_s + block_ms / 1000
        if not self.cluster:
            return self._async_client(socket_timeout=timeout, client_name=name, retry=_NO_RETRY)
        if node is None:
            owner = self.client.get_node_from_key(key)
            node = (owner.host, owner.port)
        return redis.asyncio.Redis(
            host=node[0],
            port=node[1],
            socket_timeout=timeout,
            socket_connect_timeout=self._timeout_s,
            client_name=name,
            retry=_NO_RETRY,
            **self._options,
        )

    def close(self) -> None:
        self.health.close()
        if self.cluster:
            self.nodes.close()
        for conn in [self._conn, *self._node_conns.values()]:
            if conn is not None:
                conn.disconnect()
        self.client.close()

"""The KV-indexer HTTP API (Mooncake Conductor's, as Dynamo adopted it), served by the broker.

``kvbroker serve --indexer-http 127.0.0.1:8090`` (off by default) serves, on
the broker's event loop next to gRPC:

- ``POST /query``, ``POST /query_by_hash``: prefix hits per tenant, engine,
  tier and rank (indexer_query.py);
- ``POST /register``, ``POST /unregister``: follow (or stop following) a vLLM
  engine's KV event publisher (kv_events.py); ``GET /workers`` lists the
  engines the API knows, with where each one's blocks come from;
- ``GET /health``.

A small HTTP/1.1 server on asyncio streams (keep-alive, bounded heads and
bodies, a read timeout), so the broker needs no web framework. Security
follows the broker's (docs/security.md), through the gate it is given
(broker/security/http_gate.py): with ``--tls-cert`` it serves HTTPS with the
same certificate; with identities on (``--tls-ca``, ``--tokens-file``) every
call needs a client certificate or ``Authorization: Bearer TOKEN``: queries
and ``/workers`` are for routers and operators of the tenant asked,
``/register`` and ``/unregister`` (which make the broker connect out) for
operators. Plaintext on a non-loopback address needs ``--insecure``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlencode

from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import InvalidArgument, Unauthenticated
from kvbroker.broker.exactness import exactness_of
from kvbroker.broker.indexer.kv_events import KvEventsFeed, KvEventsSource, parse_source
from kvbroker.broker.indexer.query import IndexerError, query
from kvbroker.broker.namespaces import ALL_TENANTS, DEFAULT_TENANT
from kvbroker.common.model import EVENT_FED, SOURCE_LABEL

log = logging.getLogger("kvbroker.indexer")

MAX_HEAD_BYTES = 16 * 1024
# Connections whose caller is identified (a first request that passed its identity check, or a
# verified client certificate); beyond: 503 and close, so that idle clients cannot pile up.
MAX_CONNECTIONS = 256
# Connections not identified yet: a newcomer beyond this closes the oldest of them, so hundreds
# of idle strangers cannot keep an operator's new connection out.
MAX_UNIDENTIFIED = 64
HANDSHAKE_TIMEOUT_S = 5.0  # a TLS handshake, and a stranger's first request head, must come in this
READ_TIMEOUT_S = 30.0  # an identified caller's next request on a kept-alive connection
REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    411: "Length Required",
    413: "Payload Too Large",
    503: "Service Unavailable",
}


OPERATOR, ROUTER = "operator", "router"  # the roles of identities (broker/security/identity.py)


class Caller(Protocol):
    """Who sent a request (an identity: broker/security/identity.py)."""

    @property
    def tenant(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def uri(self) -> str: ...

    def owns_tenant(self, tenant: str) -> bool: ...


class Gate(Protocol):
    """How the API listens and who calls it (broker/security/http_gate.py)."""

    def check_address(self, address: str) -> None:
        """InvalidArgument if the API may not be served on `address` this way."""
        ...

    def check_feed_bind(self, endpoint: str) -> None:
        """InvalidArgument if a KV-event feed may not bind `endpoint` (tcp://* needs --insecure)."""
        ...

    def ssl_context(self) -> ssl.SSLContext | None: ...

    @property
    def authenticates(self) -> bool:
        """Whether callers are identified (a KV-event feed then files no bare salts)."""
        ...

    def identify(self, headers: dict[str, str], ssl_object: Any) -> Caller | None:
        """The caller (None: identities are off); Unauthenticated if it shows none accepted."""
        ...


class IndexerHttp:
    def __init__(
        self,
        core: BrokerCore,
        gate: Gate,
        feeds: dict[str, KvEventsFeed],
        engine_tenant: Callable[[str], str | None] | None = None,
    ) -> None:
        self.core = core
        self.gate = gate
        self.feeds = feeds  # engine id -> feed; shared with --kv-events
        self.engine_tenant = engine_tenant
        self.max_body = core.config.max_message_bytes
        self.server: asyncio.Server | None = None
        self.port = 0
        self.connections = 0  # identified ones, against MAX_CONNECTIONS
        self._strangers: dict[asyncio.StreamWriter, None] = {}  # not identified yet, oldest first

    async def start(self, address: str) -> int:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if not port.isdigit() or not host:
            raise InvalidArgument(f"--indexer-http {address!r}: need HOST:PORT")
        self.gate.check_address(address)
        context = self.gate.ssl_context()
        self.server = await asyncio.start_server(
            self._connection,
            host,
            int(port),
            ssl=context,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if context is not None else None,
        )
        self.port = int(self.server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await self.server.wait_closed()

    # -- transport ---------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection. It takes one of MAX_CONNECTIONS slots only once its caller is
        identified; until then it is a stranger: HANDSHAKE_TIMEOUT_S for its first request, and the
        oldest stranger makes room when MAX_UNIDENTIFIED are waiting."""
        identified = False
        self._admit_stranger(writer)
        try:
            while True:
                try:
                    timeout = READ_TIMEOUT_S if identified else HANDSHAKE_TIMEOUT_S
                    # asyncio.timeout, not wait_for (Python 3.11's can lose a cancellation).
                    async with asyncio.timeout(timeout):
                        head = await reader.readuntil(b"\r\n\r\n")
                except (
                    asyncio.IncompleteReadError,
                    asyncio.LimitOverrunError,
                    TimeoutError,
                    ConnectionError,
                ):
                    return
                if len(head) > MAX_HEAD_BYTES:
                    await self._send(writer, 413, {"error": {"message": "request head too large"}}, False)
                    return
                lines = head.decode("latin-1").split("\r\n")
                parts = lines[0].split()
                headers = {}
                for line in lines[1:]:
                    key, sep, value = line.partition(":")
                    if sep:
                        headers[key.strip().lower()] = value.strip()
                keep = headers.get("connection", "").lower() != "close"
                if len(parts) != 3:
                    await self._send(writer, 400, _error(400, "malformed request line"), False)
                    return
                method, target = parts[0], parts[1].split("?", 1)[0]
                length_text = headers.get("content-length", "0")
                if not length_text.isdigit():
                    await self._send(writer, 411, _error(411, "need a Content-Length"), False)
                    return
                length = int(length_text)
                if length > self.max_body:
                    await self._send(writer, 413, _error(413, f"body over {self.max_body} bytes"), False)
                    return
                if not identified:
                    if target == "/health":  # open to anyone, and no slot for it
                        await self._send(writer, 200, {"status": "ok"}, False)
                        return
                    # Identity before a slot (and before the body): a caller who cannot show one
                    # never takes a slot.
                    refused = self._refusal(headers, writer)
                    if refused is not None:
                        await self._send(writer, refused[0], refused[1], False)
                        return
                    self._strangers.pop(writer, None)
                    if self.connections >= MAX_CONNECTIONS:
                        await self._send(writer, 503, _error(503, "too many connections; retry later"), False)
                        return
                    self.connections += 1
                    identified = True
                try:
                    async with asyncio.timeout(READ_TIMEOUT_S):
                        raw = await reader.readexactly(length) if length else b""
                except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                    return
                status, answer = self._handle(method, target, headers, raw, writer)
                await self._send(writer, status, answer, keep)
                if not keep:
                    return
        finally:
            if identified:
                self.connections -= 1
            self._strangers.pop(writer, None)
            writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                await writer.wait_closed()

    def _admit_stranger(self, writer: asyncio.StreamWriter) -> None:
        while len(self._strangers) >= MAX_UNIDENTIFIED:
            oldest = next(iter(self._strangers))
            del self._strangers[oldest]
            oldest.close()  # its read ends, and its task cleans up
        self._strangers[writer] = None

    def _refusal(self, headers: dict[str, str], writer: asyncio.StreamWriter) -> tuple[int, Any] | None:
        """401 for a first request whose caller has no identity (None: identified, or no identities)."""
        try:
            self.gate.identify(headers, writer.get_extra_info("ssl_object"))
        except Unauthenticated as err:
            return 401, _error(401, err.message)
        return None

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, status: int, answer: Any, keep: bool) -> None:
        body = json.dumps(answer, separators=(",", ":")).encode()
        head = (
            f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    # -- requests ------------------------------------------------------------------------

    def _handle(
        self, method: str, target: str, headers: dict[str, str], raw: bytes, writer: asyncio.StreamWriter
    ) -> tuple[int, Any]:
        routes = {
            "/query": "POST",
            "/query_by_hash": "POST",
            "/register": "POST",
            "/unregister": "POST",
            "/workers": "GET",
            "/health": "GET",
        }
        if target not in routes:
            return 404, _error(404, f"no such endpoint {target[:80]!r}; see docs/indexer.md")
        if method != routes[target]:
            return 405, _error(405, f"{target} takes {routes[target]}")
        if target == "/health":
            return 200, {"status": "ok"}
        try:
            who = self.gate.identify(headers, writer.get_extra_info("ssl_object"))
            body: Any = {}
            if method == "POST":
                try:
                    body = json.loads(raw or b"{}")
                except (ValueError, UnicodeDecodeError) as err:
                    raise IndexerError(400, f"the body is not JSON: {err}") from None
                if not isinstance(body, dict):
                    raise IndexerError(400, "the body must be a JSON object")
            if target in ("/register", "/unregister"):
                self._allow(who, (OPERATOR,), target)
                return 200, self._register(body, who) if target == "/register" else self._unregister(
                    body, who
                )
            self._allow(who, (ROUTER, OPERATOR), target)
            if target == "/workers":
                return 200, self._workers(who)
            return 200, query(self.core, body, by_hash=target == "/query_by_hash", who=who)
        except IndexerError as err:
            return err.status, _error(err.status, err.message)
        except Unauthenticated as err:
            return 401, _error(401, err.message)
        except InvalidArgument as err:
            return 400, _error(400, err.message)

    @staticmethod
    def _allow(who: Caller | None, roles: tuple[str, ...], target: str) -> None:
        if who is not None and who.role not in roles:
            allowed = " or ".join(roles)
            raise IndexerError(403, f"{who} may not call {target}: rule '{target} is for {allowed}'")

    def _workers(self, who: Caller | None) -> list[dict[str, Any]]:
        out = []
        for rec in self.core.registry.all():
            hidden = who is not None and who.tenant != "*" and self.engine_tenant is not None
            if hidden and self.engine_tenant(rec.engine_id) != who.tenant:  # type: ignore[misc, union-attr]
                continue
            labels = rec.info.labels
            state, reason = exactness_of(rec, self.core.clock.now())
            event_fed = labels.get(SOURCE_LABEL) == EVENT_FED
            endpoints = {"0": labels.get("kv_events", "")} if event_fed else {}
            out.append(
                {
                    "instance_id": rec.engine_id,
                    "model": rec.info.layout.model,
                    "block_size": rec.info.layout.block_size,
                    "source": EVENT_FED if event_fed else "connector",
                    "endpoints": endpoints,
                    "exactness": state.label,  # exact, lagging or degraded (broker/exactness.py)
                    "exactness_reason": reason,
                }
            )
        return out

    def _feed_tenant(self, who: Caller | None, tenant_id: str) -> str:
        """The tenant a feed registered by `who` files its blocks in: the operator's own (tenant ``*``
        and brokers without identities: the one named; ``default`` is the empty tenant)."""
        if who is not None and who.tenant != ALL_TENANTS:
            if tenant_id not in ("", who.tenant):
                raise IndexerError(
                    403,
                    f"{who} may not register a KV event feed into tenant {tenant_id[:80]!r}: rule 'an operator "
                    f"files feeds into its own tenant' (omit tenant_id, or send {who.tenant!r})",
                )
            return who.tenant
        return "" if tenant_id == DEFAULT_TENANT else tenant_id

    def _register(self, body: dict[str, Any], who: Caller | None) -> dict[str, Any]:
        kind = str(body.get("type", "vLLM"))
        if kind.lower() != "vllm":
            raise IndexerError(400, f"type {kind[:40]!r}: only vLLM publishers are supported")
        for needed in ("endpoint", "instance_id", "modelname", "block_size"):
            if not body.get(needed):
                raise IndexerError(400, f"'{needed}' is required")
        if body.get("lora_name"):
            raise IndexerError(400, "LoRA adapters are not indexed by this broker")
        instance = str(body["instance_id"])
        for name, value in (("instance_id", instance), ("modelname", str(body["modelname"]))):
            if len(value.encode()) > self.core.config.max_id_bytes:
                raise IndexerError(400, f"'{name}' is longer than {self.core.config.max_id_bytes} bytes")
        if instance in self.feeds or self.core.registry.find(instance) is not None:
            raise IndexerError(409, f"instance_id {instance[:80]!r} is already known; unregister it first")
        tenant = self._feed_tenant(who, str(body.get("tenant_id") or ""))
        size = body["block_size"]
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise IndexerError(400, "'block_size' must be a positive integer")
        endpoint = str(body["endpoint"])
        # The endpoint alone (model and block size come as their own fields, as the RFC sends them).
        options = urlencode({"model": str(body["modelname"]), "block_size": size})
        parsed = parse_source(f"{instance}={endpoint}{'&' if '?' in endpoint else '?'}{options}")
        source = KvEventsSource(
            engine_id=instance,
            endpoint=parsed.endpoint,
            model=str(body["modelname"]),
            block_size=size,
            tenant=tenant,
            replay=str(body.get("replay_endpoint") or ""),
        )
        if source.binds:
            try:
                self.gate.check_feed_bind(source.endpoint)
            except InvalidArgument as err:
                raise IndexerError(403, err.message) from None
        feed = KvEventsFeed(self.core, source, bare_salts=not self.gate.authenticates)
        self.feeds[instance] = feed
        feed.start()
        return {"status": "registered successfully", "instance_id": instance}

    def _unregister(self, body: dict[str, Any], who: Caller | None) -> dict[str, Any]:
        instance = str(body.get("instance_id") or "")
        feed = self.feeds.get(instance)
        foreign = feed is not None and who is not None and who.tenant not in (ALL_TENANTS, feed.source.tenant)
        if feed is None or foreign:  # another tenant's feed is as unknown as no feed (nothing leaks)
            raise IndexerError(
                404, f"instance_id {instance[:80]!r} is not a registered KV event publisher of your tenant"
            )
        del self.feeds[instance]
        asyncio.get_running_loop().create_task(feed.stop())
        tenant = str(body.get("tenant_id") or "default")
        return {"status": "unregistered successfully", "removed_instances": [f"{instance}|{tenant}|0"]}


def _error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"code": status, "message": message}}

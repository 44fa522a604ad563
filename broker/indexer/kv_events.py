"""Engines without our connector: the broker follows their vLLM KV cache events.

``kvbroker serve --kv-events 'ENGINE_ID=tcp://HOST:PORT?model=NAME&block_size=N'``
subscribes (ZMQ SUB) to the publisher of a vLLM engine started with
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:PORT"}'`` (vLLM binds a wildcard endpoint). The other way
round, ``ENGINE_ID=tcp://*:PORT?...`` makes the broker bind and the engine
connect to it (``"endpoint": "tcp://BROKER_HOST:PORT"``): vLLM connects to any
endpoint that is not a wildcard. While the broker is connected to that
publisher the engine is registered, labelled ``kvbroker.source=kv-events``,
and the blocks its events store are indexed (kv_chain.py maps vLLM's hashes to
our keys), so Score, Watch, the CLI and the indexer API see it and routers send
it the prompts it has cached. It is never pulled from: it holds no session, so
it cannot take leases, and Resolve and index mirrors leave it out.

When the TCP connection to the publisher drops (the engine died or
restarted), the broker forgets the engine and its blocks at once; when it
comes back the engine is registered again and its blocks return with its
next events. With ``replay=tcp://HOST:PORT`` (vLLM's ``replay_endpoint``), a
gap in the sequence numbers (batches published before the broker connected,
or lost) is filled from the publisher's replay buffer first.

pyzmq and msgspec (both installed with vLLM; the ``kv-events`` extra
otherwise) are imported here only, when a feed starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import BrokerError, InvalidArgument
from kvbroker.broker.indexer.kv_chain import BlockChain, ChainStats, event_fields
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.model import EVENT_FED, SOURCE_LABEL, Namespace
from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger("kvbroker.kv_events")

# They hold no session: the record lives as long as the connection to the publisher (10 years otherwise).
NO_SESSION_TTL_S = 10 * 365 * 86_400.0
_INT_OPTIONS = ("block_size", "num_layers", "num_kv_heads", "head_size")
_STR_OPTIONS = ("model", "hash_algo", "dtype", "kv_layout", "tenant", "topic", "url", "replay")
REPLAY_TIMEOUT_MS = 2_000  # a replay that sends nothing for this long is given up (the gap stays a gap)


@dataclass(frozen=True, slots=True)
class KvEventsSource:
    """One publisher: the engine id it is known by, its ZMQ endpoint and its layout.

    Layout fields not given default to 1 with ``kv_layout=kv-events``: a layout
    of its own that no connector engine shares. Give ``dtype``, ``num_layers``,
    ``num_kv_heads``, ``head_size`` and ``kv_layout`` as our connector registers
    them to put the engine in the same layout as connector engines of its model.
    """

    engine_id: str
    endpoint: str
    model: str
    block_size: int
    hash_algo: str = "sha256"
    tenant: str = ""
    topic: str = ""
    url: str = ""  # the engine's HTTP address, shown as its `url` label (routers send requests there)
    replay: str = ""  # the publisher's replay endpoint (vLLM's replay_endpoint): missed batches are asked for
    dtype: str = ""
    num_layers: int = 1
    num_kv_heads: int = 1
    head_size: int = 1
    kv_layout: str = EVENT_FED

    @property
    def binds(self) -> bool:
        """``tcp://*:PORT``: the broker binds and the engine connects (its endpoint names the broker)."""
        return "*" in self.endpoint

    def engine_info(self) -> pb.EngineInfo:
        labels = {SOURCE_LABEL: EVENT_FED, "kv_events": self.endpoint}
        if self.url:
            labels["url"] = self.url
        return pb.EngineInfo(
            engine_id=self.engine_id,
            layout=pb.LayoutFingerprint(
                model=self.model,
                dtype=self.dtype,
                block_size=self.block_size,
                num_layers=self.num_layers,
                num_kv_heads=self.num_kv_heads,
                head_size=self.head_size,
                hash_algo=self.hash_algo,
                kv_layout=self.kv_layout,
            ),
            labels=labels,
        )


def parse_source(spec: str) -> KvEventsSource:
    """``ENGINE_ID=tcp://HOST:PORT?model=NAME&block_size=N[&hash_algo=..&tenant=..&url=..]``."""
    engine_id, sep, rest = spec.strip().partition("=")
    if not sep or not engine_id or not rest:
        raise InvalidArgument(
            f"--kv-events {spec[:120]!r}: need ENGINE_ID=tcp://HOST:PORT?model=NAME&block_size=N"
        )
    parts = urlsplit(rest)
    if parts.scheme not in ("tcp", "ipc") or not (parts.netloc or parts.path):
        raise InvalidArgument(
            f"--kv-events {spec[:120]!r}: the endpoint must be tcp://HOST:PORT or ipc://PATH"
        )
    options: dict[str, Any] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in _INT_OPTIONS:
            try:
                options[key] = int(value)
            except ValueError:
                raise InvalidArgument(f"--kv-events {engine_id}: {key}={value!r} is not an integer") from None
            if options[key] <= 0:
                raise InvalidArgument(f"--kv-events {engine_id}: {key} must be > 0")
        elif key in _STR_OPTIONS:
            options[key] = value
        else:
            known = ", ".join(_INT_OPTIONS + _STR_OPTIONS)
            raise InvalidArgument(f"--kv-events {engine_id}: unknown option {key!r} (known: {known})")
    for needed in ("model", "block_size"):
        if needed not in options:
            raise InvalidArgument(f"--kv-events {engine_id}: add {needed}=... (as the engine serves it)")
    endpoint = f"{parts.scheme}://{parts.netloc}{parts.path}"
    return KvEventsSource(engine_id=engine_id, endpoint=endpoint, **options)


def parse_sources(specs: str) -> list[KvEventsSource]:
    """Several sources, separated by commas or spaces; engine ids must differ."""
    sources = [parse_source(s) for s in specs.replace(",", " ").split() if s]
    ids = [s.engine_id for s in sources]
    if len(set(ids)) != len(ids):
        raise InvalidArgument("--kv-events names an engine id twice")
    return sources


@dataclass
class KvEventsFeed:
    """Follows one publisher for as long as the broker runs (see the module docstring)."""

    core: BrokerCore
    source: KvEventsSource
    record: EngineRecord | None = None
    # Salted blocks of a feed without a tenant go to the salt alone only without identities (kv_chain).
    bare_salts: bool = True
    chain: BlockChain = field(init=False)
    batches: int = 0
    seq_gaps: int = 0
    replayed: int = 0  # batches applied from the publisher's replay socket
    _last_seq: int = -1
    _task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.chain = BlockChain(self.source.hash_algo, self.source.tenant, bare_salts=self.bare_salts)

    @property
    def stats(self) -> ChainStats:
        return self.chain.stats

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.source.engine_id}")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "kv-events %s: stopped following %s: %s",
                self.source.engine_id,
                self.source.endpoint,
                task.exception(),
            )
            self.disconnected("the broker stopped following its KV events after an error")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.disconnected("the broker stopped following its KV events")

    # -- the engine record ----------------------------------------------------------

    def connected(self) -> None:
        if self.record is not None and self.core.registry.find(self.source.engine_id) is self.record:
            return
        current = self.core.registry.find(self.source.engine_id)
        if current is not None:
            log.warning(
                "kv-events %s: an engine with this id already has a session; not indexing its events",
                self.source.engine_id,
            )
            self.record = None
            return
        # No session to keep alive: it lives exactly as long as the connection to its publisher.
        self.record = self.core.registry.add(
            self.source.engine_info(), NO_SESSION_TTL_S, 0, self.core.clock.now()
        )
        self.chain.clear()
        self._last_seq = -1
        log.info("kv-events %s: publisher %s connected", self.source.engine_id, self.source.endpoint)

    def disconnected(self, why: str) -> None:
        rec, self.record = self.record, None
        self.chain.clear()
        if rec is not None and self.core.registry.find(rec.engine_id) is rec:
            self.core.end_session(rec.session_id, "", why)
            log.info("kv-events %s: %s; its blocks are forgotten", self.source.engine_id, why)

    # -- events -----------------------------------------------------------------------

    def apply_batch(self, seq: int, batch: object) -> None:
        """One decoded ``[ts, [event, ...], dp_rank]`` batch with its sequence number."""
        rec = self.record
        if rec is None or self.core.registry.find(rec.engine_id) is not rec:
            return
        if self._last_seq >= 0 and seq != self._last_seq + 1:
            self.seq_gaps += 1  # missed events: children of what we missed are skipped, not misfiled
        self._last_seq = seq
        if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
            self.chain.stats.unsupported += 1
            return
        self.batches += 1
        for raw in batch[1]:
            event = event_fields(raw)
            try:
                self._apply(rec, event)
            except (BrokerError, TypeError, ValueError, AttributeError) as err:
                # Whatever a publisher sends, the broker and the other engines carry on.
                self.chain.stats.unsupported += 1
                log.warning("kv-events %s: event not applied: %s", self.source.engine_id, str(err)[:200])

    def _apply(self, rec: EngineRecord, event: Mapping[str, Any] | None) -> None:
        kind = event.get("type") if event is not None else None
        layout = rec.layout_id
        if event is None:
            self.chain.stats.unsupported += 1
        elif kind == "BlockStored":
            for tier, tenant, wire in self.chain.stored(event):
                self.core.update_inventory(rec, Namespace(layout, tenant), tier, wire, ())
        elif kind == "BlockRemoved":
            for tier, tenant, wire in self.chain.removed(event):
                self.core.update_inventory(rec, Namespace(layout, tenant), tier, (), wire)
        elif kind == "AllBlocksCleared":
            self.chain.clear()
            self.core.index.drop_holder(rec.engine_id)

    def _needs_replay(self, seq: int) -> bool:
        return bool(self.source.replay) and self.record is not None and seq > self._last_seq + 1

    async def _replay(self, ctx: Any, start: int, stop: int, decode: Any) -> None:
        """Ask the publisher's replay socket for batches [start, stop) and apply them in order.

        vLLM keeps its last ``buffer_steps`` batches for this; what it no longer has stays
        a gap (counted), and children of what is missing are skipped, not misfiled."""
        import zmq

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(self.source.replay)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while await dealer.poll(REPLAY_TIMEOUT_MS):
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    break
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq < 0:
                    break  # the end-of-replay marker
                if self._last_seq < seq < stop:
                    self.replayed += 1
                    self.apply_batch(seq, decode(frames[3]))
        finally:
            dealer.close(linger=0)

    async def _run(self) -> None:
        import msgspec
        import zmq
        import zmq.asyncio
        from zmq.utils.monitor import parse_monitor_message

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.setsockopt(zmq.RECONNECT_IVL, 200)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # Up once the ZMTP handshake succeeded (a port that merely accepts TCP is no publisher).
        up = zmq.EVENT_HANDSHAKE_SUCCEEDED
        monitor = sub.get_monitor_socket(up | zmq.EVENT_DISCONNECTED)
        try:
            if self.source.binds:
                sub.bind(self.source.endpoint)
            else:
                sub.connect(self.source.endpoint)
        except zmq.ZMQError as err:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            raise InvalidArgument(
                f"cannot {'bind' if self.source.binds else 'connect'} {self.source.endpoint}: {err}"
            ) from None
        decoder = msgspec.msgpack.Decoder()
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    note = parse_monitor_message(await monitor.recv_multipart())
                    if note["event"] == up:
                        self.connected()
                    elif note["event"] == zmq.EVENT_DISCONNECTED:
                        self.disconnected("the connection to its KV event publisher dropped")
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        self.chain.stats.unsupported += 1
                        continue
                    try:
                        batch = decoder.decode(frames[2])
                    except msgspec.DecodeError:
                        self.chain.stats.unsupported += 1
                        continue
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if self._needs_replay(seq):
                        try:
                            await self._replay(ctx, self._last_seq + 1, seq, decoder.decode)
                        except (zmq.ZMQError, msgspec.DecodeError) as err:
                            log.warning("kv-events %s: replay failed: %s", self.source.engine_id, err)
                    self.apply_batch(seq, batch)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)


async def start_feeds(core: BrokerCore, specs: str) -> list[KvEventsFeed]:
    feeds = [KvEventsFeed(core, source) for source in parse_sources(specs)]
    for feed in feeds:
        feed.start()
    return feeds

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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import BrokerError, InvalidArgument
from kvbroker.broker.exactness import Exactness
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
# Events are decoded and applied in slices: after this much work the feed yields the event
# loop, so a 120,000-event batch never holds up gRPC (bench/control_plane/kv_events_stall.py measures it).
SLICE_BUDGET_S = 0.002
SLICE_CHECK_EVERY = 8  # events between looks at the clock (an event costs tens of microseconds)


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
    bad_frames: int = 0  # frames skipped: wrong shape, undecodable, too deeply nested
    _last_seq: int = -1
    _bad_logged: float = float("-inf")
    _lost: str = ""  # why events were lost for good (the index is degraded until a clear or a reconnect)
    _replaying: bool = False
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
        self._lost, self._replaying = "", False
        self._show()
        log.info("kv-events %s: publisher %s connected", self.source.engine_id, self.source.endpoint)

    def disconnected(self, why: str) -> None:
        rec, self.record = self.record, None
        self.chain.clear()
        if rec is not None and self.core.registry.find(rec.engine_id) is rec:
            self.core.end_session(rec.session_id, "", why)
            log.info("kv-events %s: %s; its blocks are forgotten", self.source.engine_id, why)

    # -- events -----------------------------------------------------------------------

    def bad_frame(self, why: str) -> None:
        """Count a frame that is skipped; the feed goes on with the next one (logged once a minute)."""
        self.bad_frames += 1
        now = self.core.clock.now()
        if now - self._bad_logged >= 60.0:
            self._bad_logged = now
            log.warning(
                "kv-events %s: frame skipped (%d so far), still following: %s",
                self.source.engine_id,
                self.bad_frames,
                why[:200],
            )

    async def apply_batch(self, seq: int, events: Sequence[Any], decode: Callable[[Any], Any]) -> None:
        """One batch's events (each still encoded: `decode` turns one into its value), applied in
        slices of about SLICE_BUDGET_S each with the event loop yielded in between."""
        rec = self.record
        if rec is None or self.core.registry.find(rec.engine_id) is not rec:
            return
        if self._last_seq >= 0 and seq != self._last_seq + 1:
            self.seq_gaps += 1  # missed events: children of what we missed are skipped, not misfiled
            self._lost = f"KV event batches {self._last_seq + 1}..{seq - 1} were lost"
            self._show()
        self._last_seq = seq
        self.batches += 1
        clock = time.perf_counter
        started = clock()
        for done, raw in enumerate(events, 1):
            try:
                self._apply(rec, event_fields(decode(raw)))
            except (BrokerError, TypeError, ValueError, AttributeError, RecursionError) as err:
                # Whatever a publisher sends, the broker and the other engines carry on.
                self.chain.stats.unsupported += 1
                log.debug("kv-events %s: event not applied: %s", self.source.engine_id, str(err)[:200])
            if done % SLICE_CHECK_EVERY == 0 and clock() - started >= SLICE_BUDGET_S:
                await asyncio.sleep(0)
                if self.record is not rec or self.core.registry.find(rec.engine_id) is not rec:
                    return  # the publisher went away (or the feed stopped) meanwhile
                started = clock()

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
            self._lost = ""  # the picture starts again from nothing: exact
            self._show()

    def _show(self) -> None:
        """Tell the registry how exact this engine's entries are (broker/exactness.py)."""
        rec = self.record
        if rec is None or self.core.registry.find(rec.engine_id) is not rec:
            return
        if self._lost:
            self.core.registry.set_exactness(rec, Exactness.DEGRADED, self._lost)
        elif self._replaying:
            self.core.registry.set_exactness(rec, Exactness.LAGGING, "replaying missed KV event batches")
        else:
            self.core.registry.set_exactness(rec, Exactness.EXACT, "")

    def _splitter(self, msgspec: Any) -> Callable[[bytes], list[Any] | None]:
        return _batch_splitter(msgspec, self)

    def _needs_replay(self, seq: int) -> bool:
        return bool(self.source.replay) and self.record is not None and seq > self._last_seq + 1

    async def _replay(self, ctx: Any, start: int, stop: int, split: Any, decode: Any) -> None:
        """Ask the publisher's replay socket for batches [start, stop) and apply them in order.

        vLLM keeps its last ``buffer_steps`` batches for this; what it no longer has stays
        a gap (counted), and children of what is missing are skipped, not misfiled."""
        import zmq

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.core.config.kv_events_max_frame_bytes)
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
                    events = split(frames[3])
                    if events is not None:
                        self.replayed += 1
                        await self.apply_batch(seq, events, decode)
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
        # A frame over the limit is never read into memory: ZMQ drops the publisher's connection
        # (and reconnects; the feed forgets and relearns the engine, as after any drop).
        sub.setsockopt(zmq.MAXMSGSIZE, self.core.config.kv_events_max_frame_bytes)
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
        split = self._splitter(msgspec)
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
                        if not self.source.binds:
                            # ZMQ gives up for good on a peer that broke the protocol (a frame over
                            # ZMQ_MAXMSGSIZE): connect anew, as after any drop.
                            with contextlib.suppress(zmq.ZMQError):
                                sub.disconnect(self.source.endpoint)
                            sub.connect(self.source.endpoint)
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        self.bad_frame(f"{len(frames)} frames; a batch is topic, 8-byte sequence, payload")
                        continue
                    events = split(frames[2])
                    if events is None:
                        continue
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if self._needs_replay(seq):
                        self._replaying = True
                        self._show()
                        try:
                            await self._replay(ctx, self._last_seq + 1, seq, split, decoder.decode)
                        except zmq.ZMQError as err:
                            log.warning("kv-events %s: replay failed: %s", self.source.engine_id, err)
                        finally:
                            self._replaying = False
                    await self.apply_batch(seq, events, decoder.decode)
                    self._show()  # a gap the replay did not fill degrades the entries
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)


def _batch_splitter(msgspec: Any, feed: KvEventsFeed) -> Callable[[bytes], list[Any] | None]:
    """payload -> its events, each still encoded (None: not a batch, counted). Only the
    outer ``[ts, [events], dp_rank]`` is parsed at once (a quick scan, no Python object per
    value); each event is decoded later, in slices (apply_batch)."""
    outer = msgspec.msgpack.Decoder(list[msgspec.Raw])

    def split(payload: bytes) -> list[Any] | None:
        try:
            batch = outer.decode(payload)
            if len(batch) < 2:
                raise ValueError(f"{len(batch)} items; a batch is [ts, [events], dp_rank]")
            events: list[Any] = outer.decode(batch[1])
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError) as err:
            feed.bad_frame(f"not a KV event batch: {err}")
            return None
        return events

    return split

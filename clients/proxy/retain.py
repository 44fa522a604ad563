"""Retention for OpenAI clients: a header that keeps a conversation's prefix for a while.

A client that knows its conversation will come back after a pause (an agent
waiting on a tool, a person reading) sends ``X-KV-Retain-Seconds: 600`` with
the turn; optionally ``X-KV-Retain-Key: SESSION`` names the conversation. Once
the turn is answered, the proxy asks the broker to ``Retain`` the prompt's
prefix on the engine that now holds it (the decode engine, or the one engine
that served it), for that long (docs/broker.md, "Retention"). With a key, the
previous turn's retention of that conversation is replaced (ended once the new
one is pinned), so one conversation keeps one retention.

It runs after the answer, in the background: the engine announces the turn's
blocks to the broker a moment after it answers, so a retain that finds
nothing yet (``not_cached``) is tried again for a few seconds, and a retain
waits (as long) until the engine holds the whole prompt, not just the previous
turn's prefix. An outcome is
logged and counted (``counts``), never turned into an error of a request that
was already answered.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

from kvbroker.clients.errors import BrokerError
from kvbroker.clients.proxy.config import EngineSpec
from kvbroker.clients.proxy.validate import InvalidRequest
from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger("kvbroker.proxy")

RETAIN_SECONDS_HEADER = "X-KV-Retain-Seconds"
RETAIN_KEY_HEADER = "X-KV-Retain-Key"
MAX_KEY_CHARS = 200
# A conversation's latest retention, per key, for the next turn to replace (oldest keys forgotten).
MAX_KEYS = 10_000
# The longest pause between two Score calls while a retain waits for the engine's announce.
MAX_SCORE_PAUSE_S = 0.5


def retain_request(headers: Mapping[str, str]) -> tuple[float, str] | None:
    """(seconds, key) the request asks to retain its conversation for; None when it does not ask.
    Raises InvalidRequest for a value that is not a positive number of seconds, or an oversized key."""
    raw = headers.get(RETAIN_SECONDS_HEADER)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequest(
            RETAIN_SECONDS_HEADER,
            f"{RETAIN_SECONDS_HEADER} must be a positive number of seconds, got {raw!r}",
        )
    key = headers.get(RETAIN_KEY_HEADER, "")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidRequest(
            RETAIN_KEY_HEADER, f"{RETAIN_KEY_HEADER} is longer than {MAX_KEY_CHARS} characters"
        )
    return seconds, key


class Retainer:
    def __init__(self, broker: Any, *, announce_wait_s: float = 5.0, retry_s: float = 0.1) -> None:
        self.broker = broker  # clients.aio.AsyncBrokerClient
        self.announce_wait_s = announce_wait_s
        self.retry_s = retry_s
        self.counts: Counter[str] = Counter()  # retained, replaced, or the cause it failed with
        self._latest: OrderedDict[str, str] = OrderedDict()  # key -> lease id
        self._tasks: set[asyncio.Task[None]] = set()

    def after_turn(
        self,
        engine: EngineSpec | None,
        namespace: pb.Namespace | None,
        hashes: list[int],
        seconds: float,
        key: str,
    ) -> None:
        """Retain the answered turn's prompt on `engine`, in the background."""
        if engine is None or not engine.engine_id or namespace is None or not hashes:
            why = "the prompt was not scored" if namespace is None or not hashes else "no engine id known"
            log.info("not retaining (%s): %s", key or "no key", why)
            self.counts["not_scored"] += 1
            return
        task = asyncio.create_task(self._retain(engine.engine_id, namespace, hashes, seconds, key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retain(
        self, engine_id: str, namespace: pb.Namespace, hashes: list[int], seconds: float, key: str
    ) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.announce_wait_s
        request = pb.RetainRequest(
            namespace=namespace,
            block_hashes=hashes,
            ttl_ms=max(1, round(seconds * 1000)),
            engine_id=engine_id,
            key=key,
            replaces_lease_id=self._latest.get(key, "") if key else "",
        )
        await self._wait_for_announce(engine_id, namespace, hashes, give_up)
        while True:
            try:
                answer = await self.broker.retain(request)
                break
            except BrokerError as e:
                if e.cause == "not_cached" and loop.time() < give_up:
                    await asyncio.sleep(self.retry_s)  # the engine has not announced the turn yet
                    continue
                self.counts[e.cause or "error"] += 1
                log.warning("retaining %s on %s failed: %s", key or "a conversation", engine_id, e)
                return
        lease = answer.lease
        self.counts["retained"] += 1
        if answer.replaced:
            self.counts["replaced"] += 1
        if key:
            self._latest[key] = lease.lease_id
            self._latest.move_to_end(key)
            while len(self._latest) > MAX_KEYS:
                self._latest.popitem(last=False)
        log.info(
            "retained %d blocks of %s on %s for %.0f s (lease %s, tier %s)",
            len(lease.block_hashes),
            key or "a conversation",
            engine_id,
            seconds,
            lease.lease_id,
            pb.Tier.Name(lease.tier),
        )

    async def _wait_for_announce(
        self, engine_id: str, namespace: pb.Namespace, hashes: list[int], give_up: float
    ) -> None:
        """Wait (until `give_up`) for `engine_id` to hold the whole prompt. The engine announces the
        turn's blocks a moment after it answered, and until then it may hold the previous turn's
        prefix only: retaining at once would keep that shorter prefix (and answer `retained`)."""
        loop = asyncio.get_running_loop()
        pause = self.retry_s
        while True:
            try:
                answer = await self.broker.score(
                    namespace=namespace, block_hashes=hashes, candidates=[engine_id]
                )
            except BrokerError as e:
                log.info("not waiting for %s to announce the turn: %s", engine_id, e)
                return  # the retain says precisely what is wrong
            held = max((max(s.gpu_blocks, s.cpu_blocks) for s in answer.scores), default=0)
            if held >= len(hashes) or loop.time() >= give_up:
                return
            # Growing pauses: an engine whose blocks never all show (hashed apart from the proxy's
            # chain, say) costs the broker about a dozen Score calls per turn, not fifty.
            await asyncio.sleep(min(pause, give_up - loop.time()))
            pause = min(pause * 1.5, MAX_SCORE_PAUSE_S)

    async def close(self) -> None:
        """Stop the retains under way (the proxy is shutting down)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def drain(self) -> None:
        """Wait for the retains under way (tests; shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

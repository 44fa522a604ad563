"""Holds of the scheduler side: a finished request's blocks kept for a reader under a lease.

When a request finishes normally and a reader will take its blocks (P for a
``do_remote_decode`` request, or any request with ``multi_turn``), its full,
computed blocks are held: a Hold to the broker, announced as stored once
granted. They stay out of vLLM's free pool by our own reference in its block
pool (``HoldPin.BLOCK_POOL``), so vLLM frees the request at once and an engine
that only holds sleeps; without a bound pool, by vLLM's delay_free. Whatever
ends the lease (released, declined, revoked, expired, the broker session lost,
or our own backstop), the hold is freed and announced removed, on the session
thread if vLLM is idle; the pool reference itself is dropped on the scheduler
thread (``give_back``), the only thread that may touch the pool.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvbroker.clients import errors
from kvbroker.common.causes import Cause
from kvbroker.engine_adapter.decisions import (
    BadTransferParams,
    holdable_blocks,
    parse_transfer_params,
    prompt_tail,
    wire_hashes,
)
from kvbroker.engine_adapter.gpu_inventory import GpuInventory
from kvbroker.engine_adapter.scheduler_context import SchedulerContext, finished_normally
from kvbroker.v1 import broker_pb2 as pb

# Under "vllm." so that vLLM's logging configuration prints our lines.
logger = logging.getLogger("vllm.kvbroker.scheduler")


class HoldPin(enum.Enum):
    """Who keeps a held request's blocks out of vLLM's free pool."""

    # Our own reference in vLLM's block pool (bind_gpu_block_pool): vLLM frees the
    # request at once, so an engine that only holds has no work and sleeps.
    BLOCK_POOL = "block_pool"
    # vLLM's delay_free_blocks: the request stays in the scheduler until the
    # worker reports it sent. vLLM counts such a request as work and steps
    # without pause, so this is only the fallback when no block pool is bound.
    DELAY_FREE = "delay_free"


@dataclass
class Held:
    request_id: str
    namespace: pb.Namespace
    hashes: list[int]
    block_ids: list[int]
    started: float
    future: Future[pb.Lease] | None
    pin: HoldPin = HoldPin.DELAY_FREE
    lease_id: str = ""
    freed: bool = False
    announced: bool = False
    # The Hold's answer was lost (the stream broke, or it came too late): the hold may exist at
    # the broker, where a reader can claim it, so the blocks stay until its lease ends.
    unsure: bool = False


def _call_later(delay_s: float, callback: Callable[[], None]) -> None:
    timer = threading.Timer(delay_s, callback)
    timer.daemon = True
    timer.start()


def answer_lost(error: BaseException | None) -> bool:
    """A Hold failed without a word from the broker on it: the stream broke before the answer,
    or it came too late. The broker may have made the hold (a replica that died right after its
    store did). A broker that answered UNAVAILABLE itself (its shared store away) changed nothing."""
    if isinstance(error, errors.DeadlineExceeded):
        return True
    return isinstance(error, errors.Unavailable) and error.cause != Cause.STATE_UNAVAILABLE


class Holds:
    def __init__(self, ctx: SchedulerContext, inventory: GpuInventory, on_reply: Callable[[], None]) -> None:
        self._ctx = ctx
        self._inventory = inventory
        # Called on the session thread when a Hold is answered (the scheduler's on_link_event).
        self._on_reply = on_reply
        self._held: dict[str, Held] = {}
        self._held_by_lease: dict[str, str] = {}
        # vLLM's block pool (bind_block_pool) and the held blocks to give back to it.
        # Only the scheduler thread may touch the pool: returns wait for its next hook.
        self._block_pool: Any = None
        self._pool_returns: list[list[int]] = []
        # Runs a callback after some seconds, on another thread (tests replace it).
        self.call_later: Callable[[float, Callable[[], None]], None] = _call_later
        # When the one pending backstop timer fires (inf: none): an idle engine runs no step, and a
        # hold whose lease-end notice was lost (at most once, e.g. across a replica's death) must
        # still be freed at its backstop.
        self._timer_at = math.inf

    # ------------------------------------------------------------------
    # vLLM's block pool
    # ------------------------------------------------------------------

    def bind_block_pool(self, block_pool: Any) -> None:
        self._block_pool = block_pool

    def has_pool_returns(self) -> bool:
        return bool(self._pool_returns)

    def take_pool_returns(self) -> list[list[int]]:
        """Ended holds' blocks, for give_back (under the scheduler's lock)."""
        returns, self._pool_returns = self._pool_returns, []
        return returns

    def give_back(self, returns: list[list[int]]) -> bool:
        """Drop our pool references (scheduler thread only); True if any."""
        pool = self._block_pool
        for block_ids in returns:
            # Last block first: vLLM evicts in the order freed, so the prefix outlives its tail.
            pool.free_blocks([pool.blocks[i] for i in reversed(block_ids)])
        return bool(returns)

    # ------------------------------------------------------------------
    # what the scheduler's hooks call
    # ------------------------------------------------------------------

    def hold_finished(
        self, request: Any, block_ids: Sequence[int]
    ) -> tuple[HoldPin | None, dict[str, Any] | None]:
        """Hold a finished request's blocks for a reader when one will take them; says how they stay."""
        ctx = self._ctx
        req_id = request.request_id
        try:
            params = parse_transfer_params(request.kv_transfer_params)
        except BadTransferParams as e:
            # Already logged (warning) when the request arrived; one line per request is enough.
            logger.debug("kvbroker: request %s: ignoring kv_transfer_params: %s", req_id, e)
            return None, None
        if not (params.do_remote_decode or ctx.config.multi_turn):
            return None, None
        if not finished_normally(request):
            return None, None
        link = ctx.link
        if link is None or not link.connected or not link.layout_id:
            logger.info("kvbroker: request %s: not holding its blocks: broker unreachable", req_id)
            return None, self._decode_params(0) if params.do_remote_decode else None
        n = holdable_blocks(
            request.num_computed_tokens, len(request.block_hashes), len(block_ids), ctx.block_size
        )
        if n == 0:
            return None, self._decode_params(0) if params.do_remote_decode else None
        namespace = ctx.namespace(request)
        hashes = wire_hashes(request.block_hashes[:n])
        held_ids = list(block_ids[:n])
        if params.do_remote_decode:
            # The prompt's last, partial block too, under its own hash: D reads it
            # and computes only the prompt's last token (decisions.prompt_tail).
            tail = prompt_tail(request, request.num_computed_tokens, ctx.block_size)
            if tail is not None and tail[0] == n and len(block_ids) > n:
                hashes.append(tail[1])
                held_ids.append(block_ids[n])
        future = link.hold(
            namespace,
            hashes,
            held_ids,
            ttl_ms=ctx.config.hold_ttl_ms,
            request_id=req_id,
            reader_engine_id=params.reader_engine_id,
        )
        pin = HoldPin.DELAY_FREE
        if self._block_pool is not None:
            pool = self._block_pool
            pool.touch([pool.blocks[i] for i in held_ids])
            pin = HoldPin.BLOCK_POOL
        held = Held(req_id, namespace, hashes, held_ids, ctx.clock(), future, pin)
        self._held[req_id] = held
        if ctx.config.verify_bytes:
            ctx.state_digests(pb.TIER_GPU, held_ids, hashes)
            self._inventory.wake_engine()  # an engine that only holds states them at once
        ctx.stats.count("holds_requested")
        # The reply may come while vLLM is idle: settle it on the session thread then.
        future.add_done_callback(lambda _: self._on_reply())
        return pin, self._decode_params(
            len(held_ids), hold_request_id=req_id
        ) if params.do_remote_decode else None

    def advance(self, now: float) -> None:
        """Settle answered Holds; free holds whose lease-end notice never came."""
        config = self._ctx.config
        backstop = (config.hold_ttl_ms + 2 * config.session_ttl_ms) / 1000.0
        for held in list(self._held.values()):
            if held.freed:
                continue
            future = held.future
            if not held.lease_id and future is not None and future.done():
                error = future.exception()
                lease_id = "" if error is not None else future.result().lease_id
                if not lease_id and answer_lost(error):
                    if not held.unsure:
                        held.unsure = True
                        logger.warning(
                            "kvbroker: request %s: the hold's answer was lost (%s); keeping its %d "
                            "blocks until its lease ends or the broker session is over",
                            held.request_id,
                            error,
                            len(held.block_ids),
                        )
                elif not lease_id:
                    logger.warning(
                        "kvbroker: request %s: hold refused, freeing %d blocks: %s",
                        held.request_id,
                        len(held.block_ids),
                        error,
                    )
                    self._free(held, "hold refused")
                    continue
                else:
                    held.lease_id = lease_id
                    self._held_by_lease[lease_id] = held.request_id
                    self._announce(held, stored=True)
            if now - held.started > backstop:
                # Every lease ends: if no notice ever came, do not pin blocks forever.
                self._free(held, "no lease-end notice within hold TTL + 2 session TTLs")
        due = min((h.started + backstop for h in self._held.values() if not h.freed), default=math.inf)
        if due < self._timer_at:  # an idle engine runs no step: look again at the backstop all the same
            self._timer_at = due
            self.call_later(max(0.0, due - now) + 0.1, self._backstop_due)

    def _backstop_due(self) -> None:
        self._timer_at = math.inf
        self._on_reply()  # settles on the session thread, under the scheduler's lock: advance again

    def take_lease_ends(self) -> None:
        """Free the holds whose lease ended. Call right after ``advance`` (one lock hold).

        A lease's end never overtakes its Hold's answer: the broker queues the
        answer before anything the lease can cause, the session stream keeps
        that order, and the session thread settles the hold's future (running
        our callback, which waits for the scheduler's lock) before it reads the
        next message. So a notice taken here names a hold whose future was
        done when ``advance`` ran, and is known by its lease id; any other
        notice (a lease we read from, say) is not a hold's.
        """
        link = self._ctx.link
        if link is None:
            return
        for notice in link.take_lease_ends():
            req_id = self._held_by_lease.get(notice.lease_id)
            held = self._held.get(req_id) if req_id else None
            if held is None and notice.request_id:
                lost = self._held.get(notice.request_id)  # a hold whose answer was lost
                held = lost if lost is not None and lost.unsure else None
            if held is not None:
                self._free(held, f"lease {notice.lease_id} ended ({notice.cause})")

    def free_all(self, why: str) -> None:
        for held in list(self._held.values()):
            self._free(held, why)

    def sent(self, req_id: str) -> None:
        """vLLM reports the request's blocks sent (finished_sending)."""
        held = self._held.get(req_id)
        if held is not None and held.pin is HoldPin.DELAY_FREE:
            self._returned(held)  # vLLM has now put the blocks back into its free pool

    def live(self) -> tuple[int, int]:
        """Holds not yet freed, and their blocks."""
        live = [h for h in self._held.values() if not h.freed]
        return len(live), sum(len(h.block_ids) for h in live)

    # ------------------------------------------------------------------
    # one hold
    # ------------------------------------------------------------------

    def _free(self, held: Held, why: str) -> None:
        if held.freed:
            return
        held.freed = True
        self._announce(held, stored=False)
        if held.pin is HoldPin.BLOCK_POOL:
            # Our pool reference goes at the scheduler thread's next hook, before any
            # allocation that could need the blocks; vLLM freed the request long ago.
            self._pool_returns.append(held.block_ids)
            self._returned(held)
            self._inventory.wake_engine()  # an idle engine gives them back now, not at its next request
        else:
            self._ctx.pending_frees.append(held.request_id)
        self._ctx.stats.count("holds_freed")
        logger.info(
            "kvbroker: request %s: freeing %d held blocks: %s", held.request_id, len(held.block_ids), why
        )

    def _returned(self, held: Held) -> None:
        """The hold is over and its blocks are vLLM's again."""
        del self._held[held.request_id]
        self._held_by_lease.pop(held.lease_id, None)
        self._ctx.stats.count("holds_returned")
        self._ctx.stats.count("held_blocks_returned", len(held.block_ids))

    def _announce(self, held: Held, *, stored: bool) -> None:
        """The GPU inventory announces each (namespace, hash) once, however many holds
        (and whether vLLM's prefix cache) cover it."""
        if held.announced == stored:
            return
        held.announced = stored
        self._inventory.held(held.namespace, held.hashes, stored=stored)

    def _decode_params(self, num_blocks: int, hold_request_id: str = "") -> dict[str, Any]:
        """kv_transfer_params that make D pull (through the broker) instead of prefill."""
        ctx = self._ctx
        broker_part: dict[str, Any] = {
            "holder_engine_id": ctx.config.engine_id,
            "num_blocks": num_blocks,
            # A reader with another TP size refuses at once (engine_adapter/topology.py).
            "tp_size": ctx.tp_size,
            "pp_size": ctx.pp_size,
        }
        if hold_request_id:
            # Names the hold, so a reader (or the router) that will not read it declines it.
            broker_part["hold_request_id"] = hold_request_id
        if ctx.costs.prefill.ready:
            # What a prefill costs here, timed on this engine's steps: a decode-only reader
            # never times one and predicts its recompute with these (cost_model.py).
            a, b, c = ctx.costs.prefill.coefficients()
            broker_part["prefill_model"] = {
                "step_ms": round(a * 1000.0, 4),
                "ms_per_1k_tokens": round(b * 1000.0, 4),
                "ms_per_1m_pairs": round(c * 1000.0, 4),
            }
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": ctx.config.engine_id,
            "kvbroker": broker_part,
        }

"""The engine's answer to a broker's ``PinCommand``, whatever form its pin handler answers in."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from collections.abc import Callable
from typing import Any

from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger("kvbroker.clients.session")


async def pin_result(on_pin: Callable[[pb.PinCommand], Any] | None, command: pb.PinCommand) -> pb.PinResult:
    """``on_pin``'s result (a PinResult, an awaitable or a future of one); a failed one on any error."""
    lease_id = command.lease.lease_id
    if on_pin is None:
        return pb.PinResult(lease_id=lease_id, ok=False, error="engine has no pin handler")
    try:
        reply = on_pin(command)
        if isinstance(reply, concurrent.futures.Future):
            reply = await asyncio.wrap_future(reply)
        elif inspect.isawaitable(reply):
            reply = await reply
        if not isinstance(reply, pb.PinResult):
            raise TypeError(f"on_pin returned {type(reply).__name__}, not PinResult")
        if not reply.lease_id:
            reply.lease_id = lease_id
        return reply
    except Exception as exc:
        log.exception("pin handler failed for lease %s", lease_id)
        return pb.PinResult(lease_id=lease_id, ok=False, error=f"pin handler failed: {exc}")

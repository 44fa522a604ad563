"""Declining P's hold when no D will read it, in the background of the client's answer.

P holds a prompt's blocks for the D that the proxy names; when no D reads them
(D rejected the request, the client left, no D answered), the proxy tells the
broker, so P frees them now rather than at the hold's TTL. The client's
answer does not wait on the broker. A D that already claimed the hold keeps it
(the broker refuses the decline). A Decline is retried on the next replica
like a read (a repeat finds the hold already ended or claimed), within one
deadline over all tries.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvbroker.clients.errors import BrokerError

log = logging.getLogger("kvbroker.proxy")  # the proxy's one logger name (forward.py)

# All tries of one background Decline together (the client divides it among the replicas).
DECLINE_TIMEOUT_S = 5.0


class HoldDeclines:
    def __init__(self, broker: Any | None) -> None:
        self.broker = broker  # clients.aio.AsyncBrokerClient, or None (no broker: nothing to decline)
        self._tasks: set[asyncio.Task[None]] = set()

    def decline(self, params: dict[str, Any] | None, reason: str) -> None:
        """No D will read the hold named in P's ``kv_transfer_params``: decline it in the background."""
        part = params.get("kvbroker") if isinstance(params, dict) else None
        if self.broker is None or not isinstance(part, dict):
            return
        holder, request_id = part.get("holder_engine_id"), part.get("hold_request_id")
        if not (isinstance(holder, str) and holder and isinstance(request_id, str) and request_id):
            return
        task = asyncio.get_running_loop().create_task(self._send(holder, request_id, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, holder: str, request_id: str, reason: str) -> None:
        try:
            await self.broker.decline(  # type: ignore[union-attr]
                holder_engine_id=holder,
                request_id=request_id,
                reason=f"proxy: {reason}",
                timeout=DECLINE_TIMEOUT_S,
            )
            log.info("declined %s's hold of request %s: %s", holder, request_id, reason)
        except BrokerError as e:
            log.warning("could not decline %s's hold of request %s (%s): %s", holder, request_id, reason, e)

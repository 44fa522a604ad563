"""The Retain and Unretain RPCs: decode, call broker/retention.py, encode.

A mixin of the servicer (broker/servicer.py), so that the servicer keeps one
class and this stays apart. A new retention is answered once its holder has
pinned the blocks (or refused, or not answered within --pin-timeout-ms, which
the expiry loop enforces): the caller learns at once whether the prefix is
kept, never a promise the holder could not make.
"""

from __future__ import annotations

import asyncio

import grpc

from kvbroker.broker import codec
from kvbroker.broker.channels import SessionNotifier
from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import BrokerError, FailedPrecondition, shown
from kvbroker.broker.lease_calls import lease_response
from kvbroker.broker.leases import Lease, about, ended_cause
from kvbroker.broker.retention import Retention
from kvbroker.broker.status import abort, status_of
from kvbroker.v1 import broker_pb2 as pb


def _not_pinned(lease: Lease) -> FailedPrecondition:
    detail = f": {lease.detail}" if lease.detail else ""
    return FailedPrecondition(
        f"engine {shown(lease.holder)} did not pin the {len(lease.block_hashes)} blocks to retain "
        f"({lease.cause.label}{detail}); they may have been evicted meanwhile: retain again, or let "
        "the next turn recompute",
        ended_cause(lease),
        about(lease, engine_id=lease.holder),
    )


class RetentionCalls:
    core: BrokerCore
    notifier: SessionNotifier

    async def Retain(self, request: pb.RetainRequest, context: grpc.aio.ServicerContext) -> pb.RetainResponse:
        retention = Retention(self.core)
        try:
            done = retention.retain(
                codec.namespace(request.namespace),
                request.block_hashes,
                request.token_ids,
                request.ttl_ms,
                engine_id=request.engine_id,
                key=request.key,
                lease_id=request.lease_id,
                replaces=request.replaces_lease_id,
                tier_wanted=request.tier,
            )
            lease, replaced = done.lease, False
            if done.pending:
                settled: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()

                def wake(lease: Lease) -> None:
                    if not settled.done():
                        settled.set_result(lease)

                self.notifier.wait_pin(lease.lease_id, wake)
                lease = await settled  # the pin timeout bounds this wait: the expiry loop settles it
                if not lease.state.live:
                    raise _not_pinned(lease)
                replaced = retention.settled(lease, request.replaces_lease_id)
        except BrokerError as err:
            await abort(context, status_of(err), err.message, err.cause, err.metadata)
        return pb.RetainResponse(
            lease=codec.lease_pb(lease, self.core.clock.now()),
            requested_blocks=done.requested_blocks,
            replaced=replaced,
        )

    async def Unretain(
        self, request: pb.UnretainRequest, context: grpc.aio.ServicerContext
    ) -> pb.LeaseResponse:
        try:
            lease = Retention(self.core).unretain(request.lease_id)
        except BrokerError as err:
            await abort(context, status_of(err), err.message, err.cause, err.metadata)
        return lease_response(self.core, lease)

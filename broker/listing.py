"""ListEngines and ListLeases in pages: bounded in items and in bytes, in a stable order.

However many engines or leases the broker has, and however large each is (an
engine's NIXL metadata, a lease's hashes), one answer stays below the message
size limit: a page ends at `page_size` items or at half the limit in bytes,
whichever comes first, and names where the next page starts. The token is
the last item's id, so a page after changes neither repeats nor skips an
item that stayed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from kvbroker.broker import codec
from kvbroker.broker.core import BrokerCore
from kvbroker.broker.leases import Lease
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.model import LeaseState
from kvbroker.v1 import broker_pb2 as pb


def _order(item_id: str) -> tuple[int, str]:
    # Lease ids end in a hex counter: shorter first, then by text, is their creation order.
    return (len(item_id), item_id)


def _page_size(core: BrokerCore, asked: int) -> int:
    limit = core.config.list_page_size
    return limit if asked == 0 else min(asked, limit)


def _byte_budget(core: BrokerCore) -> int:
    return core.config.max_message_bytes // 2


def _leases(core: BrokerCore, engine_id: str, include_ended: bool) -> Iterable[Lease]:
    if engine_id:
        by_id = {lease.lease_id: lease for lease in core.leases.by_holder(engine_id)}
        by_id.update((lease.lease_id, lease) for lease in core.leases.by_reader(engine_id))
        yield from by_id.values()
    else:
        yield from core.leases.live()
    if include_ended:
        for lease in core.leases.recently_ended():
            if not engine_id or engine_id in (lease.holder, lease.reader):
                yield lease


def list_leases(
    core: BrokerCore, request: pb.ListLeasesRequest, tenant_seen: Callable[[str], bool] | None = None
) -> pb.ListLeasesResponse:
    """A page of leases; `tenant_seen`: which namespace tenants the caller may see (None: all), applied
    before paging, so a page and its token name only what the caller may see."""
    after = _order(request.page_token) if request.page_token else None
    limit = _page_size(core, request.page_size)
    # The page and one more (to know whether more follow), without sorting everything.
    chosen = heapq.nsmallest(
        limit + 1,
        (
            lease
            for lease in _leases(core, request.engine_id, request.include_ended)
            if (after is None or _order(lease.lease_id) > after)
            and (tenant_seen is None or tenant_seen(lease.namespace.tenant))
        ),
        key=lambda lease: _order(lease.lease_id),
    )
    now = core.clock.now()
    out = pb.ListLeasesResponse()
    size, budget = 0, _byte_budget(core)
    for lease in chosen[:limit]:
        msg = codec.lease_pb(lease, now)
        size += msg.ByteSize() + 8
        if out.leases and size > budget:
            break
        out.leases.append(msg)
    if len(out.leases) < len(chosen):
        out.next_page_token = out.leases[-1].lease_id
    return out


def _engine_pb(core: BrokerCore, rec: EngineRecord) -> pb.EngineInfo:
    held = sum(1 for lease in core.leases.by_holder(rec.engine_id) if lease.state is LeaseState.ACTIVE)
    read = sum(1 for lease in core.leases.by_reader(rec.engine_id) if lease.state is LeaseState.ACTIVE)
    return codec.engine_pb(rec, core.engine_blocks(rec), held, read)


def list_engines(
    core: BrokerCore, request: pb.ListEnginesRequest, engine_seen: Callable[[str], bool] | None = None
) -> pb.ListEnginesResponse:
    """A page of engines; `engine_seen`: which engine ids the caller may see (None: all), applied
    before paging, so a page and its token name only what the caller may see."""
    after = _order(request.page_token) if request.page_token else None
    limit = _page_size(core, request.page_size)
    chosen = heapq.nsmallest(
        limit + 1,
        (
            rec
            for rec in core.registry.all()
            if (not request.layout_id or rec.layout_id == request.layout_id)
            and (after is None or _order(rec.engine_id) > after)
            and (engine_seen is None or engine_seen(rec.engine_id))
        ),
        key=lambda rec: _order(rec.engine_id),
    )
    out = pb.ListEnginesResponse()
    size, budget = 0, _byte_budget(core)
    for rec in chosen[:limit]:
        msg = _engine_pb(core, rec)
        size += msg.ByteSize() + 8
        if out.engines and size > budget:
            break
        out.engines.append(msg)
    if len(out.engines) < len(chosen):
        out.next_page_token = out.engines[-1].engine_id
    return out

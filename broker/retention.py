"""Retention: keep a conversation's prefix on the engine that holds it for a while, with no reader.

An agent framework or router that knows a conversation will come back says
"keep this prompt's prefix for N seconds". The broker turns that into a lease
whose reader is nobody (``reader == ""``) and whose request id is
``retain:KEY``, made the way a reader's lease on cached blocks is made: the
lease starts PENDING, the holder gets a PinCommand and pins the blocks (a
reference in vLLM's block pool for the GPU tier, a pinned slot for the CPU
tier: engine_adapter/gpu_inventory.py, cpu_stores.py), and its PinResult makes
the lease ACTIVE. Nothing new is asked of an engine.

Every lease ends, and so does this one:

- at its TTL (``ttl_expired``): the expiry loop revokes it and the holder
  unpins, as for any lease;
- by ``unretain`` (``released``): the holder is told at once;
- when the holder's session ends (``holder_gone``): the pin is lost with the
  engine. A later ``retain`` renewing it answers so (FAILED_PRECONDITION with
  that cause), and watchers see the ``lease_revoked`` event of a lease whose
  request id starts with ``retain:``;
- when its holder, an engine without a CPU tier, gives up the GPU pin because
  vLLM needs the memory (``memory_pressure``: the engine sends a PinResult
  with ``given_up``, least recently retained first,
  engine_adapter/retention_pressure.py), told the same two ways. A CPU-tier
  copy's pin is not given up.

A retention lease is never offered to a reader as a hold to claim (it is
ACTIVE, not HELD): a reader that wants the blocks gets a pin of its own, so
a read never ends the retention. Quotas: each retention is a live lease of its
holder (--max-leases-per-engine) and of its tenant (--quota-leases, with
identities); apart from those, a tenant keeps at most --max-retentions-per-tenant.

Everything here goes through the LeaseTable, registry and index interfaces,
so it works on every state backend (in memory, Redis, Redis Cluster).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import FailedPrecondition, InvalidArgument, NotFound, QuotaExceeded, shown
from kvbroker.broker.holders import find_holders
from kvbroker.broker.leases import Lease, about, ended_cause
from kvbroker.broker.prompts import prompt_chain
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.causes import Cause
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier

RETAIN_PREFIX = "retain:"


def is_retention(lease: Lease) -> bool:
    return not lease.reader and lease.request_id.startswith(RETAIN_PREFIX)


@dataclass
class Retained:
    lease: Lease
    requested_blocks: int
    pending: bool  # waits for the holder's PinResult (a new retention; a renewal does not)


class Retention:
    def __init__(self, core: BrokerCore) -> None:
        self.core = core

    # -- retain ----------------------------------------------------------------------

    def retain(
        self,
        ns: Namespace,
        hashes: Sequence[int],
        token_ids: Sequence[int],
        ttl_ms: int,
        *,
        engine_id: str = "",
        key: str = "",
        lease_id: str = "",
        replaces: str = "",
        tier_wanted: int = 0,
    ) -> Retained:
        """A new retention (PENDING until its holder pins), or, with `lease_id`, one renewed."""
        core = self.core
        check = core.check
        if ttl_ms == 0:
            raise InvalidArgument(
                "ttl_ms is 0; a retention names how long to keep the prefix "
                f"({core.config.lease_ttl_min_ms} .. {core.config.lease_ttl_max_ms} ms)"
            )
        ttl_s = check.lease_ttl_s(ttl_ms)  # OUT_OF_RANGE outside --lease-ttl-min/max-ms
        for value, what in ((engine_id, "engine_id"), (key, "key"), (lease_id, "lease_id")):
            check.ident(value, what)
        check.ident(replaces, "replaces_lease_id")
        if lease_id:
            return Retained(self._renew(lease_id, ttl_s), 0, pending=False)
        check.namespace(ns)
        chain = prompt_chain(core.registry, check, ns, hashes, token_ids)
        if not chain:
            raise InvalidArgument(
                "retain names no full block: give the prompt's block_hashes or at least one block of token_ids"
            )
        if replaces:
            with contextlib.suppress(NotFound, FailedPrecondition):  # ended already: nothing to replace
                self._retention(replaces, "replace")  # but a lease that is no retention is refused
        holder, tier, matched = self._holder(
            ns, chain, engine_id, check.tier(tier_wanted) if tier_wanted else None
        )
        check.lease_blocks(matched)
        self._check_quota(ns.tenant)
        now = core.clock.now()
        lease = core.leases.create(
            holder=holder.engine_id,
            reader="",
            namespace=ns,
            tier=tier,
            block_hashes=chain[:matched],
            block_ids=(),
            state=LeaseState.PENDING,
            ttl_s=ttl_s,
            deadline=now + core.config.pin_timeout_ms / 1000,
            request_id=RETAIN_PREFIX + key,
            max_leases=core.config.leases_per_engine,
        )
        core.notifier.pin(holder.session_id, lease)
        return Retained(lease, len(chain), pending=True)

    def _holder(
        self, ns: Namespace, chain: Sequence[int], engine_id: str, tier: Tier | None
    ) -> tuple[EngineRecord, Tier, int]:
        """The engine to pin on, the tier of its copy to pin and how many blocks that copy has from
        block 0. None: its CPU-tier copy where that has as much as its GPU copy (GPU memory stays
        vLLM's to evict and the pinned CPU copy serves the next turn), else its GPU copy."""
        core = self.core
        if engine_id:
            rec = core.registry.get(engine_id)  # NOT_FOUND unknown_engine
            core.check.layout(rec, ns)
            if rec.draining:
                raise FailedPrecondition(
                    f"engine {shown(engine_id)} is draining and takes no new retentions", Cause.DRAINING
                )
        now = core.clock.now()
        matches = find_holders(core.index, core.registry, core.leases, None, ns, chain, now)
        if not engine_id and matches:
            engine_id = matches[0].engine_id  # the best holder (longest prefix, least loaded)
        held = {m.tier: m.matched for m in matches if m.engine_id == engine_id and m.matched}
        asked = tier
        if tier is None:
            cpu, gpu = held.get(Tier.CPU, 0), held.get(Tier.GPU, 0)
            tier = Tier.CPU if cpu and cpu >= gpu else Tier.GPU
        if held.get(tier):
            return core.registry.get(engine_id), tier, held[tier]
        where = f"engine {shown(engine_id)} does not hold" if engine_id else "no ready engine holds"
        if asked is not None:
            where += f" (on tier {asked.name})"
        raise NotFound(
            f"{where} the first of the {len(chain)} blocks to retain in namespace "
            f"(layout {shown(ns.layout_id)}, tenant {shown(ns.tenant)}); retain after the turn finished, "
            "on the engine that ran it, in the same namespace",
            Cause.NOT_CACHED,
            {"engine_id": engine_id} if engine_id else {},
        )

    def _check_quota(self, tenant: str) -> None:
        limit = self.core.config.max_retentions_per_tenant
        if not limit:
            return
        held = self.count(tenant)
        if held >= limit:
            raise QuotaExceeded(
                f"tenant {shown(tenant)} keeps {held} retentions, its quota (--max-retentions-per-tenant "
                f"{limit}); unretain some or let them end before retaining more",
                metadata={"tenant": tenant, "limit": str(limit)},
            )

    def live_by_tier(self) -> dict[Tier, int]:
        """Live retentions (pinned or waiting for the pin) per tier, for /metrics."""
        out = dict.fromkeys(Tier, 0)
        for rec in self.core.registry.all():
            for lease in self.core.leases.by_holder(rec.engine_id):
                if is_retention(lease):
                    out[lease.tier] += 1
        return out

    def count(self, tenant: str) -> int:
        """Live retentions of `tenant`: walks the holders' leases (a per-holder index on every backend)."""
        core = self.core
        return sum(
            1
            for rec in core.registry.all()
            for lease in core.leases.by_holder(rec.engine_id)
            if is_retention(lease) and lease.namespace.tenant == tenant
        )

    def _renew(self, lease_id: str, ttl_s: float) -> Lease:
        core = self.core
        core._expire_now(lease_id)  # a deadline that passed ends it now, not at the next expiry pass
        lease = self._retention(lease_id, "renew")
        if lease.state is LeaseState.PENDING:
            raise FailedPrecondition(
                f"retention {lease_id} is still waiting for its holder's pin; renew it once it is active",
                Cause.WRONG_LEASE_STATE,
                about(lease),
            )
        return core.leases.renew(lease_id, lease.holder, ttl_s, core.clock.now())

    def _retention(self, lease_id: str, what: str) -> Lease:
        """The live retention `lease_id`; why not, precisely, otherwise."""
        lease = self.core.leases.get(lease_id)  # NOT_FOUND unknown_lease
        if not is_retention(lease):
            raise InvalidArgument(
                f"lease {lease_id} is not a retention (request {shown(lease.request_id)}, reader "
                f"{shown(lease.reader)}); only leases Retain made can be {what}d here"
            )
        if not lease.state.live:
            how = "was released" if lease.state is LeaseState.RELEASED else f"ended ({lease.cause.label})"
            lost = {
                RevokeCause.HOLDER_GONE: " : the holder's session ended, the pin is lost",
                RevokeCause.MEMORY_PRESSURE: " : the holder gave up its GPU pin, vLLM needed the memory",
            }.get(lease.cause, "")
            raise FailedPrecondition(
                f"retention {lease_id} on {shown(lease.holder)} {how}{lost}{': ' + lease.detail if lease.detail else ''}; "
                "retain the conversation again (it may have to be recomputed first)",
                ended_cause(lease),
                about(lease, engine_id=lease.holder),
            )
        return lease

    # -- after the pin, and the end -----------------------------------------------------

    def settled(self, lease: Lease, replaces: str) -> bool:
        """The new retention's pin settled: end the one it replaces if it was pinned. True if ended."""
        if not replaces or not lease.state.live:
            return False
        try:
            self.unretain(replaces)
        except (NotFound, FailedPrecondition):
            return False  # ended meanwhile: nothing to replace
        return True

    def unretain(self, lease_id: str) -> Lease:
        """End a retention now (RELEASED); its holder unpins."""
        self.core.check.ident(lease_id, "lease_id")
        lease = self._retention(lease_id, "unretain")
        if lease.state is LeaseState.PENDING:
            self.core._revoke(lease, RevokeCause.DECLINED, "unretained before the holder pinned it")
            return self.core.leases.get(lease_id)
        return self.core.release(lease_id, "")

"""What an identity may do, beyond its role: stay in its tenant, within quotas.

`TenantGuard` checks each request against the caller's identity before the
servicer sees it, then filters what goes back, so that no prefix, lease,
engine or NIXL agent metadata of one tenant reaches another:

- a namespace's tenant is the caller's: `namespace_tenant` (broker/namespaces.py) is the one
  rule that turns (identity, tenant_id, cache_salt) into a namespace tenant,
  for gRPC and the indexer HTTP API alike;
- a lease, engine or hold of another tenant is refused (PERMISSION_DENIED,
  cause other_tenant) or left out of lists and streams;
- whether a caller is the engine it acts as is broker/security/engine_identity.py's
  one check (cause not_yours), which the servicer makes on every path.
Operators of tenant ``*`` see every tenant. The guard is only installed when
the broker authenticates callers (mutual TLS or tokens).
"""

from __future__ import annotations

from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import NotFound, PermissionDenied
from kvbroker.broker.events import EVENTS_MISSED, HEARTBEAT
from kvbroker.broker.namespaces import ALL_TENANTS, namespace_tenant
from kvbroker.broker.security.engine_identity import EngineIdentity
from kvbroker.broker.security.identity import Identity, Role
from kvbroker.broker.security.quotas import Quotas
from kvbroker.common.causes import Cause
from kvbroker.common.model import Namespace
from kvbroker.v1 import broker_pb2 as pb


def _short(value: str) -> str:
    return value if len(value) <= 80 else value[:77] + "..."


# Session messages that keep an engine's own state true: never refused by a rate quota, since
# refusing them leaves evicted blocks named and live engines looking dead.
HOUSEKEEPING = frozenset({"heartbeat", "inventory", "pin_result", "renew", "release", "decline"})


class TenantGuard:
    def __init__(self, core: BrokerCore, quotas: Quotas, engines: EngineIdentity) -> None:
        self.core = core
        self.quotas = quotas
        self.engines = engines  # who registered each engine id, and its tenant

    # -- who owns what ----------------------------------------------------------------

    def tenant_of_engine(self, engine_id: str) -> str | None:
        return self.engines.tenant_of(engine_id)

    def sees_engine(self, who: Identity, engine_id: str) -> bool:
        return self.engines.sees(who, engine_id)

    def _tenant_engines(self, tenant: str) -> list[str]:
        return self.engines.engines_of(tenant)

    # -- checks -----------------------------------------------------------------------

    def namespace(self, who: Identity, ns: pb.Namespace, what: str) -> None:
        namespace_tenant(who, ns.tenant, what=f"{what}.namespace.tenant:")

    def engine_in_tenant(self, who: Identity, engine_id: str, what: str) -> None:
        if not engine_id or self.sees_engine(who, engine_id):
            return
        raise PermissionDenied(
            f"{who} may not {what} engine {_short(engine_id)!r}: rule 'engines of another tenant are out "
            f"of reach' (or the engine never registered)",
            Cause.OTHER_TENANT,
            {"identity": who.uri, "engine_id": _short(engine_id)},
        )

    def lease_in_tenant(self, who: Identity, lease_id: str, what: str) -> None:
        try:
            lease = self.core.leases.get(lease_id)
        except NotFound:
            return  # the core answers NOT_FOUND itself
        if not who.owns_tenant(lease.namespace.tenant):
            raise PermissionDenied(
                f"{who} may not {what} lease {_short(lease_id)!r}: rule 'leases of another tenant are out "
                f"of reach'",
                Cause.OTHER_TENANT,
                {"identity": who.uri, "lease_id": _short(lease_id)},
            )

    def admit_session(self, who: Identity, engine_id: str) -> None:
        """Registration of `engine_id` by `who`: its tenant's session quota. (Whether `who` may
        register that engine id is engine_identity's check, made by the servicer.)"""
        if self.core.registry.find(engine_id) is None:
            in_tenant = sum(1 for e in self._tenant_engines(who.tenant) if self.core.registry.find(e))
            self.quotas.check_sessions(who, in_tenant)

    def _live_leases(self, tenant: str) -> int:
        return sum(len(self.core.leases.by_holder(e)) for e in self._tenant_engines(tenant))

    def _indexed_blocks(self, tenant: str) -> int:
        return sum(sum(self.core.index.blocks_of(e).values()) for e in self._tenant_engines(tenant))

    def _already_indexed(self, engine_id: str, inv: pb.InventoryUpdate) -> int:
        """How many of `inv.stored`, from the first on, the index already names for this engine and tier
        (a re-announced chain costs nothing; a list that is not a chain counts as new, never less)."""
        ns = Namespace(inv.namespace.layout_id, inv.namespace.tenant)
        for holder, tier, matched in self.core.index.longest_prefixes(ns, inv.stored):
            if holder == engine_id and tier == inv.tier:
                return matched
        return 0

    # -- per request, before the servicer -------------------------------------------------

    def before(self, method: str, who: Identity, request: object) -> None:
        """Raise BrokerError if `who` may not make this request (unary calls and session commands).

        Whether `who` is the engine a request acts as is not checked here but by
        broker/security/engine_identity.py, on every path."""
        if isinstance(request, pb.RegisterRankRequest):
            self.engine_in_tenant(who, request.engine_id, "add a rank to")
        elif isinstance(request, pb.HoldRequest):
            self.namespace(who, request.namespace, "hold")
            self.engine_in_tenant(who, request.reader_engine_id, "name as the reader")
            self.quotas.check_leases(who, self._live_leases(who.tenant))
        elif isinstance(request, pb.AcquireRequest):
            self.lease_in_tenant(who, request.lease_id, "acquire")
            self.quotas.check_leases(who, self._live_leases(who.tenant))
        elif isinstance(request, pb.RenewRequest):
            self.lease_in_tenant(who, request.lease_id, "renew")
        elif isinstance(request, pb.ReleaseRequest):
            self.lease_in_tenant(who, request.lease_id, "release")
        elif isinstance(request, pb.DeclineRequest):
            if request.holder_engine_id and self.tenant_of_engine(request.holder_engine_id) is None:
                raise PermissionDenied(
                    f"{who} may not decline a hold of engine {_short(request.holder_engine_id)!r}: rule "
                    "'a decline names a holder of the caller's tenant' (that engine never registered)",
                    Cause.OTHER_TENANT,
                    {"identity": who.uri, "engine_id": _short(request.holder_engine_id)},
                )
            self.engine_in_tenant(who, request.holder_engine_id, "decline a hold of")
        elif isinstance(request, pb.ResolveRequest):
            self.namespace(who, request.namespace, "resolve")
            if request.acquire:  # a resolve that leases counts against the lease quota like a hold
                self.quotas.check_leases(who, self._live_leases(who.tenant))
        elif isinstance(request, pb.RetainRequest):
            self.namespace(who, request.namespace, "retain")
            for lease_id in (request.lease_id, request.replaces_lease_id):
                if lease_id:
                    self.lease_in_tenant(who, lease_id, "retain")
            self.engine_in_tenant(who, request.engine_id, "retain on")
            if not request.lease_id:  # a new retention is a lease of the tenant, like a hold
                self.quotas.check_leases(who, self._live_leases(who.tenant))
        elif isinstance(request, pb.UnretainRequest):
            self.lease_in_tenant(who, request.lease_id, "unretain")
        elif isinstance(request, pb.ScoreRequest):
            self.namespace(who, request.namespace, "score")
        elif isinstance(request, pb.StatsRequest):
            if who.tenant != ALL_TENANTS:
                raise PermissionDenied(
                    f"{who} may not read Stats: rule 'broker-wide counters are for operators of every "
                    "tenant (kvbroker://*/operator/NAME)'",
                    Cause.OTHER_TENANT,
                    {"identity": who.uri},
                )
        elif isinstance(request, pb.RevokeRequest):
            self.lease_in_tenant(who, request.lease_id, "revoke")
        elif isinstance(request, pb.DrainRequest):
            self.engine_in_tenant(who, request.engine_id, "drain")

    def session_message(self, who: Identity, msg: pb.SessionUp) -> None:
        """A message on `who`'s session stream (after registration): rate, namespaces, leases, quotas.

        Housekeeping (heartbeats, inventory, pin results, renew, release, decline) is never
        refused by a rate quota; the engine's other commands spend its own rate, never its
        tenant's, so a tenant's routers cannot starve its engines."""
        kind = msg.WhichOneof("msg")
        if kind not in HOUSEKEEPING:
            self.quotas.spend(who, tenant=False)
        if kind == "inventory":
            self.namespace(who, msg.inventory.namespace, "inventory")
            stored = len(msg.inventory.stored)
            if stored:
                indexed = self._indexed_blocks(who.tenant)
                limit = self.quotas.config.quota_blocks
                if limit and indexed + stored > limit:  # near the quota: blocks already indexed are not new
                    stored -= self._already_indexed(who.name, msg.inventory)
                self.quotas.check_blocks(who, indexed, stored)
        elif kind in ("resolve", "hold", "acquire", "renew", "release", "decline"):
            self.before(kind, who, getattr(msg, kind))

    # -- what goes back -----------------------------------------------------------------

    def response(self, who: Identity, response: object) -> object:
        """The unary answer as `who` may see it (lists filtered to its tenant, routers without NIXL)."""
        if who.tenant == ALL_TENANTS and who.role == Role.OPERATOR:
            return response
        if isinstance(response, pb.ListEnginesResponse):
            keep = [e for e in response.engines if self.sees_engine(who, e.engine_id)]
            del response.engines[:]
            response.engines.extend(keep)
            if who.role != Role.OPERATOR:
                for engine in response.engines:
                    for rank in engine.ranks:
                        rank.ClearField("agent_metadata")
        elif isinstance(response, pb.ListLeasesResponse):
            keep_leases = [lease for lease in response.leases if who.owns_tenant(lease.namespace.tenant)]
            del response.leases[:]
            response.leases.extend(keep_leases)
        elif isinstance(response, pb.ScoreResponse):
            keep_scores = [s for s in response.scores if self.sees_engine(who, s.engine_id)]
            del response.scores[:]
            response.scores.extend(keep_scores)
        elif isinstance(response, pb.ResolveResponse):
            keep_matches = [m for m in response.matches if self.sees_engine(who, m.engine_id)]
            del response.matches[:]
            response.matches.extend(keep_matches)
            if response.HasField("holder") and not self.sees_engine(who, response.holder.engine_id):
                response.ClearField("holder")  # never another tenant's memory description
        return response

    def stream_item(self, who: Identity, item: object) -> object | None:
        """A Watch event or Mirror update as `who` may see it; None: nothing of it is theirs."""
        if who.tenant == ALL_TENANTS:
            return item
        if isinstance(item, pb.WatchEvent):
            if item.HasField("lease"):
                return item if who.owns_tenant(item.lease.namespace.tenant) else None
            if item.kind in (EVENTS_MISSED, HEARTBEAT):
                return item  # names nobody: every watcher must know its stream has a hole (or lives)
            return item if item.engine_id and self.sees_engine(who, item.engine_id) else None
        if isinstance(item, pb.MirrorUpdate):
            engines = [e for e in item.engines if self.sees_engine(who, e.engine.engine_id)]
            blocks = [
                b
                for b in item.blocks
                if self.sees_engine(who, b.engine_id) and (b.clear_tier or who.owns_tenant(b.tenant))
            ]
            if len(engines) != len(item.engines) or len(blocks) != len(item.blocks):
                if not (engines or blocks or item.reset or item.synced):
                    return None
                out = pb.MirrorUpdate(reset=item.reset, synced=item.synced, engines=engines, blocks=blocks)
                return out
        return item

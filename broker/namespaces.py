"""The tenant of a namespace, from who is calling: the one rule of every surface.

gRPC (broker/servicer.py, broker/security/tenancy.py) and the KV-indexer HTTP
API (broker/indexer/) both turn (identity, tenant_id, cache_salt) into a
namespace tenant here, so no surface has its own idea of a tenant. It lives
at the broker's top level because both wings use it (wings never import each
other); the identity is anything with a tenant, a URI and `owns_tenant`
(broker/security/identity.py's Identity).
"""

from __future__ import annotations

from typing import Protocol

from kvbroker.broker.errors import PermissionDenied
from kvbroker.common.causes import Cause

ALL_TENANTS = "*"  # an operator of every tenant
DEFAULT_TENANT = "default"  # the indexer API's name for the empty tenant (callers without a tenant)


class Tenanted(Protocol):
    """A caller with a tenant (broker/security/identity.py's Identity)."""

    @property
    def tenant(self) -> str: ...

    @property
    def uri(self) -> str: ...

    def owns_tenant(self, tenant: str) -> bool: ...


def namespace_tenant(
    who: Tenanted | None, tenant_id: str, cache_salt: str | None = None, *, what: str = ""
) -> str:
    """The namespace tenant a caller may use: the one rule of every surface (gRPC, indexer HTTP).

    gRPC sends the namespace tenant whole (``TENANT`` or ``TENANT/SALT``, as
    the connector files blocks): `cache_salt` None. The indexer HTTP API sends
    Mooncake's ``tenant_id`` and ``cache_salt`` apart:

    - a caller with a tenant (an identity of tenant T): ``tenant_id`` is T or
      empty, and the namespace is ``T/SALT`` (or ``T``): the salt subdivides
      T and never names another tenant, whatever T is called (``default``
      included);
    - a caller without one (no identities, or an operator of tenant ``*``):
      ``tenant_id`` ``default`` or empty is the empty tenant, whose salted
      namespace is the salt alone (as an adapter without a tenant files it).

    Either way the result must be the caller's (``TENANT`` or ``TENANT/...``),
    else PermissionDenied (other_tenant).
    """
    if cache_salt is None:
        tenant = tenant_id
    elif who is not None and who.tenant != ALL_TENANTS:
        if tenant_id not in ("", who.tenant):
            raise _other_tenant(who, tenant_id, what)
        tenant = f"{who.tenant}/{cache_salt}" if cache_salt else who.tenant
    else:
        base = "" if tenant_id == DEFAULT_TENANT else tenant_id
        tenant = f"{base}/{cache_salt}" if base and cache_salt else base or cache_salt
    if who is not None and not who.owns_tenant(tenant):
        raise _other_tenant(who, tenant, what)
    return tenant


def _other_tenant(who: Tenanted, tenant: str, what: str) -> PermissionDenied:
    return PermissionDenied(
        f"{who} may not use {what or 'the'} namespace tenant {_short(tenant)!r}: rule 'a namespace's tenant "
        f"is the caller's': name {who.tenant!r} or {who.tenant + '/SALT'!r} (an engine: set the "
        f"adapter's tenant key to {who.tenant!r}; a cache_salt subdivides the caller's tenant)",
        Cause.OTHER_TENANT,
        {"identity": who.uri, "tenant": _short(tenant)},
    )


def _short(value: str) -> str:
    return value if len(value) <= 80 else value[:77] + "..."

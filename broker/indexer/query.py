"""The KV-indexer query API of Mooncake's Conductor (as Dynamo's indexer serves it), over our index.

Pure and synchronous: a decoded JSON body in, a JSON-able answer out, or an
`IndexerError` with the HTTP status and a message a person can act on. The
HTTP side (indexer_http.py) adds transport and identity.

``POST /query`` and ``POST /query_by_hash`` answer, per tenant and engine
instance, how many leading tokens of the prompt each holds::

    {"default": {"engine-a": {"longest_matched": 96, "GPU": 96, "CPU": 64, "DISK": 0,
                              "DP": {"0": 96}}}}

- ``GPU`` / ``CPU``: the prefix matched on that tier (our tiers; ``DISK`` is
  always 0: we track no disk tier); ``longest_matched`` the longest of them.
- ``DP``: by data-parallel rank. Each of our engines is one data-parallel
  instance whose every TP/PP rank holds its share of every block, so the one
  rank, ``"0"`` (or the engine's ``dp_rank`` label), has ``longest_matched``.
- Instances are our engine ids of the model (and ``block_size`` when given)
  in the asked tenant; only instances holding at least one block are listed.
  Event-fed engines (broker/indexer/kv_events.py) are listed like the others.
- Token ids are hashed per layout exactly as vLLM hashes them (its chained
  block hashes, ``cache_salt`` in block 0); ``/query_by_hash`` takes those
  hashes in our wire form (``seq_hashes``, or ``block_hash`` as in early drafts).
- Tenancy: ``tenant_id`` plus ``cache_salt`` become the namespace tenant
  through broker/security/tenancy.namespace_tenant, the rule gRPC uses too:
  with identities on, the caller's own tenant (``TENANT/SALT``, the salt never
  naming another tenant); without, ``default`` is our empty tenant and its
  salted namespace is the salt alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import PermissionDenied
from kvbroker.broker.security.identity import ALL_TENANTS, Identity
from kvbroker.broker.security.tenancy import DEFAULT_TENANT, namespace_tenant
from kvbroker.common.hashing import wire_chain
from kvbroker.common.model import Namespace, Tier

MASK64 = (1 << 64) - 1
TOKEN_MAX = (1 << 32) - 1


class IndexerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _text(body: Mapping[str, Any], name: str, *, required: bool = False, limit: int = 256) -> str:
    value = body.get(name)
    if value is None or value == "":
        if required:
            raise IndexerError(400, f"'{name}' is required (a string)")
        return ""
    if not isinstance(value, str):
        raise IndexerError(400, f"'{name}' must be a string, got {type(value).__name__}")
    if len(value.encode()) > limit:
        raise IndexerError(400, f"'{name}' is longer than {limit} bytes")
    return value


def _count(body: Mapping[str, Any], name: str) -> int:
    value = body.get(name)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise IndexerError(400, f"'{name}' must be a positive integer")
    return value


def _ints(body: Mapping[str, Any], name: str, top: int, most: int) -> list[int]:
    values = body.get(name)
    if not isinstance(values, list):
        raise IndexerError(400, f"'{name}' must be a list of integers")
    if len(values) > most:
        raise IndexerError(413, f"'{name}' has {len(values)} entries; the limit is {most}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
            raise IndexerError(400, f"'{name}' must hold integers in [0, {top}]; got {str(v)[:40]!r}")
    return values


def query(
    core: BrokerCore, body: Mapping[str, Any], *, by_hash: bool, who: Identity | None = None
) -> dict[str, Any]:
    """Answer ``/query`` (token ids) or ``/query_by_hash`` (seq_hashes).

    `who`: the caller's identity when the broker authenticates (None: no identities).
    """
    if not isinstance(body, Mapping):
        raise IndexerError(400, "the body must be a JSON object")
    model = _text(body, "model", required=True, limit=core.config.max_text_bytes)
    if _text(body, "lora_name") or body.get("lora_id") not in (None, 0):
        raise IndexerError(
            400, "LoRA adapters are not indexed by this broker; query the base model (no lora_name)"
        )
    asked = _text(body, "tenant_id", limit=core.config.max_id_bytes)
    cache_salt = _text(body, "cache_salt", limit=core.config.max_id_bytes)
    try:
        tenant = namespace_tenant(who, asked, cache_salt, what="the query's")
    except PermissionDenied as err:
        raise IndexerError(403, err.message) from None
    scoped = who is not None and who.tenant != ALL_TENANTS
    tenant_id = asked or (who.tenant if scoped and who is not None else DEFAULT_TENANT)
    instance_id = _text(body, "instance_id", limit=core.config.max_id_bytes)
    block_size = _count(body, "block_size")
    most = core.config.max_hashes
    if by_hash:
        name = "seq_hashes" if "seq_hashes" in body else "block_hash"
        hashes = _ints(body, name, MASK64, most)
        tokens: list[int] = []
    else:
        tokens = _ints(body, "token_ids", TOKEN_MAX, most * max(block_size, 1))
        hashes = []
    layouts: dict[str, tuple[int, str]] = {}  # layout id -> (block size, hash algo)
    for rec in core.registry.all():
        fp = rec.info.layout
        if fp.model != model or (block_size and fp.block_size != block_size):
            continue
        if instance_id and rec.engine_id != instance_id:
            continue
        layouts[rec.layout_id] = (fp.block_size, fp.hash_algo or "sha256")
    instances: dict[str, dict[str, Any]] = {}
    for lid, (size, algo) in layouts.items():
        chain = (
            hashes if by_hash else wire_chain(tokens[: most * size], size, algo, cache_salt=tenant or None)
        )
        for engine_id, tier, matched in core.index.longest_prefixes(Namespace(lid, tenant), chain):
            holder = core.registry.find(engine_id)
            if holder is None or (instance_id and engine_id != instance_id):
                continue
            entry = instances.setdefault(engine_id, _empty(holder.info.labels.get("dp_rank", "0")))
            entry["GPU" if tier is Tier.GPU else "CPU"] = matched * size
    for entry in instances.values():
        longest = max(entry["GPU"], entry["CPU"], entry["DISK"])
        entry["longest_matched"] = longest
        entry["DP"] = dict.fromkeys(entry["DP"], longest)
    return {tenant_id: instances}


def _empty(dp_rank: str) -> dict[str, Any]:
    return {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {dp_rank: 0}}

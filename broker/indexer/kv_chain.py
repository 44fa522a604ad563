"""vLLM's KV cache events, turned into our index keys.

An engine started with ``--kv-events-config`` publishes, per scheduler step, a
batch of events: ``BlockStored`` (block hashes, the parent's hash, the blocks'
token ids, the medium), ``BlockRemoved`` (hashes, medium) and
``AllBlocksCleared``. The hashes it publishes are not ours: by default vLLM
sends the LAST 8 bytes of each block's digest as an int
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), or the whole digest as bytes,
while our index keys a block by the FIRST 8 bytes (common/hashing.to_wire).
Neither can be turned into the other, so `BlockChain` recomputes each block's
digest from the token ids the event carries and its parent's digest (remembered
from the parent's own event), checks that the result is the hash vLLM
published, and only then indexes its wire form. A block whose digest does not
check out (another hash algorithm, another ``PYTHONHASHSEED``, a LoRA or
multi-modal request) or whose parent we never saw is skipped and counted,
never indexed under a wrong key.

Pure and synchronous: the feed (broker/indexer/kv_events.py) gives it decoded events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbroker.common.hashing import hash_block, none_hash, to_wire
from kvbroker.common.model import Tier

MASK64 = (1 << 64) - 1


def tier_of(medium: object) -> Tier:
    """vLLM's medium ("GPU", "CPU", None) as our tier; anything host-side is the CPU tier."""
    return Tier.CPU if isinstance(medium, str) and medium.upper().startswith("CPU") else Tier.GPU


def external_form(digest: bytes, like: object) -> object:
    """The digest as vLLM publishes it: the whole bytes, or the low 64 bits as an int."""
    if isinstance(like, bytes):
        return digest
    return int.from_bytes(digest, "big") & MASK64


@dataclass
class ChainStats:
    stored: int = 0  # blocks indexed
    removed: int = 0
    cleared: int = 0
    unknown_parent: int = 0  # blocks whose parent we never saw (missed events)
    mismatched: int = 0  # blocks whose recomputed digest is not the published hash
    unsupported: int = 0  # LoRA, multi-modal or other extra keys we cannot reproduce
    unowned_salt: int = 0  # salted blocks of a feed without a tenant, on a broker with identities

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(slots=True)
class _Known:
    digest: bytes
    tenant: str
    tiers: set[Tier] = field(default_factory=set)


class BlockChain:
    """The digests of one engine's published blocks, by the hash vLLM published for each.

    `tenant` is the namespace tenant of unsalted blocks; a block salted with
    ``cache_salt`` S goes to ``TENANT/S``, as our connector files them. With
    no tenant, S alone would be the namespace, and a salt can name any
    tenant: that is filed only with `bare_salts` (a broker without
    identities, where the salt is the tenant, as the proxy's tenant keys set
    it); otherwise such blocks are skipped and counted (``unowned_salt``), so
    a publisher never files blocks into a tenant it does not belong to.
    """

    def __init__(
        self, hash_algo: str = "sha256", tenant: str = "", seed: str | None = None, *, bare_salts: bool = True
    ) -> None:
        self.hash_algo = hash_algo
        self.tenant = tenant
        self.bare_salts = bare_salts
        self._root = none_hash(hash_algo, seed)
        self._known: dict[object, _Known] = {}
        self.stats = ChainStats()

    def __len__(self) -> int:
        return len(self._known)

    def _salted(self, salt: str) -> str:
        if not salt:
            return self.tenant
        return f"{self.tenant}/{salt}" if self.tenant else salt

    @staticmethod
    def _key(h: object) -> object:
        return bytes(h) if isinstance(h, bytes | bytearray) else h

    def stored(self, event: Mapping[str, Any]) -> list[tuple[Tier, str, list[int]]]:
        """A BlockStored event: what to index, as (tier, namespace tenant, wire hashes) groups."""
        hashes = list(event.get("block_hashes") or ())
        tokens = list(event.get("token_ids") or ())
        block_size = int(event.get("block_size") or 0)
        tier = tier_of(event.get("medium"))
        if not hashes:
            return []
        if event.get("lora_name") or event.get("lora_id") or block_size <= 0:
            self.stats.unsupported += len(hashes)
            return []
        if len(tokens) < len(hashes) * block_size:
            self.stats.unsupported += len(hashes)
            return []
        extras = event.get("extra_keys") or [None] * len(hashes)
        parent_hash = event.get("parent_block_hash")
        if parent_hash is None:
            parent: bytes | None = None
            tenant = self.tenant
        else:
            known = self._known.get(self._key(parent_hash))
            if known is None:
                self.stats.unknown_parent += len(hashes)
                return []
            parent, tenant = known.digest, known.tenant
        groups: dict[str, list[int]] = {}
        for i, published in enumerate(hashes):
            keys = extras[i] if i < len(extras) else None
            tagged: tuple[Any, ...] | None = None
            if keys:
                # Untagged in events; the only one we can reproduce is block 0's cache_salt.
                if parent is None and len(keys) == 1 and isinstance(keys[0], str):
                    if not self.tenant and not self.bare_salts:
                        self.stats.unowned_salt += len(hashes) - i
                        break
                    tagged = (("cache_salt", keys[0]),)
                    tenant = self._salted(keys[0])
                else:
                    self.stats.unsupported += len(hashes) - i
                    break
            block = tokens[i * block_size : (i + 1) * block_size]
            digest = hash_block(self.hash_algo, self._root if parent is None else parent, block, tagged)
            if external_form(digest, published) != self._key(published):
                self.stats.mismatched += len(hashes) - i
                break
            known = self._known.get(self._key(published))
            if known is None:
                known = self._known[self._key(published)] = _Known(digest, tenant)
            if tier not in known.tiers:
                known.tiers.add(tier)
                groups.setdefault(tenant, []).append(to_wire(digest))
                self.stats.stored += 1
            parent = digest
        return [(tier, t, wire) for t, wire in groups.items()]

    def removed(self, event: Mapping[str, Any]) -> list[tuple[Tier, str, list[int]]]:
        """A BlockRemoved event: what to take out of the index."""
        tier = tier_of(event.get("medium"))
        groups: dict[str, list[int]] = {}
        for published in event.get("block_hashes") or ():
            key = self._key(published)
            known = self._known.get(key)
            if known is None or tier not in known.tiers:
                continue
            known.tiers.discard(tier)
            if not known.tiers:
                del self._known[key]
            groups.setdefault(known.tenant, []).append(to_wire(known.digest))
            self.stats.removed += 1
        return [(tier, t, wire) for t, wire in groups.items()]

    def clear(self) -> None:
        """AllBlocksCleared, or a lost publisher: nothing is known any more."""
        self._known.clear()
        self.stats.cleared += 1


def event_fields(event: object) -> Mapping[str, Any] | None:
    """An event as a mapping with "type" (vLLM encodes its tagged structs as maps)."""
    if isinstance(event, Mapping):
        return event
    # An array-like encoding: [tag, field, ...] in BlockStored / BlockRemoved order.
    if isinstance(event, Sequence) and event and isinstance(event[0], str):
        names = {
            "BlockStored": (
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
            ),
            "BlockRemoved": ("block_hashes", "medium"),
            "AllBlocksCleared": (),
        }.get(event[0])
        if names is None:
            return None
        return {"type": event[0], **dict(zip(names, event[1:], strict=False))}
    return None

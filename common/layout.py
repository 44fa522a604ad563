"""Layout ids and the topology check: which engines may read each other's KV blocks.

Pure functions over the proto messages, shared by the broker and the clients.

- `layout_id` covers what must be equal for a block to mean the same bytes
  (model, dtype, block size, layer count, KV heads, head size, hash algorithm,
  kv_layout, and, when stated, the engine's version and kvbroker's
  engine-to-engine block format `KV_PROTOCOL_VERSION`). TP and PP sizes are
  left out: topology is checked separately.
- `check_topology` requires equal TP (a reader rank reads its own head
  shard) and lets PP differ (a reader gathers each layer from the holder rank
  whose layer range owns it), as long as the holder's ranks cover every layer.
"""

from __future__ import annotations

import hashlib
import json

from kvbroker.v1 import broker_pb2 as pb

DEFAULT_HASH_ALGO = "sha256"
LAYOUT_ID_LEN = 16

# kvbroker's engine-to-engine block format, part of the layout identity. Raise
# it whenever a reader of the old format would misread a holder of the new one.
#   1: per-layer MemoryRegions (base_addr + block * block_stride), one NIXL agent
#      per (pp_rank, tp_rank), tiers GPU and CPU with their own regions.
KV_PROTOCOL_VERSION = 1

# Fields added to the fingerprint after layout ids were first issued: part of
# the id only when set, so an engine that does not state them keeps its id.
_OPTIONAL_FIELDS = ("engine_version", "kv_protocol")


def layout_id(fp: pb.LayoutFingerprint) -> str:
    """A deterministic short id (16 hex chars) over the read-compatibility fields of `fp`."""
    fields = {
        "model": fp.model,
        "dtype": fp.dtype,
        "block_size": fp.block_size,
        "num_layers": fp.num_layers,
        "num_kv_heads": fp.num_kv_heads,
        "head_size": fp.head_size,
        "hash_algo": fp.hash_algo or DEFAULT_HASH_ALGO,
        "kv_layout": fp.kv_layout,
    }
    for name in _OPTIONAL_FIELDS:
        if getattr(fp, name):
            fields[name] = getattr(fp, name)
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()[:LAYOUT_ID_LEN]


def layout_difference(a: pb.LayoutFingerprint, b: pb.LayoutFingerprint) -> str:
    """Which identity fields differ, e.g. "engine_version 'vllm 0.32.0' vs 'vllm 0.33.0'"."""
    names: tuple[str, ...] = (
        "model",
        "dtype",
        "block_size",
        "num_layers",
        "num_kv_heads",
        "head_size",
        "hash_algo",
        "kv_layout",
    )
    names += _OPTIONAL_FIELDS
    diffs = [f"{n} {getattr(a, n)!r} vs {getattr(b, n)!r}" for n in names if getattr(a, n) != getattr(b, n)]
    return "; ".join(diffs) or "same fields"


def check_topology(reader: pb.EngineInfo, holder: pb.EngineInfo) -> str | None:
    """None if `reader` can read `holder`'s blocks, else a reason a person can act on."""
    rl, hl = reader.layout, holder.layout
    if layout_id(rl) != layout_id(hl):
        return (
            f"layouts differ: reader {reader.engine_id!r} has layout {layout_id(rl)}, "
            f"holder {holder.engine_id!r} has {layout_id(hl)} ({layout_difference(rl, hl)})"
        )
    reader_tp, holder_tp = rl.tp_size or 1, hl.tp_size or 1
    if reader_tp != holder_tp:
        return f"tensor-parallel sizes differ: reader tp_size={reader_tp}, holder tp_size={holder_tp} (must be equal)"
    if not holder.ranks:
        return None  # no rank details registered yet: nothing more to check
    num_layers = hl.num_layers
    for tp_rank in range(holder_tp):
        covered = sorted(
            (r.start_layer, r.end_layer)
            for r in holder.ranks
            if r.tp_rank == tp_rank and r.end_layer > r.start_layer
        )
        upto = 0
        for start, end in covered:
            if start > upto:
                break
            upto = max(upto, end)
        if upto < num_layers:
            return (
                f"holder {holder.engine_id!r} tp_rank {tp_rank} has registered layers [0, {upto}) "
                f"of {num_layers}; waiting for its other pipeline ranks"
            )
    return None

"""Which holder rank serves which of this rank's layers (TP/PP mapping).

A KV block of one layer on one TP rank holds that rank's share of KV heads,
so a reader rank can only read from the holder rank with the same tp_rank
(equal TP sizes). Pipeline stages may differ: the reader gathers each of its
layers from whichever holder stage owns it. Anything else is refused with a
message that says why, never guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbroker.engine_adapter.metadata import HolderRank


class TopologyError(ValueError):
    """The holder's ranks cannot supply this rank's layers."""


@dataclass(frozen=True)
class LayerRead:
    holder: HolderRank
    layers: range


def check_sizes(*, reader_tp: int, holder_tp: int, reader_pp: int, holder_pp: int) -> str | None:
    """None when a reader with these sizes can read from the holder, else why not."""
    if reader_tp != holder_tp:
        return (
            f"tensor-parallel sizes differ (reader tp={reader_tp}, holder tp={holder_tp}); "
            "KV heads are split differently, so blocks cannot be read rank to rank"
        )
    if reader_pp < 1 or holder_pp < 1:
        return f"invalid pipeline-parallel sizes (reader pp={reader_pp}, holder pp={holder_pp})"
    return None


def plan_layer_reads(
    *, tp_rank: int, local_layers: range, holder_ranks: Sequence[HolderRank]
) -> list[LayerRead]:
    """For each local layer, the holder rank (same tp_rank) whose layer range owns it."""
    if len(local_layers) == 0:
        return []
    same_tp = sorted((r for r in holder_ranks if r.tp_rank == tp_rank), key=lambda r: r.start_layer)
    if not same_tp:
        raise TopologyError(f"holder has no rank with tp_rank={tp_rank}")
    reads: list[LayerRead] = []
    next_layer = local_layers.start
    for rank in same_tp:
        if rank.end_layer <= rank.start_layer:
            raise TopologyError(
                f"holder rank pp={rank.pp_rank} tp={rank.tp_rank} has an empty layer range "
                f"[{rank.start_layer}, {rank.end_layer})"
            )
        lo = max(rank.start_layer, next_layer)
        hi = min(rank.end_layer, local_layers.stop)
        if lo >= hi:
            continue
        if lo != next_layer:
            break
        layers_with_regions = {region.layer for region in rank.regions}
        missing = [layer for layer in range(lo, hi) if layer not in layers_with_regions]
        if missing:
            raise TopologyError(
                f"holder rank pp={rank.pp_rank} tp={rank.tp_rank} claims layers [{rank.start_layer}, "
                f"{rank.end_layer}) but registered no memory region for layer(s) {missing}"
            )
        reads.append(LayerRead(rank, range(lo, hi)))
        next_layer = hi
        if next_layer >= local_layers.stop:
            return reads
    raise TopologyError(
        f"no holder rank with tp_rank={tp_rank} owns layer {next_layer} "
        f"(needed layers [{local_layers.start}, {local_layers.stop}); holder ranks cover "
        f"{[(r.start_layer, r.end_layer) for r in same_tp]})"
    )

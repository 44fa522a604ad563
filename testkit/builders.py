"""What an engine registers with: a layout fingerprint and an EngineInfo, with the tests' defaults."""

from __future__ import annotations

from collections.abc import Mapping

from kvbroker.v1 import broker_pb2 as pb

# The tiny model the tests describe: two layers, two KV heads of 16, fp32, 32-token blocks.
LAYOUT: dict[str, object] = dict(
    model="tiny-llama",
    dtype="float32",
    block_size=32,
    num_layers=2,
    num_kv_heads=2,
    head_size=16,
    tp_size=1,
    pp_size=1,
    hash_algo="sha256",
)


def fingerprint(**overrides: object) -> pb.LayoutFingerprint:
    """`LAYOUT` with `overrides` (any LayoutFingerprint field)."""
    return pb.LayoutFingerprint(**{**LAYOUT, **overrides})  # type: ignore[arg-type]


def engine_info(
    engine_id: str,
    *,
    ranks: int | None = None,
    agent_name: str = "{engine_id}-tp{tp}",
    agent_metadata: bytes = b"meta",
    num_blocks: int = 1024,
    labels: Mapping[str, str] | None = None,
    **layout: object,
) -> pb.EngineInfo:
    """An engine on `fingerprint(**layout)` with one GPU tier per rank.

    `ranks`: how many TP ranks to describe (pipeline stage 0, every layer); None
    means one per `tp_size`, 0 none. `agent_name` is formatted with `engine_id`
    and `tp`. `labels` defaults to {"role": "test"}.
    """
    fp = fingerprint(**layout)
    info = pb.EngineInfo(
        engine_id=engine_id, layout=fp, labels=dict(labels) if labels is not None else {"role": "test"}
    )
    count = (fp.tp_size or 1) if ranks is None else ranks
    for tp in range(count):
        info.ranks.append(
            pb.RankInfo(
                pp_rank=0,
                tp_rank=tp,
                agent_name=agent_name.format(engine_id=engine_id, tp=tp),
                agent_metadata=agent_metadata,
                start_layer=0,
                end_layer=fp.num_layers,
                tiers=[pb.TierInfo(tier=pb.TIER_GPU, mem_type="DRAM", num_blocks=num_blocks)],
            )
        )
    return info

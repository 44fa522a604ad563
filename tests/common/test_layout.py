"""kvbroker.common.layout: what makes two engines' blocks the same bytes, and who may read whom."""

from __future__ import annotations

from kvbroker.common.layout import KV_PROTOCOL_VERSION, check_topology, layout_id
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info, fingerprint


def test_layout_id_is_deterministic_and_short() -> None:
    assert layout_id(fingerprint()) == layout_id(fingerprint())
    assert len(layout_id(fingerprint())) == 16
    assert int(layout_id(fingerprint()), 16) >= 0


def test_every_identity_field_changes_the_id() -> None:
    base = layout_id(fingerprint())
    changed = dict(
        model="other",
        dtype="bfloat16",
        block_size=64,
        num_layers=4,
        num_kv_heads=4,
        head_size=64,
        hash_algo="sha256_cbor",
        kv_layout="kv_cache_dtype=fp8",
        engine_version="vllm 0.33.0",
        kv_protocol=KV_PROTOCOL_VERSION + 1,
    )
    for name, value in changed.items():
        assert layout_id(fingerprint(**{name: value})) != base, name


def test_parallel_sizes_are_not_part_of_the_id() -> None:
    assert layout_id(fingerprint(tp_size=2, pp_size=2)) == layout_id(fingerprint())


def test_unstated_versions_keep_the_id_engines_had_before_they_were_added() -> None:
    """An engine that does not state engine_version / kv_protocol keeps the id it always had."""
    assert layout_id(fingerprint()) == layout_id(fingerprint(engine_version="", kv_protocol=0))
    assert layout_id(fingerprint(engine_version="vllm 0.32.0")) != layout_id(fingerprint())


def test_engines_of_different_vllm_versions_do_not_read_each_other() -> None:
    reader = engine_info("R", engine_version="vllm 0.32.0", kv_protocol=KV_PROTOCOL_VERSION)
    holder = engine_info("H", engine_version="vllm 0.33.0", kv_protocol=KV_PROTOCOL_VERSION)
    reason = check_topology(reader, holder)
    assert reason is not None
    assert "engine_version 'vllm 0.32.0' vs 'vllm 0.33.0'" in reason
    same = engine_info("H2", engine_version="vllm 0.32.0", kv_protocol=KV_PROTOCOL_VERSION)
    assert check_topology(reader, same) is None


def test_topology_needs_equal_tp_and_lets_pp_differ() -> None:
    reason = check_topology(engine_info("R", tp_size=1), engine_info("H", tp_size=2))
    assert reason is not None and "tp_size=1" in reason and "tp_size=2" in reason
    holder = engine_info("H", pp_size=2, ranks=False)
    for pp_rank, (start, end) in enumerate([(0, 1), (1, 2)]):
        holder.ranks.append(pb.RankInfo(pp_rank=pp_rank, tp_rank=0, start_layer=start, end_layer=end))
    assert check_topology(engine_info("R"), holder) is None


def test_a_holder_missing_a_pipeline_rank_is_not_read_yet() -> None:
    holder = engine_info("H", pp_size=2, ranks=False)
    holder.ranks.append(pb.RankInfo(pp_rank=0, tp_rank=0, start_layer=0, end_layer=1))
    reason = check_topology(engine_info("R"), holder)
    assert reason is not None and "[0, 1) of 2" in reason

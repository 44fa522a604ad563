"""Worker-side load protocol with a fake NIXL mover, and the TP/PP layer mapping."""

from __future__ import annotations

import pytest

from kvbroker.engine_adapter.broker_link import NewGeneration
from kvbroker.engine_adapter.metadata import AdapterMetadata, Commit, HolderRank, LoadSpec, RegionSpec
from kvbroker.engine_adapter.topology import TopologyError, check_sizes, plan_layer_reads
from kvbroker.engine_adapter.worker import AdapterWorker
from kvbroker.v1 import broker_pb2 as pb
from tests.engine_adapter.fakes import FakeMover


def rank(pp: int, tp: int, start: int, end: int, regions: range | None = None) -> HolderRank:
    layers = range(start, end) if regions is None else regions
    return HolderRank(
        pp_rank=pp,
        tp_rank=tp,
        agent_name=f"h-pp{pp}-tp{tp}",
        agent_metadata=b"m",
        start_layer=start,
        end_layer=end,
        regions=tuple(RegionSpec(layer, 1000 * layer, 64, 64) for layer in layers),
    )


class LocalRegion:
    def __init__(self, layer: int) -> None:
        self.layer, self.base_addr, self.block_stride, self.block_bytes, self.device_id = layer, 0, 64, 64, 0


def make_worker(layers: range = range(0, 4), registrar=None):  # type: ignore[no-untyped-def]
    movers: list[FakeMover] = []

    def factory(name: str) -> FakeMover:
        movers.append(FakeMover(name))
        return movers[-1]

    worker = AdapterWorker(
        engine_id="d",
        pp_rank=0,
        tp_rank=0,
        mover_factory=factory,
        region_factory=lambda spec: spec,
        rank_registrar=registrar,
    )
    worker.register_memory([LocalRegion(layer) for layer in layers], 50, "DRAM")
    return worker, movers[0]


def spec(req: str = "r1", ranks: tuple[HolderRank, ...] = (rank(0, 0, 0, 4),)) -> LoadSpec:
    return LoadSpec(
        request_id=req,
        lease_id="l1",
        holder_engine_id="h",
        tier=pb.TIER_GPU,
        remote_block_ids=(100, 101),
        local_block_ids=(7, 8),
        holder_ranks=ranks,
    )


# --- layer mapping ---------------------------------------------------------


def test_same_topology_reads_all_layers_from_the_matching_rank() -> None:
    reads = plan_layer_reads(
        tp_rank=1, local_layers=range(0, 4), holder_ranks=[rank(0, 0, 0, 4), rank(0, 1, 0, 4)]
    )
    assert [(r.holder.agent_name, r.layers) for r in reads] == [("h-pp0-tp1", range(0, 4))]


def test_reader_gathers_layers_from_each_pipeline_stage() -> None:
    holder = [rank(1, 0, 2, 4), rank(0, 0, 0, 2)]
    reads = plan_layer_reads(tp_rank=0, local_layers=range(0, 4), holder_ranks=holder)
    assert [(r.holder.pp_rank, r.layers) for r in reads] == [(0, range(0, 2)), (1, range(2, 4))]
    # A PP reader stage takes only its own layers.
    reads = plan_layer_reads(tp_rank=0, local_layers=range(1, 3), holder_ranks=holder)
    assert [(r.holder.pp_rank, r.layers) for r in reads] == [(0, range(1, 2)), (1, range(2, 3))]


def test_unmappable_layouts_are_refused_clearly() -> None:
    with pytest.raises(TopologyError, match="no rank with tp_rank=1"):
        plan_layer_reads(tp_rank=1, local_layers=range(0, 4), holder_ranks=[rank(0, 0, 0, 4)])
    with pytest.raises(TopologyError, match="owns layer 2"):
        plan_layer_reads(tp_rank=0, local_layers=range(0, 4), holder_ranks=[rank(0, 0, 0, 2)])
    with pytest.raises(TopologyError, match="no memory region for layer"):
        plan_layer_reads(
            tp_rank=0, local_layers=range(0, 4), holder_ranks=[rank(0, 0, 0, 4, regions=range(0, 3))]
        )
    assert check_sizes(reader_tp=2, holder_tp=1, reader_pp=1, holder_pp=1) is not None
    assert check_sizes(reader_tp=2, holder_tp=2, reader_pp=1, holder_pp=2) is None


# --- worker protocol -------------------------------------------------------


def test_read_then_commit_reports_loaded() -> None:
    worker, mover = make_worker()
    worker.start_load_kv(AdapterMetadata(loads=[spec()]))
    read = mover.reads[1]
    assert read["peer"] == "h-pp0-tp0" and read["remote"] == [100, 101] and read["local"] == [7, 8]
    assert read["layers"] == range(0, 4)
    assert mover.peers == {"h-pp0-tp0": b"m"}
    assert worker.get_finished(set()) == (None, None), "not loaded before the commit"
    outcomes = worker.take_outcomes()
    assert outcomes is not None and outcomes.done == {"r1": 1} and outcomes.failed == {}
    assert outcomes.bytes_read["r1"] == 4 * 64 * 2
    worker.start_load_kv(AdapterMetadata(commits=[Commit("r1", True, (7, 8))]))
    assert worker.get_finished(set()) == (None, {"r1"})
    assert worker.take_load_errors() == set()


def test_uncommitted_read_becomes_load_errors() -> None:
    worker, _ = make_worker()
    worker.start_load_kv(AdapterMetadata(loads=[spec()]))
    worker.get_finished(set())
    worker.start_load_kv(AdapterMetadata(commits=[Commit("r1", False, (7, 8), "lease revoked")]))
    assert worker.get_finished(set()) == (None, {"r1"})
    assert worker.take_load_errors() == {7, 8}


def test_dead_peer_is_a_failed_outcome() -> None:
    worker, mover = make_worker()
    mover.fail_peers.add("h-pp0-tp0")
    worker.start_load_kv(AdapterMetadata(loads=[spec()]))
    worker.get_finished(set())
    outcomes = worker.take_outcomes()
    assert outcomes is not None and "peer gone" in outcomes.failed["r1"]


def test_unmappable_holder_fails_without_reading() -> None:
    worker, mover = make_worker()
    worker.start_load_kv(AdapterMetadata(loads=[spec(ranks=(rank(0, 0, 0, 2),))]))
    worker.get_finished(set())
    outcomes = worker.take_outcomes()
    assert outcomes is not None and "unmappable" in outcomes.failed["r1"]
    assert mover.reads == {}


def test_commit_waits_for_reads_still_writing_the_blocks() -> None:
    worker, mover = make_worker()
    mover.polls_to_finish = 2
    worker.start_load_kv(AdapterMetadata(loads=[spec()], commits=[Commit("r1", False, (7, 8))]))
    assert worker.get_finished(set()) == (None, None)
    assert worker.get_finished(set()) == (None, {"r1"})


def test_free_is_reported_only_for_requests_vllm_finished() -> None:
    worker, _ = make_worker()
    worker.start_load_kv(AdapterMetadata(frees=["p1"]))
    assert worker.get_finished(set()) == (None, None)
    assert worker.get_finished({"p1"}) == ({"p1"}, None)
    assert worker.get_finished(set()) == (None, None)


def test_rank_is_published_to_the_broker_with_retries() -> None:
    import threading

    calls: list[pb.RankInfo] = []
    done = threading.Event()

    def registrar(info: pb.RankInfo) -> None:
        calls.append(info)
        if len(calls) < 2:
            raise ConnectionError("broker not up yet")
        done.set()

    worker, _ = make_worker(registrar=registrar)
    assert done.wait(5.0)
    info = calls[-1]
    assert (info.start_layer, info.end_layer, info.agent_name) == (0, 4, "d-pp0-tp0")
    assert info.tiers[0].num_blocks == 50 and len(info.tiers[0].regions) == 4
    worker.shutdown()


def test_wrong_metadata_version_is_refused() -> None:
    worker, _ = make_worker()
    with pytest.raises(RuntimeError, match="version"):
        worker.start_load_kv(AdapterMetadata(version=999))


# --- a replaced holder (engine restarted under the same id) ----------------


def generation_spec(req: str, generation: int, metadata: bytes) -> LoadSpec:
    holder = HolderRank(0, 0, "h-pp0-tp0", metadata, 0, 4, tuple(RegionSpec(x, 0, 64, 64) for x in range(4)))
    return LoadSpec(req, "l-" + req, "h", pb.TIER_GPU, (100,), (7,), (holder,), holder_generation=generation)


def test_a_newer_generation_drops_the_old_agent_before_loading_the_new_one() -> None:
    worker, mover = make_worker()
    worker.start_load_kv(AdapterMetadata(loads=[generation_spec("r1", 5, b"old")]))
    worker.start_load_kv(AdapterMetadata(loads=[generation_spec("r2", 9, b"new")]))
    assert mover.peer_log == [
        ("add", "h-pp0-tp0", b"old"),
        ("remove", "h-pp0-tp0", b""),
        ("add", "h-pp0-tp0", b"new"),
    ]
    assert [r["peer"] for r in mover.reads.values()] == ["h-pp0-tp0", "h-pp0-tp0"]
    worker.get_finished(set())
    outcomes = worker.take_outcomes()
    assert outcomes is not None and outcomes.peers_replaced == 1 and outcomes.stale_refused == 0
    assert outcomes.done == {"r1": 1, "r2": 1}


def test_a_load_planned_against_the_replaced_engine_is_refused_not_read() -> None:
    """A lease granted just before the holder restarted reaches the worker after the new
    agent was loaded: no read starts, the old agent is not put back, the blocks recompute."""
    worker, mover = make_worker()
    worker.start_load_kv(AdapterMetadata(loads=[generation_spec("new", 9, b"new")]))
    reads_before = len(mover.reads)
    worker.start_load_kv(AdapterMetadata(loads=[generation_spec("stale", 5, b"old")]))
    assert len(mover.reads) == reads_before, "a read was issued against the replaced agent"
    assert mover.peers == {"h-pp0-tp0": b"new"}
    worker.get_finished(set())
    outcomes = worker.take_outcomes()
    assert outcomes is not None and "was replaced" in outcomes.failed["stale"]
    assert outcomes.stale_refused == 1 and "new" not in outcomes.failed
    # The new generation keeps reading from the agent it loaded, without loading it again.
    worker.start_load_kv(AdapterMetadata(loads=[generation_spec("again", 9, b"new")]))
    assert mover.peer_log.count(("add", "h-pp0-tp0", b"new")) == 1


def test_the_brokers_word_drops_the_old_agent_at_once_and_no_read_goes_to_it() -> None:
    """SessionDown.engine_generation, handed over in a step's metadata: the agent of the older
    generation goes before that step's loads, without waiting for a lease on the new one, and a
    load planned against the old engine is refused though nothing of it is loaded any more."""
    worker, mover = make_worker()
    worker.start_load_kv(AdapterMetadata(loads=[generation_spec("r1", 5, b"old")]))
    worker.get_finished(set())
    worker.take_outcomes()
    worker.start_load_kv(AdapterMetadata(generations=[NewGeneration("h", 9), NewGeneration("other", 3)]))
    assert mover.peers == {} and mover.peer_log[-1] == ("remove", "h-pp0-tp0", b"")
    worker.get_finished(set())
    dropped = worker.take_outcomes()  # a step with no read still tells the scheduler (its stats)
    assert dropped is not None and dropped.peers_replaced == 1 and not dropped.done
    reads_before = len(mover.reads)
    worker.start_load_kv(
        AdapterMetadata(generations=[NewGeneration("h", 9)], loads=[generation_spec("stale", 5, b"old")])
    )
    assert len(mover.reads) == reads_before, "a read was issued against the replaced agent"
    assert mover.peers == {}, "the old agent was put back"
    worker.get_finished(set())
    outcomes = worker.take_outcomes()
    assert outcomes is not None and "was replaced" in outcomes.failed["stale"]
    assert outcomes.peers_replaced == 0 and outcomes.stale_refused == 1
    worker.start_load_kv(AdapterMetadata(loads=[generation_spec("new", 9, b"new")]))
    assert mover.peers == {"h-pp0-tp0": b"new"} and len(mover.reads) == reads_before + 1


def test_without_generations_new_metadata_replaces_the_agent() -> None:
    worker, mover = make_worker()
    worker.start_load_kv(AdapterMetadata(loads=[generation_spec("r1", 0, b"a")]))
    worker.start_load_kv(AdapterMetadata(loads=[generation_spec("r2", 0, b"a")]))
    worker.start_load_kv(AdapterMetadata(loads=[generation_spec("r3", 0, b"b")]))
    assert [e for e in mover.peer_log if e[0] == "add"] == [
        ("add", "h-pp0-tp0", b"a"),
        ("add", "h-pp0-tp0", b"b"),
    ]
    assert len(mover.reads) == 3


def test_a_peers_first_read_is_not_printed_as_a_bandwidth(caplog: pytest.LogCaptureFixture) -> None:
    """The first read from a peer pays NIXL's connection set-up: its line says so, not "0.025 GB/s"."""
    import logging

    from kvbroker.tools.demo import _READ_LINE

    worker, _mover = make_worker()
    log = logging.getLogger("vllm.kvbroker.worker")
    log.addHandler(caplog.handler)  # vLLM's loggers may not propagate to the root
    try:
        with caplog.at_level(logging.INFO, logger="vllm.kvbroker.worker"):
            worker.start_load_kv(AdapterMetadata(loads=[spec("r1")]))
            worker.get_finished(set())
            worker.start_load_kv(AdapterMetadata(loads=[spec("r2")]))
            worker.get_finished(set())
    finally:
        log.removeHandler(caplog.handler)
    lines = {m["req"]: m.groupdict() for m in _READ_LINE.finditer(caplog.text)}  # once each, however captured
    first, second = lines["r1"], lines["r2"]
    assert first["req"] == "r1" and first["gbps"] is None and first["first"]
    assert second["req"] == "r2" and float(second["gbps"]) >= 0 and second["first"] is None

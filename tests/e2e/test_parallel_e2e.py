"""Tensor- and pipeline-parallel pulls end to end: one real broker process and
five real multi-rank vLLM engines (CPU build, tiny random model, float32) with
BrokerConnector, real NIXL over UCX moving each rank's share of every block.

    S        TP=1 PP=1   the single-engine reference, and the odd-sized reader
    T1, T2   TP=2        KV heads split across two ranks
    Q1, Q2   PP=2        layers [0, 1) on stage 0, [1, 2) on stage 1

A holder prefills with ``do_remote_decode``; the reader gets the returned
kv_transfer_params, pulls the full blocks rank by rank (each reader rank reads
its layers from the holder rank that owns them, same tp_rank) and decodes. Its
greedy output must equal S computing the prompt itself under a fresh
cache_salt (a namespace nobody holds). Equal TP with any PP sizes works; TP
sizes that differ are refused (the heads are split differently) and the
request is recomputed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvbroker.clients.sync import BrokerClient
from kvbroker.tools.launch import PIPELINE_PARALLEL_CPU_ARGS, EngineProcess, connector_config
from kvbroker.v1 import broker_pb2 as pb
from testkit.engines import (
    BLOCK_SIZE,
    complete,
    output_ids,
    prompt_of,
    read_stats,
    recompute_reference,
)
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 6
# Small per rank: nine worker processes share the machine.
KV_CACHE_BYTES = 32 * 1024 * 1024
MAX_MODEL_LEN = 1024
# Six times the other e2e modules' TTL: five engines (nine workers) share two
# cores with whatever else runs, and a starved session thread that misses its
# heartbeats ends the session (and turns a pull into a recompute).
SESSION_TTL_MS = 30000
# Reads here can stall for tens of seconds: five engines' idle TP/PP workers poll
# vLLM's shared-memory queues and starve two cores (load average 80; reads took
# 13.7 s and 31 s in CI, and one hit the 60 s read timeout). A starved read must
# still finish and commit rather than be recomputed: lease and read get 150 s.
LEASE_TTL_MS = 150000
READ_TIMEOUT_MS = 150000
# The broker's answers can be seconds late for the same reason (a 2 s resolve timed
# out once, and a holder's announcement took more than 3 s to be indexed): the
# reader's engine core steps without pause while its pull is in flight, and its
# gRPC thread competes with that loop for the GIL.
RESOLVE_WAIT_MS = 15000
ACQUIRE_WAIT_MS = 60000

# name -> (tensor-parallel size, pipeline-parallel size)
ENGINES: dict[str, tuple[int, int]] = {"S": (1, 1), "T1": (2, 1), "T2": (2, 1), "Q1": (1, 2), "Q2": (1, 2)}


def _multi_rank_unsupported() -> str | None:
    """Why this platform cannot run two-rank engines at all (None = it can)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None  # CPU workers are processes: any core count runs TP=2 / PP=2
    import torch

    if current_platform.is_cuda() and torch.cuda.device_count() < 2:
        return f"TP=2 / PP=2 engines need 2 GPUs on a CUDA vLLM build; found {torch.cuda.device_count()}"
    return None


@dataclass
class Cluster:
    broker: BrokerProcess
    engines: dict[str, EngineProcess]
    stats: dict[str, Path]
    log_dir: Path
    block_bytes: int  # one block of all layers, all KV heads (summed over an engine's ranks)

    def stat(self, name: str, key: str) -> int:
        return int(read_stats(self.stats[name]).get(key, 0))

    def skips(self, name: str, reason: str) -> int:
        return int(read_stats(self.stats[name]).get("skips", {}).get(reason, 0))

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def failed_pulls(self, name: str) -> list[str]:
        """The reader's own words for each pull that failed (why it recomputed)."""
        return [line for line in self.log(name).splitlines() if "failed, recomputing them" in line]


def _start(model: Path, log_dir: Path, name: str, broker_address: str) -> EngineProcess:
    tp, pp = ENGINES[name]
    config = connector_config(
        broker_address=broker_address,
        engine_id=name,
        role="both",
        session_ttl_ms=SESSION_TTL_MS,
        lease_ttl_ms=LEASE_TTL_MS,
        read_timeout_ms=READ_TIMEOUT_MS,
        resolve_wait_ms=RESOLVE_WAIT_MS,
        acquire_wait_ms=ACQUIRE_WAIT_MS,
        stats_path=str(log_dir / f"{name}-stats.json"),
        pull_policy="threshold",  # these prompts must be pulled, even where recomputing is quicker
    )
    args = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    if pp > 1:
        args += PIPELINE_PARALLEL_CPU_ARGS
    engine = EngineProcess(
        model,
        name=name,
        kv_transfer_config=config,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=KV_CACHE_BYTES,
        extra_args=args,
        enforce_eager=pp == 1,
        log_path=log_dir / f"{name}.log",
    )
    return engine.start()


def _block_bytes(model: Path) -> int:
    """Bytes of one KV block over all layers and heads (K and V, float32)."""
    config = json.loads((model / "config.json").read_text())
    head_size = config["hidden_size"] // config["num_attention_heads"]
    per_layer = 2 * config["num_key_value_heads"] * head_size * BLOCK_SIZE * 4
    return int(per_layer * config["num_hidden_layers"])


def _fully_ranked(client: BrokerClient) -> set[str]:
    """Engines whose every (pp_rank, tp_rank) has registered its NIXL agent and layers."""
    ready = set()
    for engine in client.list_engines().engines:
        size = (engine.layout.tp_size or 1) * (engine.layout.pp_size or 1)
        agents = {
            (r.pp_rank, r.tp_rank) for r in engine.ranks if r.agent_name and r.end_layer > r.start_layer
        }
        if len(agents) == size:
            ready.add(engine.engine_id)
    return ready


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from kvbroker.tools.tiny_model import build_tiny_model

    reason = _multi_rank_unsupported()
    if reason is not None:
        pytest.skip(reason)
    log_dir = tmp_path_factory.mktemp("parallel-e2e")
    # kv_heads divisible by TP=2, layers divisible by PP=2.
    model = build_tiny_model(log_dir / "model", num_layers=2, heads=4, kv_heads=2)
    broker = BrokerProcess(log_dir).start()
    engines: dict[str, EngineProcess] = {}
    try:
        for name in ENGINES:
            engines[name] = _start(model, log_dir, name, broker.address)
        for engine in engines.values():
            engine.wait_ready(timeout=420, progress=print)
        for engine in engines.values():
            # Nine workers that busy-poll vLLM's queues after every message would starve
            # the engines' broker sessions on two cores (a 30 s session once lapsed).
            engine.deprioritize_workers()
        with BrokerClient(broker.address) as client:
            assert wait_for(lambda: _fully_ranked(client) == set(ENGINES), 30, 0.2), (
                f"not every rank registered with the broker: {sorted(_fully_ranked(client))}"
            )
        print(f"parallel e2e logs in {log_dir}")
        yield Cluster(
            broker,
            engines,
            {name: log_dir / f"{name}-stats.json" for name in ENGINES},
            log_dir,
            _block_bytes(model),
        )
    finally:
        for engine in engines.values():
            engine.stop()
        broker.stop()


def _prefill_for_remote_decode(cluster: Cluster, holder: str, prompt: list[int]) -> dict[str, Any]:
    first = complete(
        cluster.engines[holder], prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    params = first.get("kv_transfer_params")
    assert params and params["do_remote_prefill"] is True and params["remote_engine_id"] == holder
    return dict(params)


def test_ranks_registered_with_layer_ranges(cluster: Cluster) -> None:
    """Each rank is keyed by (pp_rank, tp_rank) and owns its stage's layers."""
    with BrokerClient(cluster.broker.address) as client:
        engines = {e.engine_id: e for e in client.list_engines().engines}
    ranges = {
        name: sorted((r.pp_rank, r.tp_rank, r.start_layer, r.end_layer) for r in engines[name].ranks)
        for name in ENGINES
    }
    assert ranges["S"] == [(0, 0, 0, 2)]
    assert ranges["T1"] == [(0, 0, 0, 2), (0, 1, 0, 2)]
    assert ranges["Q1"] == [(0, 0, 0, 1), (1, 0, 1, 2)]
    assert (engines["T1"].layout.tp_size, engines["Q1"].layout.pp_size) == (2, 2)


@pytest.mark.parametrize(
    ("holder", "reader", "length"),
    [("T1", "T2", 150), ("Q1", "Q2", 160), ("Q1", "S", 170), ("S", "Q2", 140)],
    ids=["tp2-to-tp2", "pp2-to-pp2", "pp2-to-pp1", "pp1-to-pp2"],
)
def test_pull_across_ranks_matches_single_engine(
    cluster: Cluster, holder: str, reader: str, length: int
) -> None:
    prompt = prompt_of(length, seed=length)
    reference = recompute_reference(cluster.engines["S"], prompt, MAX_TOKENS)
    full_blocks = length // BLOCK_SIZE
    pulled_before = cluster.stat(reader, "pulled_blocks")
    bytes_before = cluster.stat(reader, "pulled_bytes")
    failed_before = cluster.stat(reader, "pulls_failed")
    returned_before = cluster.stat(holder, "holds_returned")

    params = _prefill_for_remote_decode(cluster, holder, prompt)
    answer = complete(
        cluster.engines[reader], prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params, timeout=300
    )

    assert output_ids(answer) == reference
    assert cluster.stat(reader, "pulls_failed") == failed_before, cluster.failed_pulls(reader)
    assert cluster.stat(reader, "pulled_blocks") - pulled_before == full_blocks
    # Every layer and head of every block arrived: the reader's ranks together
    # read exactly what one engine holds, whatever way both sides split it.
    assert cluster.stat(reader, "pulled_bytes") - bytes_before == full_blocks * cluster.block_bytes
    assert wait_for(lambda: cluster.stat(holder, "holds_returned") > returned_before, 5)
    with BrokerClient(cluster.broker.address) as client:
        leases = client.list_leases(engine_id=reader, include_ended=True).leases
    assert any(le.holder_engine_id == holder and le.state == pb.LEASE_RELEASED for le in leases)


@pytest.mark.parametrize(
    ("holder", "reader", "length"), [("T1", "S", 200), ("S", "T2", 210)], ids=["tp2-to-tp1", "tp1-to-tp2"]
)
def test_tensor_parallel_mismatch_refused_and_recomputed(
    cluster: Cluster, holder: str, reader: str, length: int
) -> None:
    """KV heads are split per TP rank: a reader with another TP size refuses the
    holder named in the params (it says its sizes) and computes the prompt itself."""
    prompt = prompt_of(length, seed=length)
    reference = recompute_reference(cluster.engines["S"], prompt, MAX_TOKENS)
    pulls_before = cluster.stat(reader, "pulls")
    refused_before = cluster.skips(reader, "incompatible_holder")
    holder_tp, reader_tp = ENGINES[holder][0], ENGINES[reader][0]

    params = _prefill_for_remote_decode(cluster, holder, prompt)
    assert params["kvbroker"]["tp_size"] == holder_tp
    answer = complete(cluster.engines[reader], prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)

    assert output_ids(answer) == reference
    assert cluster.stat(reader, "pulls") == pulls_before, f"{reader} read blocks split for another TP size"
    assert cluster.skips(reader, "incompatible_holder") == refused_before + 1
    refusal = (
        f"not pulling (incompatible_holder): holder {holder}: tensor-parallel sizes differ "
        f"(reader tp={reader_tp}, holder tp={holder_tp})"
    )
    assert refusal in cluster.log(reader)
    assert cluster.engines[reader].is_healthy()

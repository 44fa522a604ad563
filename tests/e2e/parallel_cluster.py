"""The multi-rank cluster the tensor- and pipeline-parallel e2e modules share: one real
broker process and real multi-rank vLLM engines (CPU build, tiny random model, float32)
with BrokerConnector, real NIXL over UCX moving each rank's share of every block.

    S        TP=1 PP=1   the single-engine reference, and the odd-sized reader
    T1, T2   TP=2        KV heads split across two ranks
    Q1, Q2   PP=2        layers [0, 1) on stage 0, [1, 2) on stage 1

Each module starts S and one pair (T or Q), never all five: five multi-rank engines
(nine workers) on two cores and 24 GB starved the broker for 14 s once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbroker.clients.sync import BrokerClient
from kvbroker.tools.launch import PIPELINE_PARALLEL_CPU_ARGS, EngineProcess, connector_config
from kvbroker.v1 import broker_pb2 as pb
from testkit.engines import (
    BLOCK_SIZE,
    complete,
    handover_blocks,
    output_ids,
    prompt_of,
    read_stats,
    recompute_reference,
)
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for

MAX_TOKENS = 6
# Small per rank: the engines' worker processes share the machine.
KV_CACHE_BYTES = 32 * 1024 * 1024
MAX_MODEL_LEN = 1024
# Far above the other e2e modules' TTL: five engines (nine workers) share two
# cores with whatever else runs in CI, and a session whose heartbeats go unread
# for a TTL ends (and turns a pull into a recompute). At 30 s this happened twice
# in CI runs (once a holder, once a reader) with neither side's timers reporting
# a stall of their own. Nothing in these modules waits for a session to expire.
SESSION_TTL_MS = 120000
# Reads here can stall for tens of seconds: five engines' idle TP/PP workers poll
# vLLM's shared-memory queues and starve two cores (load average 80; reads took
# 13.7 s and 31 s in CI, and one hit the 60 s read timeout). A starved read must
# still finish and commit rather than be recomputed: lease and read get 150 s.
LEASE_TTL_MS = 150000
READ_TIMEOUT_MS = 150000
# The broker's answers can be seconds late for the same reason (a 2 s resolve timed
# out once, a holder's announcement took more than 3 s to be indexed, and with all
# five engines up at once the broker once did not run for 14 s): the reader's
# engine core steps without pause while its pull is in flight, and its gRPC thread
# competes with that loop for the GIL.
RESOLVE_WAIT_MS = 60000
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
        """The reader's own words for each pull that failed (why it recomputed), and what its
        broker session went through (a lost session fails a release)."""
        said = ("failed, recomputing them", "session of", "broker reported on session", "broker refused")
        own = [line for line in self.log(name).splitlines() if any(words in line for words in said)]
        # The broker's side: its stalls, and what it logged about this engine's session.
        broker_said = ("did not run for", f"engine {name} (session")
        log = self.broker.log_path.read_text(errors="replace") if self.broker.log_path.exists() else ""
        return own + [f"broker: {line}" for line in log.splitlines() if any(w in line for w in broker_said)]


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


def start_cluster(tmp_path_factory: pytest.TempPathFactory, names: Sequence[str]) -> Iterator[Cluster]:
    """A module's cluster: the broker and the engines `names`, until the module ends."""
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
        for name in names:
            engines[name] = _start(model, log_dir, name, broker.address)
        for engine in engines.values():
            engine.wait_ready(timeout=420, progress=print)
        for engine in engines.values():
            # Workers that busy-poll vLLM's queues after every message would starve the
            # engines' broker sessions on two cores (a 30 s session once lapsed).
            engine.deprioritize_workers()
        with BrokerClient(broker.address) as client:
            assert wait_for(lambda: _fully_ranked(client) == set(names), 30, 0.2), (
                f"not every rank registered with the broker: {sorted(_fully_ranked(client))}"
            )
        print(f"parallel e2e logs in {log_dir}")
        yield Cluster(
            broker,
            engines,
            {name: log_dir / f"{name}-stats.json" for name in names},
            log_dir,
            _block_bytes(model),
        )
    finally:
        for engine in engines.values():
            engine.stop()
        broker.stop()


def registered_ranges(cluster: Cluster) -> dict[str, list[tuple[int, int, int, int]]]:
    """engine -> sorted (pp_rank, tp_rank, start_layer, end_layer) of its ranks, as the broker has them."""
    with BrokerClient(cluster.broker.address) as client:
        engines = {e.engine_id: e for e in client.list_engines().engines}
    return {
        name: sorted((r.pp_rank, r.tp_rank, r.start_layer, r.end_layer) for r in engines[name].ranks)
        for name in cluster.engines
    }


def prefill_for_remote_decode(cluster: Cluster, holder: str, prompt: list[int]) -> dict[str, Any]:
    first = complete(
        cluster.engines[holder], prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    params = first.get("kv_transfer_params")
    assert params and params["do_remote_prefill"] is True and params["remote_engine_id"] == holder
    return dict(params)


def check_pull_across_ranks(cluster: Cluster, holder: str, reader: str, length: int) -> None:
    """The holder prefills with do_remote_decode; the reader pulls the prompt's blocks rank by
    rank (each reader rank reads its layers from the holder rank that owns them, same
    tp_rank) and decodes. Its greedy output equals S computing the prompt under a fresh
    cache_salt, every layer and head of every block arrived, and the lease was released."""
    prompt = prompt_of(length, seed=length)
    reference = recompute_reference(cluster.engines["S"], prompt, MAX_TOKENS)
    blocks = handover_blocks(length)
    pulled_before = cluster.stat(reader, "pulled_blocks")
    bytes_before = cluster.stat(reader, "pulled_bytes")
    failed_before = cluster.stat(reader, "pulls_failed")
    returned_before = cluster.stat(holder, "holds_returned")

    params = prefill_for_remote_decode(cluster, holder, prompt)
    answer = complete(
        cluster.engines[reader], prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params, timeout=300
    )

    assert output_ids(answer) == reference

    def settled() -> bool:  # the stats file trails the counters by a write of its own thread
        pulled = cluster.stat(reader, "pulled_blocks") - pulled_before
        return pulled >= blocks or cluster.stat(reader, "pulls_failed") > failed_before

    wait_for(settled, 30)
    assert cluster.stat(reader, "pulls_failed") == failed_before, cluster.failed_pulls(reader)
    assert cluster.stat(reader, "pulled_blocks") - pulled_before == blocks, cluster.failed_pulls(reader)
    # Every layer and head of every block arrived: the reader's ranks together
    # read exactly what one engine holds, whatever way both sides split it.
    assert cluster.stat(reader, "pulled_bytes") - bytes_before == blocks * cluster.block_bytes
    assert wait_for(lambda: cluster.stat(holder, "holds_returned") > returned_before, 30), (
        "the holder's hold was not returned"
    )
    with BrokerClient(cluster.broker.address) as client:
        leases = client.list_leases(engine_id=reader, include_ended=True).leases
    assert any(le.holder_engine_id == holder and le.state == pb.LEASE_RELEASED for le in leases), leases

"""vLLM KV connector plugin: ``BrokerConnector``.

Load it into a stock vLLM server with::

    --kv-transfer-config '{"kv_connector": "BrokerConnector",
                           "kv_connector_module_path": "kvbroker.engine_adapter.connector",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"broker_address": "broker:50051"}}'

A thin facade: the scheduler role delegates to ``AdapterScheduler``
(engine_adapter/scheduler.py, which composes lookups.py, loads.py, holds.py,
cpu_stores.py and stats.py), the worker role to ``AdapterWorker``
(engine_adapter/worker.py). Extra config keys: engine_adapter/config.py.
docs/adapter.md lists the modules.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvbroker.common.layout import KV_PROTOCOL_VERSION
from kvbroker.engine_adapter.config import AdapterConfig
from kvbroker.engine_adapter.metadata import AdapterMetadata, RegionSpec
from kvbroker.v1 import broker_pb2 as pb

if TYPE_CHECKING:
    import torch
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvbroker.engine_adapter.scheduler import AdapterScheduler
    from kvbroker.engine_adapter.worker import AdapterWorker

logger = logging.getLogger("vllm.kvbroker.connector")


def layout_fingerprint(vllm_config: VllmConfig) -> pb.LayoutFingerprint:
    """The fields that must match for one engine to read another's KV blocks."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    return pb.LayoutFingerprint(
        model=str(model.model),
        dtype=str(model.dtype).removeprefix("torch."),
        block_size=int(cache.block_size),
        num_layers=int(model.get_total_num_hidden_layers()),
        num_kv_heads=int(model.get_total_num_kv_heads()),
        head_size=int(model.get_head_size()),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        hash_algo=str(cache.prefix_caching_hash_algo),
        kv_layout=f"kv_cache_dtype={cache.cache_dtype}",
        engine_version=f"vllm {vllm.__version__}",
        kv_protocol=KV_PROTOCOL_VERSION,
    )


def adapter_config(vllm_config: VllmConfig) -> AdapterConfig:
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None
    config = AdapterConfig.from_extra_config(transfer.kv_connector_extra_config)
    if not (transfer.kv_connector_extra_config or {}).get("engine_id") and transfer.engine_id:
        # vLLM's own engine id is the same object in the scheduler and every worker.
        import dataclasses

        config = dataclasses.replace(config, engine_id=str(transfer.engine_id))
    return config


class BrokerConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        self.adapter_config = adapter_config(vllm_config)
        self._scheduler: AdapterScheduler | None = None
        self._worker: AdapterWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(vllm_config)
        else:
            self._worker = self._make_worker()

    # ------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------

    def _make_scheduler(self, vllm_config: VllmConfig) -> AdapterScheduler:
        from kvbroker.engine_adapter.broker_link import SessionBrokerLink
        from kvbroker.engine_adapter.scheduler import AdapterScheduler

        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        if transfer.kv_load_failure_policy != "recompute":
            # Release-commits-the-read needs vLLM to recompute blocks whose read was not committed.
            logger.warning(
                "kvbroker: setting kv_load_failure_policy=recompute (was %r): uncommitted pulls are recomputed",
                transfer.kv_load_failure_policy,
            )
            transfer.kv_load_failure_policy = "recompute"
        config = self.adapter_config
        parallel = vllm_config.parallel_config
        tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
        link = None
        if config.broker_enabled:
            engine = pb.EngineInfo(
                engine_id=config.engine_id,
                layout=layout_fingerprint(vllm_config),
                labels={k: v for k, v in (("role", config.role), ("url", config.url)) if v},
            )
            link = SessionBrokerLink(
                config.broker_address,
                engine,
                session_ttl_ms=config.session_ttl_ms,
                expected_ranks=tp * pp,
                index_mirror=config.index_mirror,
                resolve_timeout_s=max(2.0, max(config.resolve_wait_ms, config.acquire_wait_ms) / 1000.0),
                # A release answered late still commits the read while the lease lives.
                lease_call_timeout_s=max(5.0, config.lease_ttl_ms / 1000.0),
                security=config.security(),
            )
        logger.info(
            "kvbroker: engine %s (role %s), broker %s, threshold %d tokens, multi_turn=%s",
            config.engine_id,
            config.role,
            config.broker_address or "disabled",
            config.kv_recompute_threshold,
            config.multi_turn,
        )
        return AdapterScheduler(
            config=config,
            link=link,
            block_size=int(vllm_config.cache_config.block_size),
            tp_size=tp,
            pp_size=pp,
            block_bytes=_block_bytes(self._kv_cache_config, tp),
            chunk_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
        )

    def _make_worker(self) -> AdapterWorker:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        from kvbroker.engine_adapter.worker import AdapterWorker

        config = self.adapter_config
        registrar = _rank_registrar(config) if config.broker_enabled else None
        return AdapterWorker(
            engine_id=config.engine_id,
            pp_rank=int(get_pp_group().rank_in_group),
            tp_rank=int(get_tensor_model_parallel_rank()),
            mover_factory=functools.partial(_make_mover, read_timeout_s=config.read_timeout_ms / 1000),
            region_factory=_region_from_spec,
            rank_registrar=registrar,
            cpu_tier_slots=config.cpu_tier_blocks,
            cpu_tier_factory=_make_cpu_tier,
            verify_bytes=config.verify_bytes,
            verify_sample=config.verify_sample,
            step_wait_s=config.step_wait_ms / 1000,
        )

    # ------------------------------------------------------------------
    # worker side
    # ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvbroker.engine_adapter.kv_regions import regions_from_kv_caches

        assert self._worker is not None
        regions, num_blocks, mem_type = regions_from_kv_caches(kv_caches)
        self._worker.register_memory(regions, num_blocks, mem_type, kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, AdapterMetadata):
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a request runs only after its blocks are committed.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        # Holders are read in place by the reader (NIXL READ); nothing to push.
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished(finished_req_ids)

    # ------------------------------------------------------------------
    # vLLM's connector stats and /metrics (engine_adapter/vllm_metrics.py)
    # ------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # The scheduler calls this every step, right before it drains the block pool's
        # KV cache events: read the evictions there first.
        if self._scheduler is None:
            return None
        self._scheduler.read_cache_events()
        delta = self._scheduler.take_stats_delta()
        if delta is None:
            return None
        from kvbroker.engine_adapter.vllm_metrics import BrokerConnectorStats

        return BrokerConnectorStats(data=delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        from kvbroker.engine_adapter.vllm_metrics import BrokerConnectorStats

        return BrokerConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        from kvbroker.engine_adapter.vllm_metrics import BrokerPromMetrics

        return BrokerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_outcomes() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ------------------------------------------------------------------
    # scheduler side
    # ------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        # Holds keep their blocks with a reference in this pool, not by keeping the
        # finished request in vLLM (which vLLM counts as work: the engine would spin).
        if self._scheduler is not None:
            from kvbroker.engine_adapter.wakeup import find_engine_wakeup

            self._scheduler.bind_block_pool(gpu_block_pool, wake=find_engine_wakeup())

    def has_pending_push_work(self) -> bool:
        # Ended holds whose pool reference is still ours, pins of cached blocks to take or
        # give back: one more step does it (an idle engine is woken: engine_adapter/wakeup.py).
        # vLLM's engine loop asks this on the scheduler thread after every message it handles,
        # so KV cache events of an idle engine (a prefix-cache reset) are read here too.
        if self._scheduler is None:
            return False
        self._scheduler.read_cache_events()
        return self._scheduler.has_pool_returns()

    def has_pending_block_frees(self) -> bool:
        # Asked when an allocation fails, before vLLM preempts: ended holds give their blocks back now.
        return self._scheduler is not None and self._scheduler.return_held_blocks()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(_scheduled_work(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        finished = self._scheduler.update_connector_output(
            worker_meta=connector_output.kv_connector_worker_meta,
            finished_sending=connector_output.finished_sending,
            finished_recving=connector_output.finished_recving,
        )
        if finished:
            # Loads committed on this side in this output (reads done, lease released): vLLM reads
            # finished_recving right after this hook, so their prefill is scheduled next step
            # instead of a step later, after a Commit's trip through the worker.
            connector_output.finished_recving = set(connector_output.finished_recving or ()) | finished

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)


def _scheduled_work(output: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, tokens computed in this step, tokens already computed) per scheduled request."""
    counts = output.num_scheduled_tokens
    work = [(r.req_id, counts.get(r.req_id, 0), r.num_computed_tokens) for r in output.scheduled_new_reqs]
    cached = output.scheduled_cached_reqs
    work += [
        (req_id, counts.get(req_id, 0), computed)
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False)
    ]
    return work


def _block_bytes(kv_cache_config: Any, tp_size: int) -> int:
    """Bytes one block of the whole model moves on a pull (every layer, every TP rank); 0 if unknown."""
    try:
        per_rank = sum(
            int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names) for g in kv_cache_config.kv_cache_groups
        )
    except (AttributeError, TypeError):
        return 0  # learned from the first pull instead
    return per_rank * tp_size


def _make_mover(agent_name: str, read_timeout_s: float) -> Any:
    from kvbroker.engine_adapter.block_mover import BlockMover

    return BlockMover(agent_name, read_timeout_s=read_timeout_s)


def _make_cpu_tier(regions: list[Any], num_slots: int) -> Any:
    from kvbroker.engine_adapter.cpu_tier import CpuTierBuffer

    return CpuTierBuffer(regions, num_slots)  # pinned host memory iff CUDA is available


def _region_from_spec(spec: RegionSpec) -> Any:
    from kvbroker.engine_adapter.kv_regions import Region

    return Region(spec.layer, spec.base_addr, spec.block_stride, spec.block_bytes, spec.device_id)


def _rank_registrar(config: AdapterConfig) -> Any:
    """RegisterRank over a blocking client, created on the registration thread."""
    clients: list[Any] = []

    def register(rank: pb.RankInfo) -> None:
        if not clients:
            from kvbroker.clients.sync import BrokerClient

            # A loaded broker may answer in seconds; a timed-out refresh is only retried.
            clients.append(BrokerClient(config.broker_address, timeout=10.0, security=config.security()))
        clients[0].register_rank(engine_id=config.engine_id, rank=rank)

    return register

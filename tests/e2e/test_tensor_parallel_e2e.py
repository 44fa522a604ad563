"""Tensor-parallel pulls end to end (tests/e2e/parallel_cluster.py): S (TP=1) and T1, T2
(TP=2: KV heads split across two ranks). Equal TP sizes pull rank to rank and decode
token-identically to S; TP sizes that differ are refused (the heads are split
differently) and the request is recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvbroker.clients.sync import BrokerClient
from testkit.engines import complete, output_ids, prompt_of, recompute_reference
from tests.e2e.parallel_cluster import (
    ENGINES,
    MAX_TOKENS,
    Cluster,
    check_pull_across_ranks,
    prefill_for_remote_decode,
    registered_ranges,
    start_cluster,
)

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory, ("S", "T1", "T2"))


def test_ranks_registered_with_head_shares(cluster: Cluster) -> None:
    """Each rank is keyed by (pp_rank, tp_rank); TP ranks each hold every layer (their heads' share)."""
    ranges = registered_ranges(cluster)
    assert ranges["S"] == [(0, 0, 0, 2)]
    assert ranges["T1"] == [(0, 0, 0, 2), (0, 1, 0, 2)] == ranges["T2"]
    with BrokerClient(cluster.broker.address) as client:
        (t1,) = [e for e in client.list_engines().engines if e.engine_id == "T1"]
    assert (t1.layout.tp_size, t1.layout.pp_size) == (2, 1)


def test_pull_across_tensor_parallel_ranks_matches_single_engine(cluster: Cluster) -> None:
    check_pull_across_ranks(cluster, "T1", "T2", 150)


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

    params = prefill_for_remote_decode(cluster, holder, prompt)
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

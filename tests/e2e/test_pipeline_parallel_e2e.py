"""Pipeline-parallel pulls end to end (tests/e2e/parallel_cluster.py): S (TP=1 PP=1) and
Q1, Q2 (PP=2: layers [0, 1) on stage 0, [1, 2) on stage 1). A holder prefills with
``do_remote_decode``; the reader pulls each stage's layers from the holder rank that owns
them, whatever way each side splits its layers, and decodes token-identically to S.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from tests.e2e.parallel_cluster import Cluster, check_pull_across_ranks, registered_ranges, start_cluster

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory, ("S", "Q1", "Q2"))


def test_ranks_registered_with_layer_ranges(cluster: Cluster) -> None:
    """Each rank is keyed by (pp_rank, tp_rank) and owns its stage's layers."""
    ranges = registered_ranges(cluster)
    assert ranges["S"] == [(0, 0, 0, 2)]
    assert ranges["Q1"] == [(0, 0, 0, 1), (1, 0, 1, 2)] == ranges["Q2"]


@pytest.mark.parametrize(
    ("holder", "reader", "length"),
    [("Q1", "Q2", 160), ("Q1", "S", 170), ("S", "Q2", 140)],
    ids=["pp2-to-pp2", "pp2-to-pp1", "pp1-to-pp2"],
)
def test_pull_across_stages_matches_single_engine(
    cluster: Cluster, holder: str, reader: str, length: int
) -> None:
    check_pull_across_ranks(cluster, holder, reader, length)

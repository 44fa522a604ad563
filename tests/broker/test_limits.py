"""Unit tests of the broker's defences against hostile input, on the core and the index alone.

The same defences are exercised over the wire, against a real broker process,
in tests/process/test_hostile_requests.py and test_hostile_load.py; these pin
the rules themselves down, including what no client can provoke on purpose
(two namespaces sharing an index key).
"""

from __future__ import annotations

import math

import pytest

from kvbroker.broker.errors import InvalidArgument, NotFound, ResourceExhausted, shown
from kvbroker.broker.listing import list_engines, list_leases
from kvbroker.common.causes import Cause
from kvbroker.common.index import SHARDS, CompactPrefixIndex, namespace_salt
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from tests.broker.helpers import make_core

KEY = b"k" * 32


def test_a_shared_key_still_never_matches_across_namespaces() -> None:
    """Even when a hash lands on another namespace's key (here forced: the salt key is known),
    a lookup keeps only its own namespace's holders, and removal touches only the remover's."""
    index = CompactPrefixIndex(salt_key=KEY)
    a, b = Namespace("L", "a"), Namespace("L", "b")
    mix = namespace_salt(a, KEY) ^ namespace_salt(b, KEY)
    chain = [11, 12, 13, 14]
    index.add("evil", Tier.GPU, b, [h ^ mix for h in chain])  # the very keys of `chain` in `a`
    assert index.longest_prefixes(a, chain) == []
    index.add("good", Tier.GPU, a, chain[:2])
    assert index.longest_prefixes(a, chain) == [("good", Tier.GPU, 2)]
    assert index.longest_prefixes(b, [h ^ mix for h in chain]) == [("evil", Tier.GPU, 4)]
    exported: dict[tuple[str, str], set[int]] = {}
    for step in index.export("L", 3):
        for engine, _tier, ns, hashes in step:
            exported.setdefault((engine, ns.tenant), set()).update(hashes)
    assert exported == {("evil", "b"): {h ^ mix for h in chain}, ("good", "a"): {11, 12}}
    index.remove("evil", Tier.GPU, b, [h ^ mix for h in chain])
    assert index.longest_prefixes(a, chain) == [("good", Tier.GPU, 2)]
    assert index.longest_prefixes(b, [h ^ mix for h in chain]) == []


def test_salts_are_secret_per_index() -> None:
    ns = Namespace("L", "t")
    assert CompactPrefixIndex()._salt(ns) != CompactPrefixIndex()._salt(ns)
    assert CompactPrefixIndex()._salt(ns) != namespace_salt(ns)  # not the public, unkeyed one


def test_export_of_an_empty_layout_walks_nothing_and_others_step_per_shard() -> None:
    index = CompactPrefixIndex()
    index.add("e", Tier.GPU, Namespace("L", ""), range(10_000))
    assert list(index.export("other", 100)) == []
    steps = list(index.export("L", 100))
    assert len(steps) >= SHARDS and max(sum(len(hs) for *_, hs in s) for s in steps) <= 100
    assert sorted(h for s in steps for *_, hs in s for h in hs) == list(range(10_000))


def test_lease_caps_per_lease_and_per_engine() -> None:
    core, _clock, _ = make_core(max_lease_blocks=4, max_leases_per_engine=2)
    p = core.register(engine_info("P"), 3000)
    core.register(engine_info("D"), 3000)
    ns = Namespace(p.layout_id, "")
    with pytest.raises(ResourceExhausted, match="--max-lease-blocks") as err:
        core.hold("P", ns, Tier.GPU, [1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    assert err.value.cause is Cause.LIMIT_REACHED and err.value.metadata["limit"] == "4"
    first = core.hold("P", ns, Tier.GPU, [1], [1])
    core.hold("P", ns, Tier.GPU, [2], [2], reader_id="D")
    with pytest.raises(ResourceExhausted, match="holds 2 live leases"):
        core.hold("P", ns, Tier.GPU, [3], [3])
    core.revoke(first.lease_id)
    core.hold("P", ns, Tier.GPU, [3], [3], reader_id="D")  # room again
    q = core.register(engine_info("Q"), 3000)
    held = core.hold("Q", Namespace(q.layout_id, ""), Tier.GPU, [9], [9])
    with pytest.raises(ResourceExhausted, match="reads 2 live leases"):
        core.acquire(held.lease_id, "D")


def test_ended_history_is_bounded_in_blocks_and_lists_page() -> None:
    core, _clock, _ = make_core(ended_lease_history_blocks=10, list_page_size=3)
    p = core.register(engine_info("P"), 3000)
    ns = Namespace(p.layout_id, "")
    ids = []
    for i in range(8):
        lease = core.hold("P", ns, Tier.GPU, [i, i + 100, i + 200], [1, 2, 3])
        ids.append(lease.lease_id)
        core.revoke(lease.lease_id)
    ended = list(core.leases.recently_ended())
    assert [lease.lease_id for lease in ended] == ids[-3:]  # 3 leases of 3 blocks fit in 10
    for i in range(7):
        core.hold("P", ns, Tier.GPU, [i], [i])
    seen: list[str] = []
    token = ""
    while True:
        page = list_leases(core, pb.ListLeasesRequest(page_token=token))
        assert len(page.leases) <= 3
        seen += [lease.lease_id for lease in page.leases]
        token = page.next_page_token
        if not token:
            break
    assert len(seen) == 7 == len(set(seen))
    assert list_leases(core, pb.ListLeasesRequest(page_size=2)).next_page_token


def test_sizes_loads_and_echoes() -> None:
    core, _clock, _ = make_core(max_id_bytes=16, max_labels_bytes=100, max_text_bytes=20)
    with pytest.raises(InvalidArgument, match="--max-id-bytes"):
        core.register(engine_info("e" * 17), 3000)
    with pytest.raises(InvalidArgument, match="--max-labels-bytes"):
        core.register(engine_info("E", labels={"k": "v" * 100}), 3000)
    for load in (math.nan, math.inf, -0.5):
        info = engine_info("E")
        info.load = load
        with pytest.raises(InvalidArgument, match="load"):
            core.register(info, 3000)
    rec = core.register(engine_info("E"), 3000)
    with pytest.raises(InvalidArgument, match="finite"):
        core.heartbeat(rec, -1.0)
    assert rec.load == 0.0
    ns = Namespace(rec.layout_id, "t" * 17)
    with pytest.raises(InvalidArgument, match=r"namespace\.tenant"):
        core.resolve(rec, ns, [1])
    lease = core.hold("E", Namespace(rec.layout_id, ""), Tier.GPU, [1], [1])
    core.revoke(lease.lease_id, "r" * 1000)
    assert len(core.leases.get(lease.lease_id).detail) < 60
    with pytest.raises(NotFound) as err:
        core.registry.get("x" * 65536)
    assert len(err.value.message) < 200 and "65536 chars" in err.value.message
    assert len(err.value.metadata["engine_id"]) <= 256
    assert shown("short") == "'short'"


def test_engines_list_in_pages_by_count_and_by_bytes() -> None:
    core, _clock, _ = make_core(list_page_size=2, max_message_bytes=200_000, max_labels_bytes=60_000)
    for i in range(5):
        core.register(engine_info(f"e{i}", labels={"blob": "x" * 40_000}), 3000)
    pages: list[list[str]] = []
    token = ""
    while True:
        page = list_engines(core, pb.ListEnginesRequest(page_token=token))
        pages.append([e.engine_id for e in page.engines])
        token = page.next_page_token
        if not token:
            break
    # 40 KB engines, 100 KB a page (half the message limit): two per page, in id order.
    assert pages == [["e0", "e1"], ["e2", "e3"], ["e4"]]
    one = list_engines(core, pb.ListEnginesRequest(page_size=1))
    assert [e.engine_id for e in one.engines] == ["e0"] and one.next_page_token == "e0"
    big, _clock, _ = make_core(list_page_size=10, max_message_bytes=200_000, max_labels_bytes=60_000)
    for i in range(5):
        big.register(engine_info(f"e{i}", labels={"blob": "x" * 40_000}), 3000)
    first = list_engines(big, pb.ListEnginesRequest())
    assert len(first.engines) == 2 and first.next_page_token == "e1"  # cut by bytes, not count

"""BlockChain: vLLM's published block hashes to our index keys, checked against vLLM's own hashing.

Events are built the way vLLM's block pool builds them (vLLM's hash_block_tokens,
its int or bytes external form); the real engine path is tests/broker/indexer/test_kv_events_vllm.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbroker.broker.errors import InvalidArgument
from kvbroker.broker.indexer.kv_chain import MASK64, BlockChain, event_fields
from kvbroker.broker.indexer.kv_events import parse_source, parse_sources
from kvbroker.common.hashing import wire_chain
from kvbroker.common.model import Tier

kv_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
vllm_hashing = pytest.importorskip("vllm.utils.hashing")

BLOCK = 4
TOKENS = list(range(100, 100 + 5 * BLOCK))


def vllm_digests(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """What vLLM's prefix cache computes (sha256, the default seed)."""
    fn = vllm_hashing.sha256
    kv_utils.init_none_hash(fn)
    parent = kv_utils.NONE_HASH
    out = []
    for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
        extra = (("cache_salt", salt),) if salt and i == 0 else None
        parent = kv_utils.hash_block_tokens(fn, parent, tokens[i : i + BLOCK], extra)
        out.append(parent)
    return out


def external(d: bytes, as_int: bool) -> Any:
    return int.from_bytes(d, "big") & MASK64 if as_int else d


def stored(digests: list[bytes], first: int, count: int, as_int: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [external(d, as_int) for d in digests[first : first + count]],
        "parent_block_hash": external(digests[first - 1], as_int) if first else None,
        "token_ids": TOKENS[first * BLOCK : (first + count) * BLOCK],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


@pytest.mark.parametrize("as_int", [True, False])
def test_events_map_to_our_wire_hashes(as_int: bool) -> None:
    digests = vllm_digests(TOKENS)
    ours = wire_chain(TOKENS, BLOCK)
    chain = BlockChain()
    # Two events, the second chained on the first by its parent hash.
    assert chain.stored(stored(digests, 0, 2, as_int)) == [(Tier.GPU, "", ours[:2])]
    assert chain.stored(stored(digests, 2, 3, as_int)) == [(Tier.GPU, "", ours[2:5])]
    # The same blocks offloaded to CPU are a second copy; removing the GPU copy leaves it.
    assert chain.stored(stored(digests, 0, 1, as_int, medium="CPU")) == [(Tier.CPU, "", ours[:1])]
    gone = {
        "type": "BlockRemoved",
        "block_hashes": [external(d, as_int) for d in digests[:2]],
        "medium": "GPU",
    }
    assert chain.removed(gone) == [(Tier.GPU, "", ours[:2])]
    assert chain.removed(gone) == []  # already gone
    assert len(chain) == 4  # blocks 2-4 on GPU, block 0 still on CPU
    assert chain.stats.stored == 6 and chain.stats.removed == 2


def test_salted_blocks_go_to_the_salt_namespace() -> None:
    digests = vllm_digests(TOKENS, salt="acme")
    chain = BlockChain()
    extra_keys = [("acme",), None]
    assert chain.stored(stored(digests, 0, 2, extra_keys=extra_keys)) == [
        (Tier.GPU, "acme", wire_chain(TOKENS, BLOCK, cache_salt="acme")[:2])
    ]
    # The child event inherits its parent's namespace.
    assert chain.stored(stored(digests, 2, 1))[0][1] == "acme"
    tenant_chain = BlockChain(tenant="t1")
    assert tenant_chain.stored(stored(digests, 0, 1, extra_keys=[("acme",)]))[0][1] == "t1/acme"


def test_what_cannot_be_reproduced_is_skipped_not_misfiled() -> None:
    digests = vllm_digests(TOKENS)
    chain = BlockChain()
    assert chain.stored(stored(digests, 2, 2)) == []  # parent never seen
    assert chain.stats.unknown_parent == 2
    wrong = stored(digests, 0, 2)
    wrong["token_ids"] = [t + 1 for t in wrong["token_ids"]]  # another hash algo or seed looks like this
    assert chain.stored(wrong) == [] and chain.stats.mismatched == 2
    assert chain.stored(stored(digests, 0, 1, lora_name="adapter")) == []
    assert chain.stored(stored(digests, 0, 1, extra_keys=[("mm-id", 0)])) == []
    assert chain.stats.unsupported == 2
    short = stored(digests, 0, 2)
    short["token_ids"] = short["token_ids"][:3]
    assert chain.stored(short) == []
    assert len(chain) == 0
    chain.stored(stored(digests, 0, 2))
    chain.clear()
    assert len(chain) == 0 and chain.stored(stored(digests, 2, 1)) == []


def test_event_fields_reads_maps_and_arrays() -> None:
    assert event_fields({"type": "AllBlocksCleared"}) == {"type": "AllBlocksCleared"}
    assert event_fields(["BlockRemoved", [1, 2], "GPU"]) == {
        "type": "BlockRemoved",
        "block_hashes": [1, 2],
        "medium": "GPU",
    }
    assert event_fields(["Unknown"]) is None and event_fields(42) is None


def test_source_specs() -> None:
    src = parse_source("vllm-a=tcp://127.0.0.1:5557?model=tiny&block_size=32&url=http://127.0.0.1:8000")
    assert (src.engine_id, src.endpoint, src.model, src.block_size) == (
        "vllm-a",
        "tcp://127.0.0.1:5557",
        "tiny",
        32,
    )
    info = src.engine_info()
    assert info.labels["kvbroker.source"] == "kv-events" and info.labels["url"] == "http://127.0.0.1:8000"
    assert len(parse_sources("a=tcp://h:1?model=m&block_size=16, b=tcp://h:2?model=m&block_size=16")) == 2
    for bad, words in [
        ("tcp://h:1", "ENGINE_ID="),
        ("a=http://h:1?model=m&block_size=1", "tcp://"),
        ("a=tcp://h:1?model=m", "block_size"),
        ("a=tcp://h:1?model=m&block_size=x", "not an integer"),
        ("a=tcp://h:1?model=m&block_size=4&colour=red", "unknown option"),
        ("a=tcp://h:1?model=m&block_size=4 a=tcp://h:2?model=m&block_size=4", "twice"),
    ]:
        with pytest.raises(InvalidArgument, match=words):
            parse_sources(bad)

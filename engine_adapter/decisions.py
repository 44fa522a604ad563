"""Pure decisions of the scheduler side: pull or recompute, and how many blocks.

No vLLM, no broker, no clock: inputs in, a decision out, so every branch is
unit-tested with plain values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbroker.v1 import broker_pb2 as pb

# Reasons a pull is skipped; they appear in the log line and in the stats.
SKIP_NO_BROKER = "broker_unavailable"
SKIP_TIMEOUT = "broker_timeout"
SKIP_NO_HOLDER = "no_holder"
SKIP_LOCAL = "local_hit_covers_remote"
SKIP_THRESHOLD = "below_threshold"
SKIP_BAD_PARAMS = "malformed_kv_transfer_params"
SKIP_ERROR = "broker_error"
SKIP_INCOMPATIBLE = "incompatible_holder"


@dataclass(frozen=True)
class PullPlan:
    """What to pull, in positions of the request's block chain."""

    holder_engine_id: str
    tier: int
    hold_lease_id: str
    first_block: int  # chain position of the first block to read (= local full blocks)
    num_blocks: int  # blocks to read
    num_tokens: int  # tokens vLLM counts as external (may end inside the last block)


@dataclass(frozen=True)
class Decision:
    plan: PullPlan | None
    reason: str  # skip reason when plan is None, else "pull"
    detail: str = ""


def decide_pull(
    *,
    matches: Sequence[pb.HolderMatch],
    self_engine_id: str,
    num_prompt_tokens: int,
    num_local_tokens: int,
    block_size: int,
    threshold_tokens: int,
    preferred_holder: str = "",
    local_cpu_blocks: int = 0,
) -> Decision:
    """Pull when the best other holder's prefix beyond the local hit is worth it.

    ``local_cpu_blocks``: how much of the chain this engine's own CPU tier holds;
    when no other holder has more, the plan restores from there (holder = self).

    vLLM must compute at least the prompt's final token itself, so the
    external part ends at ``num_prompt_tokens - 1``; the block holding that
    token is still read in full (its other tokens are valid) and vLLM
    recomputes the final token into it.
    """
    candidates = [m for m in matches if m.engine_id != self_engine_id and m.matched_blocks > 0]
    if local_cpu_blocks > 0 and all(local_cpu_blocks >= m.matched_blocks for m in candidates):
        # This engine's own CPU tier has as much as anyone: a local copy beats any read.
        own = pb.HolderMatch(engine_id=self_engine_id, tier=pb.TIER_CPU, matched_blocks=local_cpu_blocks)
        candidates.insert(0, own)
    if not candidates:
        return Decision(None, SKIP_NO_HOLDER, "the broker knows no other holder of this prefix")
    best = candidates[0]
    if preferred_holder:
        # The router's hint (from P's kv_transfer_params) wins among equals.
        for m in candidates:
            if m.engine_id == preferred_holder and m.matched_blocks >= best.matched_blocks:
                best = m
                break
    local_blocks = num_local_tokens // block_size
    covered_tokens = min(best.matched_blocks * block_size, num_prompt_tokens - 1)
    remote_tokens = covered_tokens - num_local_tokens
    if remote_tokens <= 0:
        return Decision(
            None,
            SKIP_LOCAL,
            f"local hit {num_local_tokens} tokens >= remote {covered_tokens} tokens on {best.engine_id}",
        )
    if remote_tokens < threshold_tokens:
        return Decision(
            None,
            SKIP_THRESHOLD,
            f"remote part {remote_tokens} tokens on {best.engine_id} < kv_recompute_threshold {threshold_tokens}",
        )
    end_block = -(-(num_local_tokens + remote_tokens) // block_size)  # ceil
    plan = PullPlan(
        holder_engine_id=best.engine_id,
        tier=int(best.tier),
        hold_lease_id=best.hold_lease_id,
        first_block=local_blocks,
        num_blocks=end_block - local_blocks,
        num_tokens=remote_tokens,
    )
    return Decision(plan, "pull", f"{remote_tokens} tokens from {best.engine_id}")


@dataclass(frozen=True)
class TransferParams:
    """The parts of a request's kv_transfer_params this adapter reads."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    holder_engine_id: str = ""
    lease_id: str = ""
    # The holder's request id of its hold: a reader that will not pull declines it by this.
    hold_request_id: str = ""
    reader_engine_id: str = ""  # P side: the decoder the router chose, if it says
    trace_context: Mapping[str, str] | None = None
    # The named holder's parallel sizes, as its answer stated them (0 = not stated).
    holder_tp_size: int = 0
    holder_pp_size: int = 0
    # This request's pull-or-recompute rule, when the caller names one ("" / None: the engine's).
    pull_policy: str = ""
    recompute_threshold: int | None = None
    # The holder's fitted prefill (a s, b s per 1k tokens, c s per 1M pairs), if it sent one.
    holder_prefill: tuple[float, float, float] | None = None


class BadTransferParams(ValueError):
    pass


def parse_transfer_params(params: Any) -> TransferParams:
    """Read kv_transfer_params strictly: a wrong type is an error, not a guess."""
    if params is None:
        return TransferParams()
    if not isinstance(params, Mapping):
        raise BadTransferParams(f"kv_transfer_params must be an object, got {type(params).__name__}")
    flags = {}
    for key in ("do_remote_decode", "do_remote_prefill"):
        value = params.get(key, False)
        if value is None:
            value = False
        if not isinstance(value, bool):
            raise BadTransferParams(f"kv_transfer_params.{key} must be true or false, got {value!r}")
        flags[key] = value
    broker_part = params.get("kvbroker") or {}
    if not isinstance(broker_part, Mapping):
        raise BadTransferParams(
            f"kv_transfer_params.kvbroker must be an object, got {type(broker_part).__name__}"
        )
    holder = broker_part.get("holder_engine_id", "") or ""
    lease_id = broker_part.get("lease_id", "") or ""
    reader = broker_part.get("reader_engine_id", "") or ""
    hold_request_id = broker_part.get("hold_request_id", "") or ""
    if not all(isinstance(v, str) for v in (holder, lease_id, reader, hold_request_id)):
        raise BadTransferParams(
            "kv_transfer_params.kvbroker.holder_engine_id, lease_id, hold_request_id and "
            "reader_engine_id must be strings"
        )
    sizes = {}
    for key in ("tp_size", "pp_size"):
        value = broker_part.get(key, 0) or 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadTransferParams(
                f"kv_transfer_params.kvbroker.{key} must be a positive integer (0 or absent: not stated), got {value!r}"
            )
        sizes[key] = value
    policy = broker_part.get("pull_policy", "") or ""
    if policy not in ("", "adaptive", "threshold"):
        raise BadTransferParams(
            f"kv_transfer_params.kvbroker.pull_policy must be adaptive or threshold, got {policy!r}"
        )
    threshold = broker_part.get("kv_recompute_threshold")
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0
    ):
        raise BadTransferParams(
            f"kv_transfer_params.kvbroker.kv_recompute_threshold must be an integer >= 0, got {threshold!r}"
        )
    if threshold is not None and not policy:
        policy = "threshold"  # a threshold named alone is the fixed rule, as in the extra config
    holder_prefill = _prefill_model(broker_part.get("prefill_model"))
    trace = params.get("trace_context")
    if trace is not None and not (
        isinstance(trace, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in trace.items())
    ):
        raise BadTransferParams("kv_transfer_params.trace_context must map strings to strings")
    return TransferParams(
        do_remote_decode=flags["do_remote_decode"],
        do_remote_prefill=flags["do_remote_prefill"],
        holder_engine_id=holder,
        lease_id=lease_id,
        hold_request_id=hold_request_id,
        reader_engine_id=reader,
        trace_context=trace,
        holder_tp_size=sizes["tp_size"],
        holder_pp_size=sizes["pp_size"],
        pull_policy=policy,
        recompute_threshold=threshold,
        holder_prefill=holder_prefill,
    )


PREFILL_MODEL_KEYS = ("step_ms", "ms_per_1k_tokens", "ms_per_1m_pairs")


def _prefill_model(value: Any) -> tuple[float, float, float] | None:
    """kvbroker.prefill_model: the holder's prefill fit in ms, as holds.py sends it (seconds out)."""
    if value is None:
        return None
    numbers = [value.get(k) for k in PREFILL_MODEL_KEYS] if isinstance(value, Mapping) else []
    if len(numbers) != 3 or not all(
        isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in numbers
    ):
        raise BadTransferParams(
            "kv_transfer_params.kvbroker.prefill_model must map "
            + ", ".join(PREFILL_MODEL_KEYS)
            + f" to numbers >= 0, got {value!r}"
        )
    a, b, c = (float(x) / 1000.0 for x in numbers)  # type: ignore[arg-type]
    return a, b, c


def wire_hashes(block_hashes: Sequence[bytes]) -> list[int]:
    """vLLM block hashes -> wire hashes (first 8 bytes, big-endian)."""
    return [int.from_bytes(bytes(h)[:8], "big") for h in block_hashes]


def holdable_blocks(num_computed_tokens: int, num_hashes: int, num_block_ids: int, block_size: int) -> int:
    """Full blocks of a finished request whose KV was actually computed.

    The last sampled token never went through the model, so a block counts
    only when every one of its tokens was computed.
    """
    return max(0, min(num_computed_tokens // block_size, num_hashes, num_block_ids))


# Domain of the partial-block hash: no vLLM block hash (a digest of a pickled or
# CBOR-encoded tuple) starts its input with these bytes, so a tail's wire hash
# cannot name a full block, whatever the tokens.
_TAIL_DOMAIN = b"kvbroker/partial-block/v1\x00"


def tail_hash(parent: bytes, tokens: Sequence[int]) -> int:
    """Wire hash of a prompt's last, partial block: its parent's digest and its tokens.

    vLLM hashes only full blocks, so the tokens that end a prompt inside a block
    have no name in its prefix cache. P (which computed them) and D (which is
    given the same prompt) compute this same value, so D can read that block
    too and compute only the prompt's last token instead of up to a block.
    The parent's digest carries everything vLLM keys a block on (salt, LoRA).
    """
    body = b"".join(int(t).to_bytes(4, "big") for t in tokens)
    digest = hashlib.sha256(_TAIL_DOMAIN + bytes(parent) + len(tokens).to_bytes(2, "big") + body).digest()
    return int.from_bytes(digest[:8], "big")


def prompt_tail(request: Any, num_tokens: int, block_size: int) -> tuple[int, int] | None:
    """(full blocks, tail's wire hash) when a request's first ``num_tokens`` end inside a block.

    None when they end on a block boundary, when there is no full block to
    chain from (a shorter prompt is not worth a lease), when the request's
    tokens are not readable, or when it has multi-modal inputs (their keys may
    fall in the tail, which the parent's digest does not cover).
    """
    full, rest = divmod(num_tokens, block_size)
    if full == 0 or rest == 0 or getattr(request, "mm_features", None):
        return None
    token_ids = getattr(request, "all_token_ids", None)
    hashes = request.block_hashes
    if token_ids is None or len(token_ids) < num_tokens or len(hashes) < full:
        return None
    return full, tail_hash(hashes[full - 1], token_ids[full * block_size : num_tokens])

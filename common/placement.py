"""Data-parallel placement: which engine takes a whole request, weighing its load against locality.

On a data-parallel fleet (every engine serves whole requests, each in
``kv_both`` with our connector) any engine can serve any request, and an
engine that lacks the prompt's prefix can pull it from the engine that holds
it (the connector asks the broker and pulls over NIXL; its own adaptive cost
model then decides pull or recompute with measured timings). So the question
the proxy answers is not "who holds the prefix" but "where does the first
token come soonest". ``place`` predicts that, in prompt-token equivalents,
for every candidate engine ``e``:

    cost(e) = computed(e) + pull(e) + backlog(e) + busy_tokens * load(e) + neighbour_cost * computed(e) * load(e)

- ``computed``: the prompt's tokens ``e`` would compute: all but the longest
  prefix it can reuse, its own (GPU or CPU tier) or, when engines pull from
  each other and a pull is quicker than computing, the longest any engine holds;
- ``pull``: what pulling the rest from the holder costs, when ``e`` pulls:
  ``pull_fixed_tokens`` (the reader waits for a lease, a read and vLLM's
  notice, each at one of its own scheduler steps) plus ``pull_token_cost``
  per pulled token. Where that is more than computing those tokens, ``e``
  computes them instead, as the connector's adaptive policy would;
- ``backlog``: prompt tokens of the requests sent to ``e`` that it has not
  yet computed (their first byte has not come; the proxy's own count): a
  prefill queued ahead delays the request token for token;
- ``load``: requests in flight on ``e`` (the larger of what this proxy sent it
  and the load it heartbeats to the broker); each one ahead of the request
  costs it ``busy_tokens`` of waiting;
- the last term is what the request costs the others: while ``e`` computes
  the prompt, each request already running there waits too. Without it a
  busy holder's turn moves to an engine that is itself busy, and the fleet
  computes more in all (a saturated fleet's goodput falls; prefix affinity,
  which never moves a turn, then wins).

The cheapest engine is first, the rest follow in cost order (the failover
order). Ties go to the less loaded engine, then to the rotation, so that new
conversations spread out. A prompt whose longest held prefix is under
``min_prefix_tokens`` is not steered by locality at all: it is balanced by
load. Each placement says why (``reason``, one of the ``DP_*`` labels, a
counter label in the proxy's /metrics and an attribute of the request's span)
and how (``detail``, with the figures). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Why an engine was placed first (kvbroker_proxy_route_choices_total{reason}).
DP_NOT_SCORED = "dp_not_scored"  # the prompt was not scored (no broker, not tokenizable): by load
DP_BALANCE = "dp_balance_short_prefix"  # no engine holds a prefix worth steering for: by load
DP_HOLDER = "dp_holder"  # the engine holding the longest prefix is the quickest
DP_PULL = "dp_pull_busy_holder"  # the holder is busier than a pull costs: a free engine pulls
DP_RECOMPUTE = "dp_recompute_busy_holder"  # the holder is busier than a recompute costs (no pulls)
DP_ROUND_ROBIN = "dp_round_robin"  # the rule is round robin: neither load nor prefix counts
DP_REASONS = (DP_NOT_SCORED, DP_BALANCE, DP_HOLDER, DP_PULL, DP_RECOMPUTE, DP_ROUND_ROBIN)


@dataclass(frozen=True)
class PlacementRule:
    """The weights of ``place`` (documented in docs/serving.md, Data-parallel fleets)."""

    busy_tokens: float = 256.0  # prompt tokens of waiting that one request in flight on an engine costs
    pull_token_cost: float = 0.1  # a pulled token's cost, as a fraction of computing it
    pull_fixed_tokens: float = 160.0  # a pull's own wait (lease, read, notice: reader steps), in tokens
    neighbour_cost: float = 1.0  # per request in flight on the engine, per prompt token it computes
    min_prefix_tokens: int = 64  # a longest held prefix under this is not steered for: balance by load
    pull: bool = True  # engines pull prefixes from each other (our connector, kv_both)
    round_robin: bool = False  # the baseline: each engine in turn, whatever it holds or runs


@dataclass(frozen=True)
class Candidate:
    """One engine as ``place`` sees it."""

    name: str
    held_tokens: int  # prompt tokens it holds as a prefix (GPU or its CPU tier)
    load: float  # requests in flight on it
    backlog_tokens: float = 0.0  # prompt tokens of requests sent to it that it has yet to compute


@dataclass(frozen=True)
class Placement:
    order: tuple[int, ...]  # indices into the candidates, the chosen one first
    reason: str  # a DP_* label
    detail: str  # the figures, for the span and logs
    pull_from: str = ""  # the holder the first engine is expected to pull from ("" none)
    costs: tuple[float, ...] = ()  # predicted cost per candidate (same indices), token equivalents
    # Per candidate (same indices): (tokens computed, tokens pulled, load), the terms of its cost.
    terms: tuple[tuple[int, int, float], ...] = ()


def _by_load(candidates: Sequence[Candidate], rotation: int) -> list[int]:
    n = len(candidates)
    rotated = [(rotation + i) % n for i in range(n)]
    return sorted(rotated, key=lambda i: candidates[i].load)  # stable: the rotation among equals


def place(
    num_tokens: int | None,
    candidates: Sequence[Candidate],
    rule: PlacementRule = PlacementRule(),
    rotation: int = 0,
) -> Placement:
    """The candidates in order of predicted time to first token for a ``num_tokens`` prompt."""
    if not candidates:
        return Placement((), DP_NOT_SCORED, "no engine")
    if rule.round_robin:
        n = len(candidates)
        return Placement(tuple((rotation + i) % n for i in range(n)), DP_ROUND_ROBIN, "round robin")
    if num_tokens is None:
        order = _by_load(candidates, rotation)
        return Placement(tuple(order), DP_NOT_SCORED, "prompt not scored: least loaded engine")
    held = [max(0, min(c.held_tokens, num_tokens)) for c in candidates]
    longest = max(held)
    if longest < rule.min_prefix_tokens:
        order = _by_load(candidates, rotation)
        detail = (
            f"longest held prefix {longest} tokens < {rule.min_prefix_tokens}: least loaded engine "
            f"(load {candidates[order[0]].load:g})"
        )
        balanced = tuple((num_tokens - h, 0, max(0.0, c.load)) for h, c in zip(held, candidates, strict=True))
        return Placement(tuple(order), DP_BALANCE, detail, terms=balanced)
    costs: list[float] = []
    sources: list[int | None] = []
    terms: list[tuple[int, int, float]] = []
    for i, c in enumerate(candidates):
        others = [j for j in range(len(candidates)) if j != i]
        best = max(others, key=lambda j: held[j], default=None)
        reuse, pulled, source, pull_cost = held[i], 0, None, 0.0
        if rule.pull and best is not None and held[best] > held[i]:
            gap = held[best] - held[i]
            price = rule.pull_fixed_tokens + rule.pull_token_cost * gap
            if price < gap:  # else the engine computes the gap: quicker than pulling it
                reuse, pulled, source, pull_cost = held[best], gap, best, price
        load = max(0.0, c.load)
        terms.append((num_tokens - reuse, pulled, load))
        computed = terms[i][0]
        queued = max(0.0, c.backlog_tokens)
        own = computed + pull_cost + queued + rule.busy_tokens * load
        costs.append(own + rule.neighbour_cost * computed * load)
        sources.append(source)
    n = len(candidates)
    rotated = [(rotation + i) % n for i in range(n)]
    order = sorted(rotated, key=lambda i: (costs[i], candidates[i].load))
    first = order[0]
    holder = max(range(n), key=lambda j: (held[j], -candidates[j].load))
    fig = (
        f"{candidates[first].name}: cost {costs[first]:.0f} (holds {held[first]} of {num_tokens} tokens, "
        f"load {candidates[first].load:g})"
    )
    if held[first] >= longest:
        return Placement(tuple(order), DP_HOLDER, fig, costs=tuple(costs), terms=tuple(terms))
    vs = (
        f"; holder {candidates[holder].name}: cost {costs[holder]:.0f} (holds {held[holder]}, "
        f"load {candidates[holder].load:g})"
    )
    source = sources[first]
    if source is not None:
        pulled = held[source] - held[first]
        return Placement(
            tuple(order),
            DP_PULL,
            f"{fig}, pulls {pulled} tokens from {candidates[source].name}{vs}",
            pull_from=candidates[source].name,
            costs=tuple(costs),
            terms=tuple(terms),
        )
    return Placement(
        tuple(order), DP_RECOMPUTE, f"{fig}, recomputes{vs}", costs=tuple(costs), terms=tuple(terms)
    )

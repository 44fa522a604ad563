"""Which engines get a request: prompt -> token ids -> block hashes -> broker Score.

The broker answers, per engine, how many leading blocks of the prompt it holds
on GPU and on its CPU tier. Engines that hold part of the prompt are tried
first, in the broker's order (longest prefix, GPU before CPU, lower load);
engines that hold nothing follow, least loaded first and rotated so new
conversations spread out. No conversation table: turn 2 of a chat lands where
turn 1's blocks are because its prompt starts with them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvbroker.clients.proxy.config import EngineSpec
from kvbroker.clients.proxy.engines import EngineLayout, EnginePool
from kvbroker.common.hashing import wire_chain
from kvbroker.common.placement import DP_PULL, Candidate, Placement, PlacementRule, place
from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger("kvbroker.proxy")

# Keys of a chat request that change how /tokenize renders the prompt.
_CHAT_TOKENIZE_KEYS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


@dataclass
class PrefixMatch:
    gpu_blocks: int = 0
    cpu_blocks: int = 0


@dataclass
class Route:
    """Ordered candidates for both roles, and why they are in that order."""

    prefill: list[EngineSpec]
    decode: list[EngineSpec]
    num_tokens: int | None = None
    num_blocks: int = 0
    matches: dict[str, PrefixMatch] = field(default_factory=dict)  # engine_id -> match
    loads: dict[str, float] = field(default_factory=dict)  # engine_id -> load, as Score answered it
    scored: bool = False
    note: str = ""  # why there are no scores, when there are none
    block_size: int = 0  # of the layout the prompt was hashed for
    hashes: list[int] = field(default_factory=list)  # the prompt's chain, as scored (retain.py)
    namespace: pb.Namespace | None = None  # the namespace it was scored in

    def held_tokens(self, engine: EngineSpec) -> int:
        """Tokens of the prompt `engine` holds (GPU or its CPU tier), as the broker scored it."""
        match = self.matches.get(engine.engine_id)
        if match is None or not self.block_size:
            return 0
        held = max(match.gpu_blocks, match.cpu_blocks) * self.block_size
        return min(held, self.num_tokens) if self.num_tokens is not None else held

    def load_of(self, engine: EngineSpec, pool: EnginePool) -> float:
        """Requests on `engine`: this proxy's in flight there or, when larger, the load the engine
        heartbeat to the broker (as this request's Score answered it, else the engine list's)."""
        reported = self.loads.get(engine.engine_id, pool.load_of(engine))
        return max(float(pool.in_flight(engine)), reported)

    def local_prefill(self, engine: EngineSpec, limit: int) -> int | None:
        """Tokens `engine` would compute itself if it served the request alone, when it holds a
        prefix of the prompt (GPU or its CPU tier) and at most `limit` tokens are left; else None."""
        match = self.matches.get(engine.engine_id)
        if limit <= 0 or match is None or self.num_tokens is None or not self.block_size:
            return None
        held = max(match.gpu_blocks, match.cpu_blocks) * self.block_size
        left = self.num_tokens - min(held, self.num_tokens)
        return left if held > 0 and left <= limit else None


def order_engines(
    engines: Sequence[EngineSpec],
    scores: Sequence[pb.EngineScore] | None,
    pool: EnginePool,
    rotation: int,
) -> list[EngineSpec]:
    """Engines holding part of the prompt first (broker order); then the rest by load, rotated."""
    by_id = {e.engine_id: e for e in engines if e.engine_id}
    placed: list[EngineSpec] = []
    for s in scores or ():
        engine = by_id.get(s.engine_id)
        if engine is not None and (s.gpu_blocks or s.cpu_blocks) and not s.draining and engine not in placed:
            placed.append(engine)
    rest = [e for e in engines if e not in placed]
    if rest:
        k = rotation % len(rest)
        rest = rest[k:] + rest[:k]
        # Stable sort keeps the rotation among equals.
        rest.sort(key=lambda e: (pool.is_cooling_down(e), pool.is_draining(e), pool.load_of(e)))
    # A cooling-down engine goes last even if it holds the prefix: it just failed.
    ordered = placed + rest
    return [e for e in ordered if not pool.is_cooling_down(e)] + [
        e for e in ordered if pool.is_cooling_down(e)
    ]


def dp_order(
    route: Route, engines: Sequence[EngineSpec], pool: EnginePool, rule: PlacementRule, rotation: int
) -> tuple[list[EngineSpec], Placement | None]:
    """Engines for a whole request on a data-parallel fleet, in placement order (common/placement.py):
    healthy ones by predicted time to first token, then those cooling down after a failure."""
    # A fixed base order (the route's lists come rotated already): the placement rotates ties.
    healthy = sorted((e for e in engines if not pool.is_cooling_down(e)), key=lambda e: e.url)
    cooling = [e for e in engines if pool.is_cooling_down(e)]
    if not healthy:
        return cooling, None
    candidates = [
        Candidate(e.label, route.held_tokens(e), route.load_of(e, pool), pool.backlog_of(e)) for e in healthy
    ]
    placed = place(route.num_tokens if route.scored else None, candidates, rule, rotation)
    return [healthy[i] for i in placed.order] + cooling, placed


def pull_params(placed: Placement | None, rule: PlacementRule) -> dict[str, Any] | None:
    """kv_transfer_params for the engine a placement sent a request to pull: the fixed rule
    (`kv_recompute_threshold`) at the shortest missing part the placement finds worth pulling, so the
    engine pulls, as the placement priced, instead of recomputing by its own estimate (a turn moved
    off a busy holder to pull and then recomputed costs the fleet the most of all three ways). None
    unless the placement chose a pull. The engine still picks the holder and the blocks."""
    if placed is None or placed.reason != DP_PULL or rule.pull_token_cost >= 1.0:
        return None
    worth = rule.pull_fixed_tokens / (1.0 - rule.pull_token_cost)  # pulled where fixed + cost * gap < gap
    return {"kvbroker": {"kv_recompute_threshold": max(1, math.ceil(worth))}}


def placed_backlog(order: Sequence[EngineSpec], placed: Placement) -> dict[str, float]:
    """Engine url -> prompt tokens the placement predicts it computes (dp_order's engines and placement)."""
    if not placed.terms:
        return {}
    return {order[k].url: float(placed.terms[i][0]) for k, i in enumerate(placed.order)}


def tokenize_body(endpoint: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The /tokenize request that renders this request's prompt, or None if it has no single prompt."""
    model = body.get("model")
    if endpoint.endswith("chat/completions"):
        if not isinstance(body.get("messages"), list):
            return None
        out = {k: body[k] for k in _CHAT_TOKENIZE_KEYS if k in body}
        out.setdefault("add_generation_prompt", True)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None
        out = {"prompt": prompt}
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
    if model is not None:
        out["model"] = model
    return out


def literal_token_ids(endpoint: str, body: Mapping[str, Any]) -> list[int] | None:
    """Token ids given directly as the prompt (`"prompt": [1, 2, 3]`)."""
    if endpoint.endswith("chat/completions"):
        return None
    prompt = body.get("prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    return None


async def fetch_token_ids(
    http: aiohttp.ClientSession,
    engine: EngineSpec,
    endpoint: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    timeout_s: float,
) -> list[int] | None:
    """The prompt's token ids as the engine sees them (its /tokenize applies the chat template)."""
    literal = literal_token_ids(endpoint, body)
    if literal is not None:
        return literal
    request = tokenize_body(endpoint, body)
    if request is None:
        return None
    try:
        async with http.post(
            f"{engine.url}/tokenize",
            json=request,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            if resp.status != 200:
                log.debug("tokenize on %s: HTTP %d", engine.label, resp.status)
                return None
            data = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        log.debug("tokenize on %s failed: %s", engine.label, e)
        return None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    return tokens if isinstance(tokens, list) else None


def namespace_tenant(config_tenant: str, cache_salt: Any) -> str:
    """The namespace tenant the engines' adapters use: TENANT/salt with a tenant, else the salt."""
    salt = cache_salt if isinstance(cache_salt, str) else ""
    return f"{config_tenant}/{salt}" if config_tenant else salt


def hashes_for(tokens: Sequence[int], layout: EngineLayout, cache_salt: Any) -> list[int]:
    salt = cache_salt if isinstance(cache_salt, str) and cache_salt else None
    return wire_chain(tokens, layout.block_size, layout.hash_algo, cache_salt=salt)


def pick_layout(pool: EnginePool, engines: Sequence[EngineSpec]) -> EngineLayout | None:
    """The layout of the first candidate the broker knows (all candidates of one model share it)."""
    for e in engines:
        layout = pool.layout_of(e)
        if layout is not None and layout.block_size > 0:
            return layout
    return None


class Router:
    """Builds a Route per request: tokenize on an engine, hash, ask the broker, order."""

    def __init__(
        self,
        pool: EnginePool,
        broker: Any | None,  # clients.aio.AsyncBrokerClient
        http: aiohttp.ClientSession,
        *,
        tenant: str = "",
        score_timeout_s: float = 0.5,
        require_exact: bool = False,
    ) -> None:
        self.pool = pool
        self.broker = broker
        self.http = http
        self.tenant = tenant
        self.score_timeout_s = score_timeout_s
        self.require_exact = (
            require_exact  # Score's require_exact: ignore engines the index may be wrong about
        )
        self._rotation = 0

    async def route(self, endpoint: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> Route:
        from kvbroker.clients.errors import BrokerError

        prefill = self.pool.candidates("prefill")
        decode = self.pool.candidates("decode")
        self._rotation += 1
        route = Route(prefill, decode)
        scores: list[pb.EngineScore] | None = None
        try:
            scores = await self._score(endpoint, body, headers, route)
        except BrokerError as e:
            route.note = f"broker score failed: {e.code}: {e.message}"
        if scores is not None:
            route.scored = True
            for s in scores:
                route.matches[s.engine_id] = PrefixMatch(s.gpu_blocks, s.cpu_blocks)
                route.loads[s.engine_id] = s.load
        route.prefill = order_engines(prefill, scores, self.pool, self._rotation)
        route.decode = order_engines(decode, scores, self.pool, self._rotation)
        return route

    async def _score(
        self, endpoint: str, body: Mapping[str, Any], headers: Mapping[str, str], route: Route
    ) -> list[pb.EngineScore] | None:
        if self.broker is None:
            route.note = "no broker"
            return None
        everyone = route.prefill + [e for e in route.decode if e not in route.prefill]
        layout = pick_layout(self.pool, everyone)
        if layout is None:
            route.note = "broker does not know these engines yet"
            return None
        tokenizer = next((e for e in everyone if not self.pool.is_cooling_down(e)), None)
        if tokenizer is None:
            route.note = "no engine to tokenize on"
            return None
        tokens = await fetch_token_ids(
            self.http, tokenizer, endpoint, body, headers, self.score_timeout_s * 4
        )
        if tokens is None:
            route.note = "prompt not tokenizable (batch prompt or tokenize failed)"
            return None
        route.num_tokens = len(tokens)
        route.block_size = layout.block_size
        hashes = hashes_for(tokens, layout, body.get("cache_salt"))
        route.num_blocks = len(hashes)
        if not hashes:
            route.note = "prompt shorter than one block"
            return None
        same_layout = [
            e.engine_id
            for e in everyone
            if (lo := self.pool.layout_of(e)) and lo.layout_id == layout.layout_id
        ]
        route.hashes = hashes
        route.namespace = pb.Namespace(
            layout_id=layout.layout_id, tenant=namespace_tenant(self.tenant, body.get("cache_salt"))
        )
        response = await self.broker.score(
            namespace=route.namespace,
            block_hashes=hashes,
            candidates=same_layout,
            require_exact=self.require_exact,
            timeout=self.score_timeout_s,
        )
        return list(response.scores)

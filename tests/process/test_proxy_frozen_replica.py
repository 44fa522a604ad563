"""The P/D proxy's broker calls when one of two replicas freezes (SIGSTOP): routing never stalls.

A real process tree: two `kvbroker serve --state redis://...` replicas over a real redis-server;
P and D are engine sessions (EngineSession, Python clients, both replicas' addresses) that carry
the `url` and `role` labels the proxy learns engines from; P holds the prompt's blocks. The proxy
is the real application (`build_app`, its own AsyncBrokerClient from `--broker a,b`, its engine
pool and router); no vLLM engine is needed because the prompt is given as token ids, so routing
asks no engine to tokenize, and the test drives the two broker-facing paths a request and the
proxy's background take: `Router.route` (Score, with the proxy's score deadline) and
`EnginePool.refresh` (ListEngines).

The replica the proxy talks to is frozen while routes run one after another. Asserted: every route
answered within its Score deadline (plus scheduling slack), never waiting for gRPC's keepalive;
every route after the first one that met the frozen replica was scored by the other replica (P
first, with its whole prompt held); the engine list refreshes within its deadline; and after the
replica thaws, routing still answers from the replica the client moved to.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from fault_harness import SLACK_S, freeze, thaw
from process_harness import replica

from kvbroker.clients.clock import Backoff
from kvbroker.clients.engine_session import EngineSession
from kvbroker.clients.proxy.config import ProxyConfig
from kvbroker.clients.proxy.routing import hashes_for
from kvbroker.clients.proxy.server import STATE_KEY, build_app
from kvbroker.v1 import broker_pb2 as pb
from testkit import builders
from testkit.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

GPU = pb.TIER_GPU
# The proxy's --score-timeout (default 0.5 s): 1 s here, so that a loaded machine's slow answer
# from the live replica is not taken for a stall (each try still gets half of it).
SCORE_DEADLINE_S = 1.0
PROMPT = list(range(1000, 1000 + 32 * 4))  # four blocks of the test layout's 32 tokens
FROZEN_S = 3.0


def _engine(engine_id: str, role: str) -> pb.EngineInfo:
    # Nobody listens at these URLs: the test routes, it does not forward.
    url = {"P": "http://127.0.0.1:9/p", "D": "http://127.0.0.1:9/d"}[engine_id]
    return builders.engine_info(engine_id, ranks=1, labels={"url": url, "role": role})


async def test_a_frozen_replica_does_not_stall_the_proxys_routing(tmp_path: Path, store: RedisServer) -> None:
    a, b = replica(tmp_path, store, "a").start(), replica(tmp_path, store, "b").start()
    fast = Backoff(initial_s=0.05, max_s=0.5)
    # The engines sit on b: the proxy's replica (a) is the one that freezes.
    p = EngineSession(f"{b.address},{a.address}", _engine("P", "prefill"), ttl_ms=5_000, backoff=fast)
    d = EngineSession(f"{b.address},{a.address}", _engine("D", "decode"), ttl_ms=5_000, backoff=fast)
    app = build_app(ProxyConfig(broker=f"{a.address},{b.address}", score_timeout_s=SCORE_DEADLINE_S))
    state = app[STATE_KEY]
    stopped = False
    try:
        await p.start(wait_connected_s=10.0)
        await d.start(wait_connected_s=10.0)
        assert await state.pool.refresh(state.broker)
        assert {e.engine_id for e in state.pool.engines} == {"P", "D"}
        holder = next(e for e in state.pool.engines if e.engine_id == "P")
        layout = state.pool.layout_of(holder)
        assert layout is not None
        hashes = hashes_for(PROMPT, layout, None)
        assert len(hashes) == 4
        p.announce_stored((p.layout_id, ""), GPU, hashes)
        await p.applied()
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 1}

        async def route() -> tuple[float, float, bool, list[str], int]:
            started = time.monotonic()
            r = await state.router.route("/v1/completions", body, {})
            blocks = r.matches["P"].gpu_blocks if "P" in r.matches else 0
            return started, time.monotonic() - started, r.scored, [e.engine_id for e in r.prefill], blocks

        before = await route()
        assert before[2] and before[3][0] == "P" and before[4] == 4, before
        assert state.broker.endpoints.current == a.address

        at = freeze(a.pid)
        stopped = True
        routes = []
        refresh = asyncio.ensure_future(_timed(state.pool.refresh(state.broker)))
        while time.monotonic() - at < FROZEN_S:
            routes.append(await route())
            await asyncio.sleep(0.01)
        refreshed, refresh_s = await refresh
        thaw(a.pid)
        stopped = False
        after = [await route() for _ in range(5)]

        slowest = max(took for _, took, _, _, _ in routes)
        print(
            f"\nfrozen replica: {len(routes)} routes, slowest {slowest * 1000:.0f} ms "
            f"(Score deadline {SCORE_DEADLINE_S * 1000:.0f} ms); engine list refreshed in {refresh_s * 1000:.0f} ms"
        )
        late = [r for r in routes + after if r[1] > SCORE_DEADLINE_S + SLACK_S]
        assert not late, f"routes not answered within the Score deadline: {late}"
        # The first route(s) may lose their Score to the frozen replica; from the move on, every one
        # is scored by the other replica, P first with its whole prompt.
        moved = next(i for i, r in enumerate(routes) if r[2])
        assert moved <= 1, routes[:3]
        assert all(r[2] and r[3][0] == "P" and r[4] == 4 for r in routes[moved:] + after), routes + after
        assert refreshed and refresh_s < 2.0 + SLACK_S  # ListEngines' deadline in the proxy: 2 s
        assert state.broker.endpoints.current == b.address
    finally:
        if stopped:
            thaw(a.pid)
        await state.http.close()
        await state.broker.close()
        await p.close()
        await d.close()
        a.stop()
        b.stop()


async def _timed(call: object) -> tuple[bool, float]:
    started = time.monotonic()
    ok = await call  # type: ignore[misc]
    return bool(ok), time.monotonic() - started

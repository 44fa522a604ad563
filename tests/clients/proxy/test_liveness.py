"""Hung engines behind the proxy, against fake HTTP engines: the first-byte budget, the liveness
check, the broker's sessions, /health and the per-engine metrics. (The same with a real
SIGSTOPped vLLM engine: tests/e2e/test_hung_engine_e2e.py.)"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from kvbroker.clients.errors import Unavailable
from kvbroker.clients.proxy.config import EngineSpec
from kvbroker.clients.proxy.engines import EnginePool
from kvbroker.clients.proxy.liveness import EngineHung, FirstByteWatch
from kvbroker.v1 import broker_pb2 as pb
from testkit.clock import FakeClock
from tests.clients.proxy.test_metrics import _metrics, _value
from tests.clients.proxy.test_proxy import COMPLETION, engines, proxy

pytestmark = pytest.mark.timeout(30)
__all__ = ["engines", "proxy"]

FAST = {"first_byte_timeout_s": 0.3, "probe_timeout_s": 0.3}


async def _health(px: Any) -> tuple[int, dict[str, Any]]:
    async with px.http.get(px.url + "/health") as resp:
        return resp.status, await resp.json()


async def test_a_frozen_decode_engine_is_abandoned_and_another_serves(engines: Any, proxy: Any) -> None:
    p, frozen, d2 = await engines("P"), await engines("D1", mode="frozen"), await engines("D2")
    px = await proxy([p.url], [frozen.url, d2.url], **FAST)
    # Engines that hold nothing are taken in turn: within two requests one is sent to the frozen D1.
    for _ in range(2):
        started = time.monotonic()
        status, headers, raw = await px.post("/v1/completions", COMPLETION)
        took = time.monotonic() - started
        assert status == 200, raw
        assert headers["X-KVBroker-Mode"] == "pd" and headers["X-KVBroker-Decode"] == d2.url
        assert took < 3.0  # budget 0.3 s + probe 0.3 s, then D2; not the 300 s read timeout
    assert len(frozen.completions()) == 1
    status, health = await _health(px)
    assert status == 200
    (bad,) = [e for e in health["engines"] if e["url"] == frozen.url]
    assert bad["healthy"] is False and "no first byte within" in bad["reason"]
    assert "/health did not answer" in bad["reason"]
    body = await _metrics(px)
    assert (
        _value(
            body, f'kvbroker_proxy_engine_failures_total{{engine="{frozen.url}",kind="hung",step="decode"}}'
        )
        == 1
    )
    assert _value(body, f'kvbroker_proxy_engine_retries_total{{engine="{frozen.url}",step="decode"}}') == 1
    assert (
        _value(
            body, f'kvbroker_proxy_engine_healthy{{engine="{frozen.url}",role="decode",url="{frozen.url}"}}'
        )
        == 0
    )
    assert (
        _value(body, f'kvbroker_proxy_engine_healthy{{engine="{d2.url}",role="decode",url="{d2.url}"}}') == 1
    )
    # The next request goes straight to D2: the frozen engine cools down.
    started = time.monotonic()
    status, headers, _ = await px.post("/v1/completions", COMPLETION)
    assert status == 200 and headers["X-KVBroker-Decode"] == d2.url
    assert len(frozen.completions()) == 1 and frozen.health_probes == 1  # not tried, not probed
    assert time.monotonic() - started < 3.0


async def test_a_busy_but_live_engine_keeps_its_request(engines: Any, proxy: Any) -> None:
    """Slower than the budget, but its /health answers: a long prompt on a CPU, not a hang."""
    p, slow = await engines("P"), await engines("D", mode="slow", delay_s=1.2)
    px = await proxy([p.url], [slow.url], **FAST)
    status, headers, raw = await px.post("/v1/completions", COMPLETION)
    assert status == 200, raw
    assert headers["X-KVBroker-Mode"] == "pd" and headers["X-KVBroker-Decode"] == slow.url
    assert len(slow.completions()) == 1  # not abandoned, not sent twice


async def test_a_prefill_engine_that_hangs_is_retried_on_another(engines: Any, proxy: Any) -> None:
    frozen, p2, d = await engines("P1", mode="frozen"), await engines("P2"), await engines("D")
    px = await proxy([frozen.url, p2.url], [d.url], **FAST)
    for _ in range(2):
        status, headers, raw = await px.post("/v1/completions", COMPLETION)
        assert status == 200, raw
        assert headers["X-KVBroker-Prefill"] == p2.url and headers["X-KVBroker-Mode"] == "pd"
    assert len(frozen.completions()) == 1
    body = await _metrics(px)
    assert (
        _value(
            body, f'kvbroker_proxy_engine_failures_total{{engine="{frozen.url}",kind="hung",step="prefill"}}'
        )
        == 1
    )


async def test_when_every_engine_hangs_the_client_gets_a_504_fast(engines: Any, proxy: Any) -> None:
    frozen = await engines("D", mode="frozen")
    px = await proxy([], [frozen.url], **FAST)
    started = time.monotonic()
    status, _, raw = await px.post("/v1/completions", COMPLETION)
    assert time.monotonic() - started < 3.0
    assert status == 504
    error = json.loads(raw)["error"]
    assert error["type"] == "timeout" and error["code"] == 504 and "param" in error
    assert "no first byte within" in error["message"] and frozen.url in error["message"]
    status, health = await _health(px)
    assert status == 503 and health["engines"][0]["healthy"] is False


async def test_a_stream_that_freezes_midway_ends_with_an_error_event(engines: Any, proxy: Any) -> None:
    d = await engines("D", mode="freeze_mid_stream")
    px = await proxy([], [d.url], **FAST)
    started = time.monotonic()
    status, _, raw = await px.post("/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200 and time.monotonic() - started < 3.0
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"].startswith("D")
    error = json.loads(events[-1])["error"]
    assert error["code"] == 504 and "failed mid-stream" in error["message"]


async def test_budget_zero_turns_the_check_off(engines: Any, proxy: Any) -> None:
    p, slow = await engines("P"), await engines("D", mode="slow", delay_s=0.5)
    px = await proxy([p.url], [slow.url], first_byte_timeout_s=0.0)
    status, _, _ = await px.post("/v1/completions", COMPLETION)
    assert status == 200


def _info(engine_id: str, url: str) -> pb.EngineInfo:
    info = pb.EngineInfo(engine_id=engine_id, layout_id="L")
    info.labels["url"] = url
    return info


def test_an_engine_whose_broker_session_ended_is_not_routed_to() -> None:
    clock = FakeClock()
    pool = EnginePool(
        [
            EngineSpec("http://p:1", "prefill"),
            EngineSpec("http://d1:1", "decode"),
            EngineSpec("http://d2:1", "decode"),
        ],
        clock=clock,
    )
    both = [_info("p", "http://p:1"), _info("d1", "http://d1:1"), _info("d2", "http://d2:1")]
    pool.apply_broker_engines(both)
    assert [e.engine_id for e in pool.candidates("decode")] == ["d1", "d2"]
    pool.apply_broker_engines([both[0], both[2]])  # d1's session expired (frozen, dead)
    assert [e.engine_id for e in pool.candidates("decode")] == ["d2"]
    (d1,) = [e for e in pool.engines if e.engine_id == "d1"]
    assert pool.session_gone(d1) and "broker session ended" in pool.unhealthy_reason(d1)
    pool.apply_broker_engines(both)  # it came back (SIGCONT: the connector registers again)
    assert [e.engine_id for e in pool.candidates("decode")] == ["d1", "d2"]
    assert pool.unhealthy_reason(d1) == ""


def test_all_sessions_gone_at_once_is_a_broker_restart_not_all_engines_dead() -> None:
    pool = EnginePool([EngineSpec("http://p:1", "prefill"), EngineSpec("http://d:1", "decode")])
    pool.apply_broker_engines([_info("p", "http://p:1"), _info("d", "http://d:1")])
    pool.apply_broker_engines([])  # a fresh broker before the engines registered again
    assert [e.engine_id for e in pool.candidates("decode")] == ["d"]
    assert [e.engine_id for e in pool.candidates("prefill")] == ["p"]


def test_an_engine_the_broker_never_listed_is_routed_to() -> None:
    """Engines without our connector have no session: no session is not a lost session."""
    pool = EnginePool([EngineSpec("http://d:1", "decode"), EngineSpec("http://p:1", "prefill")])
    pool.apply_broker_engines([_info("p", "http://p:1")])
    assert [e.url for e in pool.candidates("decode")] == ["http://d:1"]
    assert pool.unhealthy_reason(pool.engines[0]) == ""


async def test_a_live_broker_session_outweighs_a_slow_health_probe(engines: Any) -> None:
    """A starved engine may miss a 2 s /health probe but keeps its broker session: it is not
    abandoned while the broker lists it, and is as soon as the broker drops it."""
    frozen = await engines("D", mode="frozen")
    engine = EngineSpec(frozen.url, "decode", "d")
    pool = EnginePool([engine])
    pool.apply_broker_engines([_info("d", frozen.url)])
    async with aiohttp.ClientSession() as http:
        watch = FirstByteWatch(http, pool, budget_s=0.2, probe_timeout_s=0.2)
        async with watch.guard(engine):
            await asyncio.sleep(1.0)  # five budgets, every probe failing: kept, the broker vouches
        pool.apply_broker_engines([])
        pool.apply_broker_engines([_info("other", "http://other:1")])  # d's session ended
        started = time.monotonic()
        with pytest.raises(EngineHung, match="broker session ended"):
            async with watch.guard(engine):
                await asyncio.sleep(5.0)
        assert time.monotonic() - started < 3.0  # one budget (0.2 s), not the step's 5 s
        pool.stale_after_s = 0.0  # a broker list too old says nothing: the probe decides
        pool.apply_broker_engines([_info("d", frozen.url)])
        await asyncio.sleep(0.05)
        with pytest.raises(EngineHung, match="/health did not answer"):
            async with watch.guard(engine):
                await asyncio.sleep(5.0)


def test_engines_missing_from_a_restarted_brokers_list_are_not_dropped_at_once() -> None:
    """After the broker was unreachable, engines register with the new one one by one: those not
    back yet keep being routed to during the grace; one still missing after it is gone."""
    clock = FakeClock()
    pool = EnginePool([EngineSpec("http://p:1", "prefill"), EngineSpec("http://d:1", "decode")], clock=clock)
    pool.apply_broker_engines([_info("p", "http://p:1"), _info("d", "http://d:1")])

    class DownBroker:
        async def list_engines(self, timeout: float) -> Any:
            raise Unavailable("connection refused")

    assert asyncio.run(pool.refresh(DownBroker())) is False
    pool.apply_broker_engines([_info("d", "http://d:1")])  # the new broker: d is back, p not yet
    assert [e.engine_id for e in pool.candidates("prefill")] == ["p"]
    clock.advance(pool.restart_grace_s + 1)
    pool.apply_broker_engines([_info("d", "http://d:1")])  # p never came back: it is gone
    assert pool.candidates("prefill") == []


async def test_an_engine_that_hung_is_not_tried_again_for_the_same_request(engines: Any, proxy: Any) -> None:
    """One engine in both roles, frozen: prefill on it is abandoned, and the single-engine fallback
    does not wait on it a second time: one request, one liveness probe, then the 504. (Counted,
    not timed: one budget here is 0.6 s and two are 1.2 s, and a loaded CI machine has taken
    1.4 s over one.)"""
    frozen = await engines("D", mode="frozen")
    px = await proxy([frozen.url], [frozen.url], **FAST)
    started = time.monotonic()
    status, _, _ = await px.post("/v1/completions", COMPLETION)
    assert status == 504 and time.monotonic() - started < 10.0  # not the 300 s read timeout
    assert len(frozen.completions()) == 1
    assert frozen.health_probes == 1

"""The proxy's /metrics and access log, against fake HTTP engines. (The real P/D path with
two vLLM engines runs the same middleware: tests/e2e/test_serving_e2e.py.)"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from tests.clients.proxy.test_proxy import COMPLETION, dead_url, engines, proxy

pytestmark = pytest.mark.timeout(30)
__all__ = ["engines", "proxy"]  # the fixtures, shared with test_proxy.py


def _value(body: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", body, re.MULTILINE)
    assert match is not None, f"{series} not in /metrics:\n{body}"
    return float(match.group(1))


async def _metrics(px: Any) -> str:
    async with px.http.get(px.url + "/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        return await resp.text()


async def test_requests_are_counted_timed_and_logged_with_their_engines(
    engines: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    p, d = await engines("P"), await engines("D")
    px = await proxy([p.url], [d.url])
    with caplog.at_level(logging.INFO, logger="kvbroker.proxy.access"):
        status, _, _ = await px.post("/v1/completions", COMPLETION, **{"X-Request-Id": "req-7"})
        assert status == 200
        status, _, _ = await px.post("/v1/completions", b"{not json")
        assert status == 400
    body = await _metrics(px)
    assert _value(body, 'kvbroker_proxy_requests_total{mode="pd",path="/v1/completions",status="200"}') == 1
    assert _value(body, 'kvbroker_proxy_requests_total{mode="",path="/v1/completions",status="400"}') == 1
    assert _value(body, 'kvbroker_proxy_request_seconds_count{path="/v1/completions"}') == 2
    assert "process_cpu_seconds_total" in body and "kvbroker_proxy_build_info{" in body
    lines = [r.getMessage() for r in caplog.records if r.name == "kvbroker.proxy.access"]
    assert len(lines) == 2
    assert re.fullmatch(
        rf"POST /v1/completions 200 [0-9.]+ms mode=pd prefill={re.escape(p.url)} decode={re.escape(d.url)} id=req-7",
        lines[0],
    ), lines[0]
    assert lines[1].startswith("POST /v1/completions 400 ") and "prefill=- decode=-" in lines[1]


async def test_a_fallback_is_counted_by_reason(engines: Any, proxy: Any) -> None:
    d = await engines("D")
    px = await proxy([dead_url()], [d.url])
    status, headers, _ = await px.post("/v1/completions", COMPLETION)
    assert status == 200 and headers["X-KVBroker-Mode"] == "single"
    body = await _metrics(px)
    assert _value(body, 'kvbroker_proxy_fallbacks_total{reason="no prefill engine answered"}') == 1
    assert (
        _value(body, 'kvbroker_proxy_requests_total{mode="single",path="/v1/completions",status="200"}') == 1
    )


async def test_unknown_paths_share_one_label_and_metrics_can_be_turned_off(engines: Any, proxy: Any) -> None:
    d = await engines("D")
    px = await proxy([], [d.url])
    for path in ("/wp-admin", "/x/y/z"):
        async with px.http.get(px.url + path) as resp:
            assert resp.status == 404
    body = await _metrics(px)
    assert _value(body, 'kvbroker_proxy_requests_total{mode="",path="other",status="404"}') == 2
    quiet = await proxy([], [d.url], metrics=False, access_log=False)
    async with quiet.http.get(quiet.url + "/metrics") as resp:
        assert resp.status == 404


async def test_chat_time_to_first_byte_is_observed_per_turn(engines: Any, proxy: Any) -> None:
    import json

    p, d = await engines("P"), await engines("D")
    px = await proxy([p.url], [d.url])
    history: list[dict[str, str]] = []
    for turn in range(1, 7):
        history.append({"role": "user", "content": f"question {turn}"})
        for stream in (False, True):
            body = {"model": "m", "messages": history, "max_tokens": 2, "stream": stream}
            status, _, _ = await px.post("/v1/chat/completions", json.dumps(body).encode())
            assert status == 200
        history.append({"role": "assistant", "content": "answer"})
    status, _, _ = await px.post("/v1/completions", COMPLETION)  # not a chat: no turn
    assert status == 200
    metrics = await _metrics(px)
    for turn in ("1", "2", "3", "4"):
        assert _value(metrics, f'kvbroker_proxy_ttft_seconds_count{{turn="{turn}"}}') == 2
    assert _value(metrics, 'kvbroker_proxy_ttft_seconds_count{turn="5+"}') == 4  # turns 5 and 6
    assert 0 < _value(metrics, 'kvbroker_proxy_ttft_seconds_sum{turn="1"}') < 30

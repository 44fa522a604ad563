"""The OpenAI surface of the proxy against fake HTTP engines, with plain HTTP and the official
`openai` package: /v1/responses, /version, /tokenize, /detokenize, and OpenAI-shaped errors for
unknown paths, wrong methods and engine rejections (logged in the access log). The same against
real vLLM engines: tests/e2e/test_hung_engine_e2e.py."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from tests.clients.proxy.test_metrics import _metrics, _value
from tests.clients.proxy.test_proxy import COMPLETION, engines, proxy

pytestmark = pytest.mark.timeout(30)
__all__ = ["engines", "proxy"]


def _is_openai_error(body: Any, status: int) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status
    return dict(error)


async def test_unknown_paths_and_wrong_methods_get_openai_errors(engines: Any, proxy: Any) -> None:
    d = await engines("D")
    px = await proxy([], [d.url])
    async with px.http.get(px.url + "/v1/nope") as resp:
        assert resp.status == 404 and resp.content_type == "application/json"
        error = _is_openai_error(await resp.json(), 404)
    assert error["type"] == "invalid_request_error" and "GET /v1/nope" in error["message"]
    async with px.http.get(px.url + "/v1/completions") as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"
        error = _is_openai_error(await resp.json(), 405)
    assert "GET" in error["message"] and "POST" in error["message"]
    async with px.http.post(px.url + "/health") as resp:
        assert resp.status == 405
        _is_openai_error(await resp.json(), 405)
    status, _, _ = await px.post("/v1/completions", b"{not json")
    assert status == 400
    # Nested past Python's recursion limit: was a bare 500 "Server got itself in trouble".
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        status, _, raw = await px.post(path, b'{"a":' * 5000 + b"1" + b"}" * 5000)
        assert status == 400 and "nests too deeply" in _is_openai_error(json.loads(raw), 400)["message"]


async def test_a_rejected_request_is_logged_with_its_status(
    engines: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    p, d = await engines("P"), await engines("D", mode="reject400")
    px = await proxy([p.url], [d.url])
    with caplog.at_level(logging.INFO, logger="kvbroker.proxy.access"):
        status, _, _ = await px.post("/v1/completions", {**COMPLETION, "max_tokens": 100_000})
    assert status == 400
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvbroker.proxy.access"]
    assert line.startswith("POST /v1/completions 400 ") and f"decode={d.url}" in line
    body = await _metrics(px)
    assert _value(body, 'kvbroker_proxy_requests_total{mode="pd",path="/v1/completions",status="400"}') == 1


async def test_responses_tokenize_detokenize_and_version_are_forwarded(engines: Any, proxy: Any) -> None:
    p, d = await engines("P"), await engines("D")
    px = await proxy([p.url], [d.url])
    status, headers, raw = await px.post("/tokenize", {"model": "tiny", "prompt": "abc"})
    assert status == 200 and headers["X-KVBroker-Mode"] == "single"
    assert json.loads(raw)["tokens"] == [97, 98, 99]
    status, _, raw = await px.post("/detokenize", {"model": "tiny", "tokens": [0, 1, 2]})
    assert status == 200 and json.loads(raw) == {"prompt": "abc"}
    status, _, raw = await px.post("/v1/responses", {"model": "tiny", "input": "hi"})
    assert status == 200 and json.loads(raw)["output"][0]["content"][0]["text"] == "D says hi"
    status, _, raw = await px.post("/v1/responses", {"model": "tiny", "input": 7})
    assert status == 400  # the engine's rejection, passed on
    async with px.http.get(px.url + "/version") as resp:
        assert resp.status == 200
        version = await resp.json()
    assert version["version"] == "0.0.fake" and version["kvbroker"]
    # No P/D split for these: P saw no prefill call.
    assert [s.path for s in p.seen] == []


async def test_whole_requests_fail_over_to_a_live_engine(engines: Any, proxy: Any) -> None:
    frozen, d2 = await engines("D1", mode="frozen"), await engines("D2")
    px = await proxy([], [frozen.url, d2.url], first_byte_timeout_s=0.3, probe_timeout_s=0.3)
    for _ in range(2):
        status, headers, _ = await px.post("/v1/responses", {"model": "tiny", "input": "hi"})
        assert status == 200 and headers["X-KVBroker-Decode"] == d2.url


async def test_the_official_openai_client(engines: Any, proxy: Any) -> None:
    openai = pytest.importorskip("openai")
    p, d = await engines("P"), await engines("D")
    px = await proxy([p.url], [d.url])
    client = openai.OpenAI(base_url=px.url + "/v1", api_key="unused", max_retries=0)

    def calls() -> None:
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello " * 10}], max_tokens=8
        )
        assert chat.choices[0].message.content.startswith("D pulled")
        completion = client.completions.create(model="tiny", prompt="tell me " * 10, max_tokens=8)
        assert completion.choices[0].text.startswith("D pulled")
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi " * 10}], max_tokens=8, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream)
        assert text.startswith("D pulled")
        response = client.responses.create(model="tiny", input="hi")
        assert response.output_text == "D says hi"
        assert [m.id for m in client.models.list()] == ["tiny"]
        with pytest.raises(openai.NotFoundError) as missing:
            client.get("/nothing-here", cast_to=object)
        assert missing.value.status_code == 404 and "unknown path" in str(missing.value)

    await asyncio.to_thread(calls)
    client.close()

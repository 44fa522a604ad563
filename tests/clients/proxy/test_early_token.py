"""Early first tokens (clients/proxy/early_token.py): a request waiting at the proxy past its
first-token goal gets its first token from a one-token request, the rest later, and the client
sees one answer, the same as sent whole. The real-engine counterpart is in
tests/e2e/test_dp_fleet_e2e.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvbroker.clients.proxy.early_token import (
    FirstToken,
    Splice,
    continuation_body,
    eligible,
    first_events,
    first_token_body,
    parse_first,
)
from tests.clients.proxy.test_proxy import engines, proxy

pytestmark = pytest.mark.timeout(60)
__all__ = ["engines", "proxy"]  # the fixtures, shared with test_proxy.py

STREAM = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "stream": True, "temperature": 0}


def next_token(ids: list[int]) -> int:
    """The token model's greedy next token: a function of the whole sequence, so an answer
    computed in two parts equals one computed whole only if the second part sees the first."""
    return (sum(ids) * 7 + len(ids)) % 997 + 3


def model_answer(prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(ids))
        ids.append(out[-1])
    return out


def prompt_ids(prompt: Any) -> list[int]:
    return [1] + [ord(c) % 500 + 3 for c in prompt] if isinstance(prompt, str) else list(prompt)


@dataclass
class TokenEngine:
    """vLLM's /v1/completions as far as early first tokens use it: token ids, streamed or not,
    usage, one engine step per token."""

    step_s: float = 0.1
    fail_one_token: bool = False  # answer a not-streamed request with a 500
    seen: list[dict[str, Any]] = field(default_factory=list)
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    async def start(self) -> TokenEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", lambda _: web.Response(text="ok"))
        self.server = TestServer(app)
        await self.server.start_server()
        return self

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        ids, n = prompt_ids(body["prompt"]), body["max_tokens"]
        answer, asked = model_answer(ids, n), bool(body.get("return_token_ids"))
        rid = f"cmpl-{len(self.seen)}"
        usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
        if not body.get("stream"):
            if self.fail_one_token:
                return web.json_response({"error": {"message": "engine broke"}}, status=500)
            await asyncio.sleep(self.step_s * n)
            choice = {
                "index": 0,
                "text": "".join(f"t{t} " for t in answer),
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_token_ids": ids if asked else None,
                "token_ids": answer if asked else None,
            }
            return web.json_response(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": 7,
                    "model": "m",
                    "choices": [choice],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, t in enumerate(answer):
            await asyncio.sleep(self.step_s)
            choice = {
                "index": 0,
                "text": f"t{t} ",
                "logprobs": None,
                "finish_reason": "length" if i == n - 1 else None,
                "stop_reason": None,
                "prompt_token_ids": ids if asked and i == 0 else None,
                "token_ids": [t] if asked else None,
            }
            chunk = {"id": rid, "object": "text_completion", "created": 9, "model": "m", "choices": [choice]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = {
                "id": rid,
                "object": "text_completion",
                "created": 9,
                "model": "m",
                "choices": [],
                "usage": usage,
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
async def token_engine() -> AsyncIterator[TokenEngine]:
    engine = await TokenEngine().start()
    yield engine
    assert engine.server is not None
    await engine.server.close()


@dataclass
class Streamed:
    events: list[dict[str, Any]]
    first_at: float  # when its first token came, seconds after the requests were sent
    ended_at: float

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for c in e["choices"] for t in (c.get("token_ids") or [])]


async def timed_stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], started: float
) -> Streamed:
    """A streamed request, with when its first token and its end came."""
    events: list[dict[str, Any]] = []
    first_at, buffer = 0.0, b""
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for chunk in resp.content.iter_any():
            buffer += chunk
            *done, buffer = buffer.split(b"\n\n")
            for part in done:
                if part.startswith(b"data: {"):
                    events.append(json.loads(part[len(b"data: ") :]))
                    if not first_at and events[-1]["choices"]:
                        first_at = time.perf_counter() - started
    return Streamed(events, first_at, time.perf_counter() - started)


async def metrics_of(px: Any) -> str:
    async with px.http.get(px.url + "/metrics") as resp:
        return str(await resp.text())


# Which requests, and the two bodies.


@pytest.mark.parametrize(
    ("change", "ok"),
    [
        ({}, True),
        ({"prompt": "hello"}, True),
        ({"stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": True}, True),
        ({"min_tokens": 2, "repetition_penalty": 1.1, "presence_penalty": 0}, True),
        ({"stream": False}, False),  # its first token is its whole answer
        ({"seed": 3}, False),  # a seeded sample promises the same answer as sent whole
        ({"stop": ["\n"]}, False),  # a stop string could span the two parts
        ({"logprobs": 2}, False),
        ({"n": 2}, False),
        ({"n": True}, False),  # not the integer 1
        # Keys at their defaults read as left out (vLLM's benchmark sends "logprobs": null).
        ({"logprobs": None, "seed": None, "stop": [], "n": 1, "echo": False, "suffix": None}, True),
        ({"best_of": 1, "logit_bias": {}, "response_format": None, "stop": ""}, True),
        ({"stop": [""]}, False),
        ({"echo": True}, False),
        ({"presence_penalty": 0.5}, False),  # counts answer tokens only: the first would not count
        ({"response_format": {"type": "json_object"}}, False),
        ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, False),
        ({"max_tokens": None}, False),
        ({"max_tokens": 0}, False),
        ({"min_tokens": 9}, False),
        ({"prompt": ["a", "b"]}, False),  # a batch of prompts
        ({"prompt": [[1, 2], [3]]}, False),
        ({"prompt": ""}, False),
        ({"prompt": [1, -2]}, False),
        ({"kv_transfer_params": {"do_remote_decode": True}}, False),
    ],
)
def test_which_requests_can_get_their_first_token_early(change: dict[str, Any], ok: bool) -> None:
    assert eligible("/v1/completions", {**STREAM, **change}) is ok
    assert not eligible("/v1/chat/completions", {**STREAM, **change})


def test_the_one_token_request_and_the_rest() -> None:
    body = {**STREAM, "prompt": "hi", "min_tokens": 3, "stream_options": {"include_usage": True}}
    one = first_token_body(body)
    assert one["max_tokens"] == 1 and one["min_tokens"] == 1 and one["stream"] is False
    assert one["return_token_ids"] is True and "stream_options" not in one
    first = FirstToken("cmpl-a", 7, "m", "x", [42], [1, 107, 108], None, None, None)
    rest = continuation_body({**body, "add_special_tokens": True}, first)
    assert rest["prompt"] == [1, 107, 108, 42] and rest["max_tokens"] == 3 and rest["min_tokens"] == 2
    assert "add_special_tokens" not in rest  # the ids hold them already
    assert rest["stream"] is True and rest["stream_options"] == {"include_usage": True}
    assert body["prompt"] == "hi" and body["max_tokens"] == 4  # the client's body is not changed


def test_a_one_token_answer_that_is_not_vllm_s_shape_is_refused() -> None:
    assert parse_first(b"not json") is None
    assert parse_first(b'{"choices": []}') is None
    assert (
        parse_first(json.dumps({"id": "a", "created": 1, "model": "m", "choices": [{"text": "x"}]}).encode())
        is None
    )
    good = {
        "id": "a",
        "created": 1,
        "model": "m",
        "choices": [{"text": "x", "token_ids": [4], "prompt_token_ids": [1, 2], "finish_reason": "length"}],
    }
    first = parse_first(json.dumps(good).encode())
    assert first is not None and first.token_ids == [4] and first.prompt_token_ids == [1, 2]


def test_the_first_event_and_an_answer_that_ends_there() -> None:
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    first = FirstToken("cmpl-a", 7, "m", "x", [4], [1, 2], "length", None, usage)
    [event] = first_events(first, {**STREAM, "max_tokens": 5}).split(b"\n\n")[:-1]
    choice = json.loads(event[len(b"data: ") :])["choices"][0]
    assert choice["text"] == "x" and choice["finish_reason"] is None  # more follows
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None  # not asked for
    ended = first_events(first, {**STREAM, "max_tokens": 1, "stream_options": {"include_usage": True}})
    events = ended.split(b"\n\n")[:-1]
    assert json.loads(events[0][6:])["choices"][0]["finish_reason"] == "length"
    assert json.loads(events[1][6:])["usage"] == usage and events[2] == b"data: [DONE]"
    stopped = FirstToken("cmpl-a", 7, "m", "", [2], [1, 2], "stop", None, usage)
    assert first_events(stopped, {**STREAM, "max_tokens": 5}).endswith(b"data: [DONE]\n\n")


def test_the_rest_s_events_read_as_the_same_answer_even_split_anywhere() -> None:
    first = FirstToken("cmpl-a", 7, "m", "x", [4], [1, 2], None, None, None)
    events = [
        {
            "id": "cmpl-b",
            "created": 9,
            "choices": [{"text": "y", "prompt_token_ids": [1, 2, 4], "token_ids": [5]}],
        },
        {
            "id": "cmpl-b",
            "created": 9,
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
        },
    ]
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    for cut in range(len(raw) + 1):
        splice = Splice(first)
        out = splice.feed(raw[:cut]) + splice.feed(raw[cut:]) + splice.flush()
        parts = out.split(b"\n\n")[:-1]
        got = [json.loads(p[6:]) for p in parts[:2]]
        assert parts[2] == b"data: [DONE]"
        assert {(g["id"], g["created"]) for g in got} == {("cmpl-a", 7)}
        assert got[0]["choices"][0]["prompt_token_ids"] is None and got[0]["choices"][0]["token_ids"] == [5]
        assert got[1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    error = b'data: {"error": {"message": "engine failed mid-stream", "code": 502}}\n\n'
    assert Splice(first).feed(error) == error


# Through the proxy, against the token engine.


async def test_waiting_requests_get_their_first_token_early_and_the_same_answer(
    token_engine: TokenEngine, proxy: Any
) -> None:
    """One place, three requests of 8 tokens at 0.1 s a token: the second and third wait about
    0.8 s and 1.6 s for a place, but their first tokens come soon after the 150 ms goal passes."""
    px = await proxy([], [token_engine.url], admit_per_engine=1, admit_ttft_goal_ms=150, disaggregate=False)
    bodies = [
        {
            **STREAM,
            "prompt": [10 + i, 20, 30],
            "max_tokens": 8,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(3)
    ]
    started = time.perf_counter()
    answers = await asyncio.gather(*(timed_stream(px.http, px.url, b, started) for b in bodies))
    for body, answer in zip(bodies, answers, strict=True):
        assert answer.token_ids == model_answer(body["prompt"], 8)
        assert len({(e["id"], e["created"]) for e in answer.events}) == 1
        prompts = [
            c["prompt_token_ids"] for e in answer.events for c in e["choices"] if c.get("prompt_token_ids")
        ]
        assert prompts == [body["prompt"]]  # once, the client's own prompt
        assert answer.events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
        finishes = [c["finish_reason"] for e in answer.events for c in e["choices"]]
        assert finishes[-1] == "length" and not any(finishes[:-1])
    first_ended = min(a.ended_at for a in answers)
    assert sorted(a.first_at for a in answers)[-1] < first_ended, [(a.first_at, a.ended_at) for a in answers]
    body = await metrics_of(px)
    assert 'kvbroker_proxy_early_first_tokens_total{result="sent"} 2.0' in body
    assert "kvbroker_proxy_requests_running 0.0" in body and "kvbroker_proxy_requests_waiting 0.0" in body
    ones = [b for b in token_engine.seen if not b["stream"]]
    assert [b["max_tokens"] for b in ones] == [1, 1]
    rests = [b for b in token_engine.seen if b["stream"] and len(b["prompt"]) == 4]
    assert sorted(b["max_tokens"] for b in rests) == [7, 7]


async def test_a_request_given_its_first_token_goes_next_while_its_rest_can_keep_the_pace(
    token_engine: TokenEngine, proxy: Any
) -> None:
    """One place, 0.1 s a token against a 0.3 s goal: a request that got its first token early
    has 7 tokens x 0.2 s of slack, so when the place frees it is let in as `rest_in_time`."""
    px = await proxy(
        [],
        [token_engine.url],
        admit_per_engine=1,
        admit_ttft_goal_ms=150,
        admit_tpot_goal_ms=300,
        disaggregate=False,
    )
    body = {**STREAM, "max_tokens": 8, "return_token_ids": True}
    started = time.perf_counter()
    await timed_stream(px.http, px.url, body, started)  # alone: the pace is measured
    await asyncio.gather(
        *(timed_stream(px.http, px.url, {**body, "prompt": [i, 2]}, started) for i in (5, 6))
    )
    metrics = await metrics_of(px)
    assert 'kvbroker_proxy_early_first_tokens_total{result="sent"} 1.0' in metrics
    assert 'kvbroker_proxy_admission_wait_seconds_count{order="rest_in_time"} 1.0' in metrics, metrics


async def test_vllm_s_own_benchmark_client_gets_early_first_tokens_and_whole_answers(
    token_engine: TokenEngine, proxy: Any
) -> None:
    """vLLM's benchmark request function (what `vllm bench serve` sends: "logprobs": null,
    "repetition_penalty": 1.0, usage asked for) through the proxy with one place: the waiting
    requests get their first token early, and the client reads each answer whole and right."""
    lib = pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func")
    px = await proxy([], [token_engine.url], admit_per_engine=1, admit_ttft_goal_ms=150, disaggregate=False)
    prompts = [[40 + i, 41, 42] for i in range(3)]
    inputs = [
        lib.RequestFuncInput(
            prompt=p,
            api_url=px.url + "/v1/completions",
            prompt_len=3,
            output_len=8,
            model="m",
            ignore_eos=True,
        )
        for p in prompts
    ]
    outputs = await asyncio.gather(*(lib.async_request_openai_completions(i, px.http) for i in inputs))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.success, out.error
        assert out.generated_text == "".join(f"t{t} " for t in model_answer(prompt, 8))
        assert (out.output_tokens, out.prompt_len, len(out.itl)) == (8, 3, 7)
    sent = [b for b in token_engine.seen if not b["stream"]]
    assert sent and all(b["logprobs"] is None and b["max_tokens"] == 1 for b in sent)
    assert 'kvbroker_proxy_early_first_tokens_total{result="sent"}' in await metrics_of(px)


async def test_an_answer_that_is_its_first_token_takes_no_place(
    token_engine: TokenEngine, proxy: Any
) -> None:
    px = await proxy([], [token_engine.url], admit_per_engine=1, admit_ttft_goal_ms=100, disaggregate=False)
    long = {**STREAM, "max_tokens": 10}
    one = {**STREAM, "prompt": [9, 9], "max_tokens": 1, "return_token_ids": True}
    started = time.perf_counter()
    whole, single = await asyncio.gather(
        timed_stream(px.http, px.url, long, started), timed_stream(px.http, px.url, one, started)
    )
    assert single.token_ids == model_answer([9, 9], 1) and single.ended_at < whole.ended_at
    assert len(token_engine.seen) == 2  # the long one and the single token's one request: no rest
    body = await metrics_of(px)
    assert 'kvbroker_proxy_early_first_tokens_total{result="answered"} 1.0' in body
    assert "kvbroker_proxy_requests_running 0.0" in body


@pytest.mark.parametrize("change", [{"seed": 1}, {"stop": ["t"]}])
async def test_other_requests_wait_whole(
    token_engine: TokenEngine, proxy: Any, change: dict[str, Any]
) -> None:
    px = await proxy([], [token_engine.url], admit_per_engine=1, admit_ttft_goal_ms=100, disaggregate=False)
    started = time.perf_counter()
    await asyncio.gather(*(timed_stream(px.http, px.url, {**STREAM, **change}, started) for _ in range(2)))
    assert all(b["stream"] and b["max_tokens"] == 4 for b in token_engine.seen)
    assert "kvbroker_proxy_early_first_tokens_total{" not in await metrics_of(px)


async def test_a_failed_one_token_request_leaves_the_request_to_wait_whole(
    token_engine: TokenEngine, proxy: Any
) -> None:
    token_engine.fail_one_token = True
    px = await proxy(
        [], [token_engine.url], admit_per_engine=1, admit_ttft_goal_ms=100, disaggregate=False, max_attempts=1
    )
    started = time.perf_counter()
    answers = await asyncio.gather(
        *(timed_stream(px.http, px.url, {**STREAM, "return_token_ids": True}, started) for _ in range(2))
    )
    assert [a.token_ids for a in answers] == [model_answer([5, 6, 7], 4)] * 2
    assert 'kvbroker_proxy_early_first_tokens_total{result="failed"} 1.0' in await metrics_of(px)


async def test_off_the_request_waits_whole(token_engine: TokenEngine, proxy: Any) -> None:
    px = await proxy(
        [],
        [token_engine.url],
        admit_per_engine=1,
        admit_ttft_goal_ms=100,
        disaggregate=False,
        admit_early_token=False,
    )
    started = time.perf_counter()
    answers = await asyncio.gather(*(timed_stream(px.http, px.url, STREAM, started) for _ in range(2)))
    assert max(a.first_at for a in answers) > min(a.ended_at for a in answers) - 0.05  # waited whole
    assert all(b["stream"] for b in token_engine.seen)


async def test_a_client_that_leaves_after_its_early_token_takes_no_place(
    token_engine: TokenEngine, proxy: Any
) -> None:
    px = await proxy([], [token_engine.url], admit_per_engine=1, admit_ttft_goal_ms=100, disaggregate=False)
    started = time.perf_counter()
    holder = asyncio.ensure_future(timed_stream(px.http, px.url, {**STREAM, "max_tokens": 10}, started))
    async with aiohttp.ClientSession() as other, other.post(px.url + "/v1/completions", json=STREAM) as resp:
        assert b"data: {" in await resp.content.readuntil(b"\n\n")  # the early first token
    await holder
    for _ in range(50):
        body = await metrics_of(px)
        if "kvbroker_proxy_requests_running 0.0" in body and "kvbroker_proxy_requests_waiting 0.0" in body:
            break
        await asyncio.sleep(0.05)
    assert "kvbroker_proxy_requests_running 0.0" in body and "kvbroker_proxy_requests_waiting 0.0" in body

"""A small fake vLLM OpenAI server for proxy unit tests (beside the real-engine e2e test).

It speaks just enough of vLLM's API: /v1/completions and /v1/chat/completions
(streaming and not, with kv_transfer_params like our adapter returns), /tokenize,
/detokenize, /v1/responses, /version, /health and /v1/models. It records every
request and can be told to fail, to be slow but live, or to freeze (as a
SIGSTOPped engine: nothing answers, /health included).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict


def fake_tokens(text: str) -> list[int]:
    """One token per character: enough tokens for several 32-token blocks from short prompts."""
    return [ord(c) % 500 for c in text]


def chat_text(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages) + "<|assistant|>\n"


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: CIMultiDict[str]


@dataclass
class FakeEngine:
    name: str
    # ok | error500 | reject400 | die_mid_stream | hang | slow | frozen | freeze_mid_stream | trickle
    # trickle: streams one word per delay_s, and ends delay_s after [DONE].
    # hang: completions never answer, /health does; slow: completions answer after delay_s;
    # frozen: nothing answers; freeze_mid_stream: one chunk, then nothing answers.
    mode: str = "ok"
    delay_s: float = 0.0
    words: int = 4
    # As a prefill engine: the hold its answer names (default: a made-up request id).
    hold_request_id: str = ""
    seen: list[Seen] = field(default_factory=list)
    health_probes: int = 0  # GET /health calls, answered or not
    # Completions whose client (the proxy) left before the answer: vLLM aborts those and frees their
    # KV blocks; the fake's test server cancels the handler as vLLM's notices the disconnect.
    cancelled: int = 0
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def completions(self) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith("/v1/")]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/version", self._version)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        return app

    async def start(self) -> FakeEngine:
        self.server = TestServer(self.app())  # aiohttp's test server cancels a handler whose client left
        await self.server.start_server()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()

    @property
    def frozen(self) -> bool:
        return self.mode == "frozen" or (self.mode == "freeze_mid_stream" and self._froze)

    _froze: bool = False

    async def _health(self, request: web.Request) -> web.Response:
        self.health_probes += 1
        if self.frozen:
            await asyncio.sleep(3600)
        return web.Response(text="")

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.0.fake"})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(Seen(request.path, body, CIMultiDict(request.headers)))
        return web.json_response({"prompt": "".join(chr(97 + t % 26) for t in body["tokens"])})

    async def _responses(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(Seen(request.path, body, CIMultiDict(request.headers)))
        if self.frozen:
            await asyncio.sleep(3600)
        if not isinstance(body.get("input"), str):
            return web.json_response(
                {"error": {"message": "input must be a string", "code": 400}}, status=400
            )
        text = f"{self.name} says hi"
        return web.json_response(
            {
                "id": "resp_1",
                "object": "response",
                "created_at": 0,
                "model": body.get("model", "tiny"),
                "status": "completed",
                "output": [
                    {
                        "type": "message",
                        "id": "msg_1",
                        "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": []}],
                    }
                ],
                "parallel_tool_calls": False,
                "tool_choice": "auto",
                "tools": [],
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "owned_by": self.name}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(Seen(request.path, body, CIMultiDict(request.headers)))
        text = chat_text(body["messages"]) if "messages" in body else body["prompt"]
        tokens = fake_tokens(text)
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": 4096})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._answer(request)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, body, CIMultiDict(request.headers)))
        params = body.get("kv_transfer_params") or {}
        if self.mode == "error500":
            return web.json_response({"error": {"message": "engine broke"}}, status=500)
        if self.mode == "reject400":
            return web.json_response({"error": {"message": "max_tokens too large", "code": 400}}, status=400)
        if self.mode == "reject400_like_vllm":  # vLLM describes the request it judged by its key count
            message = f"{{'type': 'value_error', 'loc': ('body',), 'input': '<dict of {len(body)} items>'}}"
            return web.json_response({"error": {"message": message, "code": 400}}, status=400)
        if self.mode in ("hang", "frozen"):
            await asyncio.sleep(3600)
        if self.mode == "slow":
            await asyncio.sleep(self.delay_s)
        chat = request.path.endswith("chat/completions")
        if params.get("do_remote_decode"):
            return web.json_response(
                {
                    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "do_remote_decode": False,
                        "remote_engine_id": self.name,
                        "kvbroker": {
                            "holder_engine_id": self.name,
                            "num_blocks": 2,
                            "hold_request_id": self.hold_request_id or f"{self.name}-req-{len(self.seen)}",
                        },
                    },
                }
            )
        how = "pulled" if params.get("do_remote_prefill") else "computed"
        words = [f"{self.name}", how] + [f"w{i}" for i in range(self.words)]
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": " ".join(words)}
            else:
                choice["text"] = " ".join(words)
            return web.json_response({"id": "cmpl-1", "choices": [choice], "engine": self.name})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, word in enumerate(words):
            delta: dict[str, Any] = {"index": 0}
            if chat:
                delta["delta"] = {"content": word + " "}
            else:
                delta["text"] = word + " "
            await resp.write(f"data: {json.dumps({'choices': [delta]})}\n\n".encode())
            if self.mode == "trickle":
                await asyncio.sleep(self.delay_s)
            if self.mode == "freeze_mid_stream":
                self._froze = True
                await asyncio.sleep(3600)
            if self.mode == "die_mid_stream" and i == 1:
                # Drop the connection without finishing the chunked body.
                assert request.transport is not None
                request.transport.close()
                return resp
        await resp.write(b"data: [DONE]\n\n")
        if self.mode == "trickle":
            await asyncio.sleep(self.delay_s)
        await resp.write_eof()
        return resp

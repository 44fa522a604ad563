"""A small P/D proxy for vLLM's NixlConnector with bidirectional KV transfer, multi-turn.

    .venv/bin/python -m bench.chats.nixl_proxy --prefill URL --decode URL [--port N] [--decode-stream]

This is the routing pattern vLLM's bidirectional NixlConnector expects from its
router (the benchmark's third setup), written for this project:

1. P gets the prompt non-streamed with `max_tokens 1`. Turn 1 of a conversation
   carries `{"do_remote_decode": true}`; a later turn carries the
   `kv_transfer_params` D returned for the conversation's previous turn (they
   say `do_remote_decode` and name D's engine, side channel and
   `remote_block_ids`), so P may read the history back from D instead of
   computing it.
2. D gets the prompt with the `kv_transfer_params` P returned (P's block ids):
   D reads the prompt's KV from P and decodes.
3. The proxy keeps `conversation -> D's kv_transfer_params` for the next turn.
   The conversation is named by the `X-Conversation-Id` request header.

vLLM returns `kv_transfer_params` only in a non-streamed answer. So by default
(the pattern) D is asked non-streamed, and a client that asked for a stream
gets D's whole answer as one SSE chunk: its time to first token is D's whole
answer. With `--decode-stream` D streams to the client instead, and D's
params are lost: P can then never read back from D (no bidirectional transfer).

Only what the pattern needs; it is a benchmark peer, not a product proxy.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bench.chats.workload import CONVERSATION_HEADER
from bench.harness.baselines import decode_request, prefill_request

REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")


@dataclass
class BookStats:
    turns: int = 0
    offered_read_back: int = 0  # P got D's params (could read the history back)
    decode_params_kept: int = 0  # D returned params that were kept for the next turn
    decode_params_missing: int = 0  # D answered without params (streamed, or none returned)


class ConversationBook:
    """conversation id -> the kv_transfer_params D returned for its last turn (bounded, LRU)."""

    def __init__(self, max_conversations: int = 10_000) -> None:
        self._params: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.max_conversations = max_conversations
        self.stats = BookStats()

    def __len__(self) -> int:
        return len(self._params)

    def prefill_params(self, conversation: str | None) -> dict[str, Any]:
        """What P gets: D's params from the previous turn when known, else a plain remote-decode prefill."""
        self.stats.turns += 1
        held = self._params.get(conversation) if conversation else None
        if held and all(held.get(k) is not None for k in REMOTE_FIELDS):
            self.stats.offered_read_back += 1
            params = dict(held)
            # P is the prefill node for this turn: it must keep its blocks for D.
            params["do_remote_decode"] = True
            params["do_remote_prefill"] = False
            return params
        return {"do_remote_decode": True}

    def remember(self, conversation: str | None, decode_params: Mapping[str, Any] | None) -> None:
        """Keep D's returned params for the conversation's next turn (or forget stale ones)."""
        if not conversation:
            return
        if not decode_params or not decode_params.get("remote_block_ids"):
            self.stats.decode_params_missing += 1
            # D's old blocks were superseded by this turn; never offer them again.
            self._params.pop(conversation, None)
            return
        self.stats.decode_params_kept += 1
        self._params[conversation] = dict(decode_params)
        self._params.move_to_end(conversation)
        while len(self._params) > self.max_conversations:
            self._params.popitem(last=False)


def as_stream_chunks(answer: Mapping[str, Any]) -> list[bytes]:
    """A non-streamed chat answer as the SSE chunks a streaming client expects."""
    choices = []
    for c in answer.get("choices", []):
        msg = c.get("message") or {}
        choice = {
            "index": c.get("index", 0),
            "delta": {"role": "assistant", "content": msg.get("content") or ""},
            "finish_reason": c.get("finish_reason"),
        }
        if c.get("token_ids") is not None:
            choice["token_ids"] = c["token_ids"]
        choices.append(choice)
    chunk = {"id": answer.get("id"), "object": "chat.completion.chunk", "model": answer.get("model")}
    out = [json.dumps({**chunk, "choices": choices})]
    if answer.get("usage") is not None:
        out.append(json.dumps({**chunk, "choices": [], "usage": answer["usage"]}))
    return [f"data: {x}\n\n".encode() for x in out] + [b"data: [DONE]\n\n"]


def build_app(prefill_url: str, decode_url: str, decode_stream: bool) -> Any:
    import aiohttp
    from aiohttp import web

    book = ConversationBook()
    timeout = aiohttp.ClientTimeout(total=600)
    session_key = web.AppKey("http", aiohttp.ClientSession)

    async def on_startup(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(timeout=timeout)

    async def on_cleanup(app: web.Application) -> None:
        await app[session_key].close()

    async def chat(request: web.Request) -> web.StreamResponse:
        http = request.app[session_key]
        body = await request.json()
        conversation = request.headers.get(CONVERSATION_HEADER)
        started = time.perf_counter()
        async with http.post(
            f"{prefill_url}/v1/chat/completions",
            json=prefill_request(body, book.prefill_params(conversation)),
        ) as resp:
            p_answer = await resp.json()
            if resp.status != 200:
                return web.json_response(p_answer, status=resp.status)
        p_params = p_answer.get("kv_transfer_params")
        if not p_params:
            return web.json_response(
                {"error": {"message": f"P returned no kv_transfer_params: {p_answer}"}}, status=502
            )
        p_ms = (time.perf_counter() - started) * 1000
        client_stream = bool(body.get("stream"))
        headers = {"X-Prefill-Ms": f"{p_ms:.1f}"}
        if decode_stream and client_stream:
            book.remember(conversation, None)  # a streamed answer carries no params
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
            await out.prepare(request)
            async with http.post(
                f"{decode_url}/v1/chat/completions", json=decode_request(body, p_params, True)
            ) as resp:
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
            await out.write_eof()
            return out
        async with http.post(
            f"{decode_url}/v1/chat/completions", json=decode_request(body, p_params, False)
        ) as resp:
            d_answer = await resp.json()
            if resp.status != 200:
                return web.json_response(d_answer, status=resp.status)
        book.remember(conversation, d_answer.get("kv_transfer_params"))
        if not client_stream:
            return web.json_response(d_answer, headers=headers)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await out.prepare(request)
        for chunk in as_stream_chunks(d_answer):
            await out.write(chunk)
        await out.write_eof()
        return out

    async def stats(_: web.Request) -> web.Response:
        s = book.stats
        return web.json_response({**s.__dict__, "conversations": len(book)})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/stats", stats)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    from aiohttp import web

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--prefill", required=True, help="P's base URL")
    ap.add_argument("--decode", required=True, help="D's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--decode-stream", action="store_true", help="stream from D (its params are then lost)")
    args = ap.parse_args(argv)
    app = build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.decode_stream)
    print(f"nixl proxy on http://{args.host}:{args.port} (P {args.prefill}, D {args.decode})", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

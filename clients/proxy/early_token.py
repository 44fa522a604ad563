"""An early first token: a streamed request that waits at the proxy (admission.py) past the
point where it could still meet the first-token goal gets its first token now, from a
one-token request, and the rest of its answer when admission gives it a place.

Why. In a long overload some requests must wait whatever the order: the fleet serves fewer
than arrive. Held whole at the proxy, such a request shows nothing for as long as it waits,
and the tail of first-token times (p90) grows with the backlog; let through at once (as a
router without admission does), it slows the pace of every answer the engines already stream.
A one-token request is one prefill: the client sees its answer start, the running answers
lose one engine step, and the request's remaining tokens still wait for a place. Its wait
then shows as time per token; while the rest can still keep the pace goal, admission lets
it in by that deadline (admission.py, ``first_token_out``).

How the answer stays exact. The one-token request asks for ``return_token_ids``; the rest
is a second request whose prompt is the first's prompt token ids plus that first token,
with ``max_tokens`` one less (``min_tokens`` too). Greedy, it is the same answer as the
request sent whole (the same tokens computed on the same prompt); the engine's prefix cache
(or a pull) holds the prompt, so the second prefill is short. The second answer's events
are relayed with the first's ``id`` and ``created``; its usage counts the first token as
an answer token, not a prompt token; and ``prompt_token_ids`` (asked or not) goes out once.

Which requests (``eligible``): ``/v1/completions``, streamed, one prompt (a string or a
list of token ids), an explicit ``max_tokens``, and only keys whose meaning is the same
split in two: no stop strings (one could span the two parts), no seed (a seeded sample is
a promise of the same answer), no logprobs, echo, n, best_of, penalties on answer tokens,
structured output or kv_transfer_params of the client's. A key sent at its default (null,
``"stop": []``, ``"n": 1``, ``"echo": false``: vLLM's own benchmark sends ``"logprobs":
null``) counts as left out. Any other request waits whole, as before. If the one-token
request fails, the request waits whole too: nothing was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvbroker.clients.proxy.outcome import Outcome, error_object

log = logging.getLogger("kvbroker.proxy")

# EarlyToken.result, the `result` label of kvbroker_proxy_early_first_tokens_total.
SENT = "sent"  # the first token went out early; the rest followed when a place freed
ANSWERED = "answered"  # the whole answer was its first token (it stopped, or one was asked for)
FAILED = "failed"  # the one-token request failed: the request waited whole

COMPLETIONS = "/v1/completions"

# Keys whose effect is the same on an answer computed in two parts (see the module docstring).
_SPLITTABLE_KEYS = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "min_tokens",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "ignore_eos",
        "stop_token_ids",
        "return_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "add_special_tokens",
        "user",
        "priority",
        "cache_salt",
        "request_id",
        "repetition_penalty",  # vLLM applies it to prompt and answer tokens alike
        "presence_penalty",  # only at 0 (checked below): answer tokens only
        "frequency_penalty",
    }
)


# Values of other keys that mean the same as leaving the key out (besides null).
_DEFAULTS: dict[str, tuple[object, ...]] = {
    "stop": ("", []),
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logit_bias": ({},),
    "include_stop_str_in_output": (False,),
    "bad_words": ([],),
}


def _left_out(key: str, value: object) -> bool:
    """`value` is `key`'s default: the request reads as if it had no `key`."""
    return value is None or any(type(value) is type(d) and value == d for d in _DEFAULTS.get(key, ()))


def eligible(endpoint: str, body: Mapping[str, Any]) -> bool:
    """Whether `body`'s answer can be sent as a first token now and the rest later (module doc)."""
    if endpoint != COMPLETIONS or body.get("stream") is not True:
        return False
    if any(key not in _SPLITTABLE_KEYS and not _left_out(key, value) for key, value in body.items()):
        return False
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            return False
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int or max_tokens < 1:
        return False
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and (type(min_tokens) is not int or not 0 <= min_tokens <= max_tokens):
        return False
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or any(k != "include_usage" for k in options)):
        return False
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return bool(prompt)
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int and t >= 0 for t in prompt)


def first_token_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The one-token request: not streamed, with the token ids the second request needs."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["max_tokens"] = 1
    out["stream"] = False
    out["return_token_ids"] = True
    if out.get("min_tokens"):
        out["min_tokens"] = 1
    return out


@dataclass(frozen=True)
class FirstToken:
    """The one-token request's answer, as the second request and the client need it."""

    id: str
    created: int
    model: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    stop_reason: Any
    usage: dict[str, Any] | None


def parse_first(raw: bytes) -> FirstToken | None:
    """The one-token answer (vLLM's completion JSON); None when it is not that shape."""
    try:
        answer = json.loads(raw)
        choice = answer["choices"][0]
        token_ids, prompt_ids = choice["token_ids"], choice["prompt_token_ids"]
        first = FirstToken(
            id=str(answer["id"]),
            created=int(answer["created"]),
            model=str(answer["model"]),
            text=str(choice["text"]),
            token_ids=[int(t) for t in token_ids],
            prompt_token_ids=[int(t) for t in prompt_ids],
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            usage=answer.get("usage") if isinstance(answer.get("usage"), dict) else None,
        )
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return first if first.token_ids and first.prompt_token_ids else None


def answer_ended(first: FirstToken, body: Mapping[str, Any]) -> bool:
    """The whole answer is the first token: it stopped there, or only one was asked for."""
    return first.finish_reason == "stop" or len(first.token_ids) >= int(body["max_tokens"])


def first_events(first: FirstToken, body: Mapping[str, Any]) -> bytes:
    """The server-sent events that carry the first token now, shaped as vLLM streams them;
    when the answer ended there, also its usage event (if asked for) and ``[DONE]``."""
    ended = answer_ended(first, body)
    ids = bool(body.get("return_token_ids"))
    choice = {
        "index": 0,
        "text": first.text,
        "logprobs": None,
        "finish_reason": first.finish_reason if ended else None,
        "stop_reason": first.stop_reason if ended else None,
        "prompt_token_ids": first.prompt_token_ids if ids else None,
        "token_ids": first.token_ids if ids else None,
    }
    events = [_event(_chunk(first, [choice]))]
    if ended:
        options = body.get("stream_options") or {}
        if options.get("include_usage") and first.usage is not None:
            events.append(_event({**_chunk(first, []), "usage": first.usage}))
        events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def continuation_body(body: Mapping[str, Any], first: FirstToken) -> dict[str, Any]:
    """The second request: the prompt's token ids and the first token, for the tokens left."""
    out = dict(body)
    out["prompt"] = first.prompt_token_ids + first.token_ids
    out["max_tokens"] = int(body["max_tokens"]) - len(first.token_ids)
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, int(body["min_tokens"]) - len(first.token_ids))
    out.pop("add_special_tokens", None)  # the ids already hold the special tokens
    return out


class Splice:
    """Rewrites the second request's event stream so the client sees one answer: the first's
    ``id`` and ``created``, no second ``prompt_token_ids``, usage counting the first token as
    answer. Events may be split across chunks: a partial event waits for its end."""

    def __init__(self, first: FirstToken) -> None:
        self.first = first
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        self._pending += chunk
        *events, self._pending = self._pending.split(b"\n\n")
        return b"".join(self._rewrite(e) + b"\n\n" for e in events)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return self._rewrite(rest) + b"\n\n" if rest.strip() else b""

    def _rewrite(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event  # [DONE], comments, anything not an answer chunk
        try:
            chunk = json.loads(event[len(b"data: ") :])
        except ValueError:
            return event
        if not isinstance(chunk, dict) or "error" in chunk:
            return event
        chunk["id"], chunk["created"] = self.first.id, self.first.created
        for choice in chunk.get("choices") or []:
            if isinstance(choice, dict) and choice.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = None
        usage = chunk.get("usage")
        n = len(self.first.token_ids)
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            usage["prompt_tokens"] -= n
            usage["completion_tokens"] = int(usage.get("completion_tokens") or 0) + n
        return _event(chunk).rstrip(b"\n")


# Serves one request body on an engine (server._route_and_serve): the answer, or the error to send.
ServeOne = Callable[[dict[str, Any], Outcome], Awaitable[web.StreamResponse]]


class EarlyToken:
    """One waiting request's early first token (module doc). `while_waiting` runs once the
    request can no longer meet the goal; then either `done` is the whole answer (no place is
    needed), or `first` went out on `response` and the second request is relayed through
    `splice` onto it (forward.py), or nothing was sent and the request goes whole."""

    def __init__(
        self,
        request: web.Request,
        body: dict[str, Any],
        outcome: Outcome,
        serve: ServeOne,
        slots: asyncio.Semaphore,
    ) -> None:
        self.request, self.body, self.outcome = request, body, outcome
        self._serve, self._slots = serve, slots
        self.first: FirstToken | None = None
        self.response: web.StreamResponse | None = None
        self.done: web.StreamResponse | None = None
        self.result = ""

    async def while_waiting(self, entering: asyncio.Future[Any]) -> None:
        """Takes one of the early slots (a few one-token requests at a time: each is a prefill
        the running answers wait for) and sends the first token; returns at once, sending
        nothing, if the request gets its place first."""
        acquiring = asyncio.ensure_future(self._slots.acquire())
        try:
            await asyncio.wait({acquiring, entering}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            if not acquiring.cancel() and not acquiring.cancelled():
                self._slots.release()
            raise
        if not acquiring.done():
            acquiring.cancel()
            return
        try:
            if not entering.done():
                await self._send_first()
        finally:
            self._slots.release()

    async def _send_first(self) -> None:
        outcome = Outcome(f"{self.outcome.request_id}-first")
        try:
            answer = await self._serve(first_token_body(self.body), outcome)
        except Exception as e:  # the request will go whole: nothing was sent
            log.warning("request %s: the early first token failed: %r", self.outcome.request_id, e)
            self.result = FAILED
            return
        raw = answer.body if isinstance(answer, web.Response) and answer.status == 200 else None
        first = parse_first(bytes(raw)) if isinstance(raw, bytes | bytearray) else None
        if first is None:  # a 4xx is answered to the request sent whole, in its own words
            self.result = FAILED
            return
        response = web.StreamResponse(status=200, headers=outcome.headers())
        response.content_type, response.charset = "text/event-stream", "utf-8"
        self.response = response
        try:
            await response.prepare(self.request)
            await response.write(first_events(first, self.body))
        except ConnectionResetError:  # the client left: nothing more to send
            self.done, self.result = response, FAILED
            return
        self.outcome.first_byte()
        if answer_ended(first, self.body):
            with contextlib.suppress(ConnectionResetError):
                await response.write_eof()
            self.done, self.result = response, ANSWERED
            return
        self.first, self.result = first, SENT
        self.outcome.splice, self.outcome.early_response = Splice(first), response

    def client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    async def finish(self, answer: web.StreamResponse) -> web.StreamResponse:
        """After the second request: its answer went out on `response`; or it failed before
        its first byte (every engine tried), and an error event ends the stream."""
        response = self.response
        if response is None or answer is response:
            return answer
        raw = answer.body if isinstance(answer, web.Response) else None
        try:
            message = json.loads(bytes(raw))["error"]["message"] if isinstance(raw, bytes) else ""
        except (ValueError, KeyError, TypeError):
            message = ""
        error = error_object(
            answer.status, message or f"the rest of the answer failed: HTTP {answer.status}", "engine_failure"
        )
        with contextlib.suppress(ConnectionResetError):
            await response.write(_event(error))
            await response.write_eof()
        return response


def _chunk(first: FirstToken, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": first.id,
        "object": "text_completion",
        "created": first.created,
        "model": first.model,
        "choices": choices,
    }


def _event(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

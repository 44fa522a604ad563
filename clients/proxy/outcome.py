"""What happened to a proxied request, and the failures and rejections that shape it (forward.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvbroker.clients.proxy.config import EngineSpec

if TYPE_CHECKING:
    from kvbroker.clients.proxy.early_token import Splice
    from kvbroker.clients.proxy.engines import Serving

# EngineFailure kinds, the `kind` label of kvbroker_proxy_engine_failures_total.
HUNG = "hung"  # no first byte within the budget and the liveness check failed
UNREACHABLE = "unreachable"  # connection refused/reset, or the read timeout passed
ERROR = "error"  # HTTP 5xx or an answer that is not what vLLM sends


class EngineFailure(Exception):
    """The engine could not serve (unreachable, hung, 5xx): try another one."""

    def __init__(self, engine: EngineSpec, reason: str, kind: str = ERROR) -> None:
        super().__init__(f"{engine.label}: {reason}")
        self.engine = engine
        self.reason = reason
        self.kind = kind


# (engine, step, kind) after a step failed on an engine; (engine, step) when a step
# that failed on that engine is tried on another one.
FailureHook = Callable[[EngineSpec, str, str], None]
RetryHook = Callable[[EngineSpec, str], None]


class RequestRejected(Exception):
    """The engine answered 4xx: the request itself is wrong; pass the answer on."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body
        self.content_type = content_type

    def as_client_sent(self, sent: Mapping[str, Any], client: Mapping[str, Any]) -> RequestRejected:
        """The engine judged the body the proxy rewrote (P's one-token prefill, D's body with
        kv_transfer_params); vLLM describes a rejected request as ``<dict of N items>``: say the
        client's N, not ours."""
        ours, theirs = f"<dict of {len(sent)} items>".encode(), f"<dict of {len(client)} items>".encode()
        if ours != theirs and ours in self.body:
            self.body = self.body.replace(ours, theirs)
        return self


@dataclass
class Outcome:
    """What happened to a request, for response headers, spans and logs."""

    request_id: str
    mode: str = ""  # "pd", "local" (D alone: it held all but a few tokens) or "single"
    prefill: EngineSpec | None = None
    decode: EngineSpec | None = None
    fallback_reason: str = ""
    failures: list[str] = field(default_factory=list)
    failure_kinds: list[str] = field(default_factory=list)
    # The engine and step of the last failure, until another attempt retries it.
    unretried: tuple[EngineSpec, str] | None = None
    turn: str = ""  # a chat's turn (its user messages: 1, 2, ... 5+); "" for other requests
    first_byte_at: float | None = None  # perf_counter() when the answer's first byte went out
    route_reason: str = ""  # why local on D or P then pull (p_queue.py), with its detail
    route_detail: str = ""
    # Data-parallel placement: engine url -> prompt tokens predicted to be computed there (its backlog).
    prefill_tokens: dict[str, float] = field(default_factory=dict)
    serving: Serving | None = None  # the attempt under way: its backlog ends at the first byte
    admission: str = ""  # how admission let it go (admission.py); "" when admission is off
    admission_wait_s: float = 0.0
    stream_events: int = 0  # server-sent events relayed (a streamed answer), [DONE] not counted
    last_byte_at: float | None = None  # perf_counter() when a stream's last event went out
    # An early first token (early_token.py): how it went, and where the rest goes.
    early: str = ""
    splice: Splice | None = None  # rewrites the rest's events onto early_response
    early_response: web.StreamResponse | None = None

    def first_byte(self) -> None:
        """The answer's first byte went out: the engine has computed the prompt."""
        self.first_byte_at = time.perf_counter()
        if self.serving is not None:
            self.serving.prefilled()

    def streamed(self, chunk: bytes) -> None:
        """A streamed answer's chunk went out: counts its events, for the answer's pace."""
        self.stream_events += chunk.count(b"data:") - chunk.count(b"data: [DONE]")
        self.last_byte_at = time.perf_counter()

    def tpot_s(self) -> float | None:
        """A streamed answer's time per event after the first (about its time per output token)."""
        if self.first_byte_at is None or self.last_byte_at is None or self.stream_events < 3:
            return None
        return (self.last_byte_at - self.first_byte_at) / (self.stream_events - 1)

    def headers(self) -> dict[str, str]:
        h = {"X-Request-Id": self.request_id, "X-KVBroker-Mode": self.mode}
        if self.prefill is not None:
            h["X-KVBroker-Prefill"] = self.prefill.label
        if self.decode is not None:
            h["X-KVBroker-Decode"] = self.decode.label
        if self.fallback_reason:
            h["X-KVBroker-Fallback"] = self.fallback_reason[:200]
        if self.route_reason:
            h["X-KVBroker-Route"] = self.route_reason
        return h


def openai_error(
    status: int,
    message: str,
    err_type: str = "proxy_error",
    *,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """An error the way OpenAI's API (and vLLM's server) shape it; `code` is the HTTP status, as in vLLM."""
    return web.json_response(
        error_object(status, message, err_type, param=param), status=status, headers=headers
    )


def error_object(status: int, message: str, err_type: str, *, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: the body of an error answer, or the data of a stream's error event."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}

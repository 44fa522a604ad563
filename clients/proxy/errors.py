"""OpenAI-shaped errors for what aiohttp itself refuses: unknown paths, wrong methods, huge bodies.

OpenAI's clients (and vLLM's) read ``{"error": {"message", "type", "param",
"code"}}``; aiohttp's own answers are plain text, which those clients report as
an unreadable body instead of the reason.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from kvbroker.clients.proxy.outcome import openai_error

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _message(request: web.Request, e: web.HTTPException) -> tuple[str, dict[str, str]]:
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        return (
            f"method {request.method} is not allowed on {request.path} (allowed: {allowed})",
            {"Allow": allowed},
        )
    if isinstance(e, web.HTTPNotFound):
        return f"unknown path {request.method} {request.path}", {}
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return f"request body too large: {e.text}", {}
    return e.text or e.reason, {}


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message, headers = _message(request, e)
        err_type = "invalid_request_error" if e.status < 500 else "server_error"
        return openai_error(e.status, message, err_type, headers=headers)

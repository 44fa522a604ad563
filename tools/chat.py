"""One streamed OpenAI chat turn, timed at the client: what the demo, the chat tests and the chat
benchmark send through the proxy or to an engine directly.

`stream_chat` posts `/v1/chat/completions` with `stream: true` and
`return_token_ids: true` (vLLM's extension), and returns the answer's text and
token ids, the prompt's token ids (vLLM sends them in the first chunk), the
time to the first streamed token and the usage. Greedy by default, stopping at
the model's end-of-turn token, so the answer text is what the next turn's chat
template renders.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any


class ChatStreamError(RuntimeError):
    """The stream carried an error event (e.g. the engine died mid-answer)."""


@dataclass
class ChatAnswer:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    ttft_s: float | None
    total_s: float
    usage: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)  # as the server sent them
    finish_reason: str | None = None

    def header(self, name: str, default: str = "") -> str:
        """A response header, whatever its case."""
        wanted = name.lower()
        return next((v for k, v in self.headers.items() if k.lower() == wanted), default)

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def chat_body(
    messages: list[dict[str, str]],
    *,
    model: str,
    max_tokens: int,
    ignore_eos: bool = False,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def stream_chat(url: str, body: dict[str, Any], request_id: str, *, timeout: float = 300.0) -> ChatAnswer:
    """POST `body` to `url` + /v1/chat/completions and read the whole stream."""
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    start = time.monotonic()
    ttft: float | None = None
    text: list[str] = []
    token_ids: list[int] = []
    prompt_ids: list[int] = []
    usage: dict[str, Any] = {}
    finish: str | None = None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        headers = dict(resp.headers.items())
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ChatStreamError(f"stream error: {chunk['error']}")
            prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                content = (choice.get("delta") or {}).get("content")
                if (ids or content) and ttft is None:
                    ttft = time.monotonic() - start
                token_ids.extend(ids)
                if content:
                    text.append(content)
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return ChatAnswer(
        text="".join(text),
        token_ids=token_ids,
        prompt_token_ids=list(prompt_ids),
        ttft_s=ttft,
        total_s=time.monotonic() - start,
        usage=usage,
        headers=headers,
        finish_reason=finish,
    )

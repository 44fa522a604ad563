"""The chats bench.chats.compare sends, and the streaming client that times them.

A conversation's first user message is a document of this repository (one
file under docs/ per conversation, cut so that the rendered turn-1 prompt,
chat template and default system prompt included, is exactly `first_tokens`
tokens long), followed by a request to summarize it. Later turns ask short
follow-up questions. Every setup gets the same messages; each builds its
history from its own answers (greedy, so they must all be the same).
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The header a client names its conversation in (bench.chats.nixl_proxy routes turns by it).
CONVERSATION_HEADER = "X-Conversation-Id"

ROOT = Path(__file__).resolve().parents[2]
SERVED_MODEL = "smollm2"
INTRO = "Here is a document from the kvbroker project.\n\n"
ASK = "\n\nSummarize what this document says, section by section."
FOLLOW_UPS = (
    "Which part of it matters most to someone operating the system, and why?",
    "Give one concrete example of that from the document.",
    "What would you check first if it went wrong?",
    "Summarize our conversation in two sentences.",
)


@dataclass
class Conversation:
    name: str  # e.g. "c0-adapter.md"
    first_message: str
    first_prompt_tokens: int
    follow_ups: list[str] = field(default_factory=list)

    def user_message(self, turn: int) -> str:
        return self.first_message if turn == 1 else self.follow_ups[turn - 2]


def _prompt_len(tokenizer: Any, text: str) -> int:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


def fit_message(tokenizer: Any, doc: str, target: int) -> tuple[str, int]:
    """INTRO + the longest prefix of `doc` + ASK whose rendered prompt has at most `target` tokens."""
    lo, hi = 0, len(doc)
    if _prompt_len(tokenizer, INTRO + doc + ASK) <= target:
        text = INTRO + doc + ASK
        return text, _prompt_len(tokenizer, text)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _prompt_len(tokenizer, INTRO + doc[:mid] + ASK) <= target:
            lo = mid
        else:
            hi = mid
    text = INTRO + doc[:lo] + ASK
    return text, _prompt_len(tokenizer, text)


def sized_follow_up(tokenizer: Any, question: str, excerpt: str, tokens: int) -> str:
    """`question` then as much of `excerpt` as makes the message `tokens` tokens long (as users write:
    a question that quotes what it asks about)."""
    lo, hi = 0, len(excerpt)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        n = len(tokenizer.encode(f"{question}\n\n{excerpt[:mid]}", add_special_tokens=False))
        lo, hi = (mid, hi) if n <= tokens else (lo, mid)
    return f"{question}\n\n{excerpt[:lo]}"


def build_conversations(
    model_dir: Path,
    count: int,
    first_tokens: int,
    turns: int,
    follow_up_tokens: tuple[int, int] | None = None,
) -> list[Conversation]:
    """`count` conversations, each on its own docs/ file (cycled, with an offset if reused).
    `follow_up_tokens` (lo, hi): later turns' messages of lo..hi tokens (spread evenly), not
    the short default questions."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    docs = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    out = []
    for i in range(count):
        path = docs[i % len(docs)]
        text = path.read_text()
        offset = (i // len(docs)) * 4000  # a reused file starts further in: a different prefix
        message, n = fit_message(tokenizer, text[offset:], first_tokens)
        out.append(
            Conversation(
                name=f"c{i}-{path.name}",
                first_message=message,
                first_prompt_tokens=n,
                follow_ups=list(FOLLOW_UPS[: max(0, turns - 1)]),
            )
        )
    if follow_up_tokens is not None:
        lo, hi = follow_up_tokens
        quoted = (ROOT / "README.md").read_text()
        for i, conv in enumerate(out):
            for k, question in enumerate(conv.follow_ups):
                step = i * len(conv.follow_ups) + k
                size = lo + (hi - lo) * (step % 5) // 4  # lo, ..., hi, then again
                excerpt = quoted[2000 * (step + 1) : 2000 * (step + 1) + 4000]
                conv.follow_ups[k] = sized_follow_up(tokenizer, question, excerpt, size)
    return out


@dataclass
class TurnResult:
    ttft_s: float
    total_s: float
    text: str
    token_ids: list[int]
    usage: dict[str, Any]
    headers: dict[str, str]

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", 0))

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


def chat_body(messages: list[dict[str, str]], answer_tokens: int) -> dict[str, Any]:
    """A greedy, streamed chat request with a fixed answer length (min_tokens = max_tokens)."""
    return {
        "model": SERVED_MODEL,
        "messages": messages,
        "max_tokens": answer_tokens,
        "min_tokens": answer_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def stream_chat(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 600.0
) -> TurnResult:
    """POST a streamed chat; TTFT = from sending to the first chunk that carries answer text or tokens."""
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    text: list[str] = []
    ids: list[int] = []
    usage: dict[str, Any] = {}
    ttft: float | None = None
    sent = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp_headers = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-")}
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = (choice.get("delta") or {}).get("content") or ""
                new = choice.get("token_ids") or []
                if (delta or new) and ttft is None:
                    ttft = time.perf_counter() - sent
                text.append(delta)
                ids.extend(new)
    total = time.perf_counter() - sent
    if ttft is None:
        raise RuntimeError(f"{url}: the stream carried no answer")
    return TurnResult(ttft, total, "".join(text), ids, usage, resp_headers)


def post_json(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """POST a JSON request and return the JSON answer (a non-streamed call)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer

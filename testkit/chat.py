"""Real multi-turn chats for the real-model tests and the chat benchmark: questions built from this
repository's own documentation, and many conversations run at once against one OpenAI endpoint
(the proxy, or one engine alone), each turn timed at the client.

    convs = doc_conversations(8, turns=5, seed=0)
    runs = run_conversations(proxy_url, convs, model="smollm2", max_tokens=32)
    runs[i].turns[k].answer.token_ids    # the greedy answer of conversation i, turn k + 1

A conversation's turns run one after another (turn k + 1 carries turn k's answer
in its history); the conversations run in parallel threads, so all of them are
in flight at once. A turn whose request fails is retried (`retries`) and every
failure is kept, with its start and end times, for the fault tests.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvbroker.tools.chat import ChatAnswer, chat_body, stream_chat

REPO_ROOT = Path(__file__).resolve().parent.parent
SYSTEM_PROMPT = (
    "You are a concise assistant that explains a software project's documentation. Answer in one or "
    "two plain sentences."
)
_ASKS = (
    "What is this passage about, in one sentence?",
    "Which component does it describe, and what does that component do?",
    "What problem does this solve for someone serving a language model?",
    "Name one guarantee or limit this passage states.",
    "How does this relate to what we discussed before?",
)


def doc_passages(words: int = 40, *, root: Path = REPO_ROOT) -> list[str]:
    """Prose paragraphs of README.md and docs/*.md (no code, tables or lists), cut to `words` words."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    out: list[str] = []
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for para in re.split(r"\n\s*\n", text):
            lines = [ln.strip() for ln in para.splitlines()]
            if not lines or any(ln.startswith(("#", "|", "-", "*", ">", "<", "1.")) for ln in lines):
                continue
            plain = re.sub(r"[`*_\[\]]|\(\S+\)", "", " ".join(lines))
            tokens = plain.split()
            if len(tokens) >= min(words, 25):
                out.append(" ".join(tokens[:words]))
    if not out:
        raise RuntimeError(f"no prose paragraphs found under {root}")
    return out


@dataclass(frozen=True)
class Conversation:
    name: str
    system: str
    questions: tuple[str, ...]


def doc_conversations(count: int, turns: int, *, seed: int = 0, words: int = 40) -> list[Conversation]:
    """`count` conversations of `turns` questions each, every question about another doc passage."""
    passages = doc_passages(words)
    convs = []
    for c in range(count):
        questions = []
        for t in range(turns):
            passage = passages[(seed * 7919 + c * turns + t) % len(passages)]
            questions.append(
                f'Here is a passage from the documentation:\n"{passage}"\n{_ASKS[(c + t) % len(_ASKS)]}'
            )
        convs.append(Conversation(f"s{seed}c{c}", SYSTEM_PROMPT, tuple(questions)))
    return convs


@dataclass
class TurnResult:
    conversation: str
    turn: int  # 1-based
    request_id: str
    answer: ChatAnswer | None = None
    started: float = 0.0  # time.monotonic()
    ended: float = 0.0
    failures: list[tuple[float, float, str]] = field(default_factory=list)  # (started, ended, error)


@dataclass
class ConversationRun:
    conversation: Conversation
    turns: list[TurnResult] = field(default_factory=list)
    error: str = ""  # set when a turn failed even after its retries; later turns were not sent

    def token_ids(self) -> list[list[int]]:
        return [t.answer.token_ids if t.answer else [] for t in self.turns]


def run_conversation(
    url: str,
    conv: Conversation,
    *,
    model: str,
    max_tokens: int,
    cache_salt: str | None = None,
    retries: int = 1,
    retry_pause_s: float = 0.5,
    timeout: float = 300.0,
    on_turn: Callable[[TurnResult], None] | None = None,
) -> ConversationRun:
    run = ConversationRun(conv)
    messages = [{"role": "system", "content": conv.system}]
    tag = uuid.uuid4().hex[:6]
    for number, question in enumerate(conv.questions, start=1):
        messages.append({"role": "user", "content": question})
        body = chat_body(messages, model=model, max_tokens=max_tokens, cache_salt=cache_salt)
        result = TurnResult(conv.name, number, f"chat-{conv.name}-t{number}-{tag}")
        run.turns.append(result)
        for attempt in range(retries + 1):
            started = time.monotonic()
            result.started = result.started or started
            try:
                result.answer = stream_chat(url, body, f"{result.request_id}-a{attempt}", timeout=timeout)
                result.ended = time.monotonic()
                break
            except Exception as e:  # any failure is recorded; the fault tests judge them
                result.failures.append((started, time.monotonic(), f"{type(e).__name__}: {e}"))
                time.sleep(retry_pause_s)
        if result.answer is None:
            run.error = f"turn {number}: {result.failures[-1][2]}"
            return run
        if on_turn is not None:
            on_turn(result)
        messages.append({"role": "assistant", "content": result.answer.text})
    return run


def run_conversations(
    url: str,
    convs: list[Conversation],
    *,
    model: str,
    max_tokens: int,
    salt_prefix: str | None = None,
    retries: int = 1,
    on_turn: Callable[[TurnResult], None] | None = None,
) -> list[ConversationRun]:
    """Every conversation in its own thread, all at once; returns when all are done.

    `salt_prefix` gives each conversation its own cache_salt (`PREFIX-name`): a
    namespace no other run shares, so only the serving engine's own prefix
    cache of that conversation's earlier turns can help it."""
    runs: list[ConversationRun | None] = [None] * len(convs)

    def one(i: int) -> None:
        salt = f"{salt_prefix}-{convs[i].name}" if salt_prefix else None
        runs[i] = run_conversation(
            url,
            convs[i],
            model=model,
            max_tokens=max_tokens,
            cache_salt=salt,
            retries=retries,
            on_turn=on_turn,
        )

    threads = [threading.Thread(target=one, args=(i,), name=f"chat-{c.name}") for i, c in enumerate(convs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in runs if r is not None]


def mismatches(runs: list[ConversationRun], reference: list[ConversationRun]) -> list[str]:
    """Turns whose answer tokens differ from the reference run's (same conversations, same order)."""
    out = []
    for run, ref in zip(runs, reference, strict=True):
        for mine, theirs in zip(run.token_ids(), ref.token_ids(), strict=False):
            if mine != theirs:
                out.append(f"{run.conversation.name}: {mine} != {theirs}")
                break
    return out

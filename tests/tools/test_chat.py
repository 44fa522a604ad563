"""The chat client and conversation runner the demo, the real-model tests and bench.fleet.chat_load use,
against a small HTTP server that streams what vLLM streams (no engine needed)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvbroker.tools.chat import ChatStreamError, chat_body, stream_chat
from testkit.chat import doc_conversations, doc_passages, mismatches, run_conversation


class _Engine(BaseHTTPRequestHandler):
    """Answers each chat with token ids [len(messages), 7, 8]; `fail_next` streams an error event."""

    fail_next = 0
    bodies: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        n = len(body["messages"])
        chunks: list[dict[str, Any]] = [
            {"prompt_token_ids": list(range(n * 10)), "choices": [{"delta": {"role": "assistant"}}]},
            {"choices": [{"delta": {"content": f"answer{n}"}, "token_ids": [n]}]},
        ]
        if type(self).fail_next:
            type(self).fail_next -= 1
            chunks.append({"error": {"message": "engine died mid-stream", "code": 502}})
        else:
            chunks.append(
                {"choices": [{"delta": {"content": " done"}, "token_ids": [7, 8], "finish_reason": "stop"}]}
            )
            chunks.append({"choices": [], "usage": {"prompt_tokens": n * 10, "completion_tokens": 3}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("X-KVBroker-Mode", "pd")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine_url() -> Iterator[str]:
    _Engine.fail_next, _Engine.bodies = 0, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_stream_chat_collects_text_token_ids_prompt_and_ttft(engine_url: str) -> None:
    body = chat_body([{"role": "user", "content": "hi"}], model="m", max_tokens=8, cache_salt="s")
    assert body["return_token_ids"] is True and body["temperature"] == 0 and "ignore_eos" not in body
    answer = stream_chat(engine_url, body, "req-1")
    assert (answer.text, answer.token_ids, answer.prompt_token_ids) == (
        "answer1 done",
        [1, 7, 8],
        list(range(10)),
    )
    assert answer.finish_reason == "stop" and answer.usage["completion_tokens"] == 3
    assert answer.header("x-kvbroker-mode") == "pd" and answer.ttft_s is not None
    assert 0 < answer.ttft_s <= answer.total_s
    assert _Engine.bodies[0]["cache_salt"] == "s"


def test_stream_error_event_raises(engine_url: str) -> None:
    _Engine.fail_next = 1
    with pytest.raises(ChatStreamError, match="engine died mid-stream"):
        stream_chat(engine_url, chat_body([{"role": "user", "content": "hi"}], model="m", max_tokens=8), "r")


def test_conversation_carries_answers_and_retries_a_failed_turn_once(engine_url: str) -> None:
    (conv,) = doc_conversations(1, 3, seed=4)
    _Engine.fail_next = 1
    run = run_conversation(engine_url, conv, model="m", max_tokens=8, retry_pause_s=0)
    assert not run.error
    assert [len(t.failures) for t in run.turns] == [1, 0, 0]
    # Turn k's request holds the system prompt, k questions and k - 1 answers.
    assert [len(b["messages"]) for b in _Engine.bodies] == [2, 2, 4, 6]
    assert _Engine.bodies[2]["messages"][2] == {"role": "assistant", "content": "answer2 done"}
    assert run.token_ids() == [[2, 7, 8], [4, 7, 8], [6, 7, 8]]
    assert mismatches([run], [run]) == []


def test_a_turn_that_keeps_failing_ends_the_conversation(engine_url: str) -> None:
    (conv,) = doc_conversations(1, 3, seed=4)
    _Engine.fail_next = 2
    run = run_conversation(engine_url, conv, model="m", max_tokens=8, retries=1, retry_pause_s=0)
    assert run.error.startswith("turn 1: ChatStreamError") and len(run.turns) == 1


def test_doc_conversations_are_prose_from_the_docs_and_deterministic() -> None:
    passages = doc_passages(30)
    assert len(passages) > 20 and all(len(p.split()) <= 30 for p in passages)
    assert not any(p.startswith(("|", "#", "```")) for p in passages)
    first, again = doc_conversations(8, 5, seed=1), doc_conversations(8, 5, seed=1)
    assert first == again and len({q for c in first for q in c.questions}) == 40

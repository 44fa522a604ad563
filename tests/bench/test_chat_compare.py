"""Pieces of bench.chats.compare that need no engine: the NixlConnector proxy's
conversation bookkeeping and request shapes, the proxy end to end against fake
P and D servers, the prompt sizing, and the results (identical answers, targets).

The real run (four setups, real vLLM engines) is `python -m bench.chats.compare --quick`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bench.chats.nixl_proxy import (
    CONVERSATION_HEADER,
    ConversationBook,
    as_stream_chunks,
    build_app,
    decode_request,
    prefill_request,
)
from bench.chats.results import compare_answers, per_turn, targets
from bench.chats.workload import chat_body, fit_message, stream_chat
from testkit.http import serve_app

D_PARAMS = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[3, 4, 5]],
    "remote_engine_id": "D-nixl",
    "remote_request_id": "chatcmpl-1",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "remote_num_tokens": 95,
    "tp_size": 1,
}


def test_first_turn_is_a_plain_remote_decode_prefill() -> None:
    book = ConversationBook()
    assert book.prefill_params("c1") == {"do_remote_decode": True}
    assert book.prefill_params(None) == {"do_remote_decode": True}
    assert book.stats.turns == 2 and book.stats.offered_read_back == 0


def test_next_turn_offers_ds_blocks_to_p() -> None:
    book = ConversationBook()
    book.remember("c1", D_PARAMS)
    params = book.prefill_params("c1")
    assert params["remote_block_ids"] == [[3, 4, 5]] and params["remote_engine_id"] == "D-nixl"
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert book.prefill_params("c2") == {"do_remote_decode": True}  # another conversation: nothing
    assert book.stats.offered_read_back == 1 and book.stats.decode_params_kept == 1


def test_a_turn_without_params_forgets_the_older_blocks() -> None:
    book = ConversationBook()
    book.remember("c1", D_PARAMS)
    book.remember("c1", None)  # e.g. D streamed: its new blocks are unknown, the old ones superseded
    assert book.prefill_params("c1") == {"do_remote_decode": True}
    assert book.stats.decode_params_missing == 1 and len(book) == 0


def test_incomplete_params_are_not_offered() -> None:
    book = ConversationBook()
    book.remember("c1", {k: v for k, v in D_PARAMS.items() if k != "remote_port"})
    assert book.prefill_params("c1") == {"do_remote_decode": True}


def test_book_is_bounded_least_recent_out() -> None:
    book = ConversationBook(max_conversations=2)
    for c in ("a", "b", "c"):
        book.remember(c, D_PARAMS)
    assert len(book) == 2
    assert book.prefill_params("a") == {"do_remote_decode": True}
    assert book.prefill_params("c")["remote_block_ids"] == [[3, 4, 5]]


def test_request_shapes() -> None:
    body = chat_body([{"role": "user", "content": "hi"}], 32)
    p = prefill_request(body, {"do_remote_decode": True})
    assert (
        p["max_tokens"] == 1 and p["stream"] is False and "min_tokens" not in p and "stream_options" not in p
    )
    assert p["kv_transfer_params"] == {"do_remote_decode": True} and p["messages"] == body["messages"]
    d = decode_request(body, {"x": 1}, stream=False)
    assert d["stream"] is False and "stream_options" not in d and d["min_tokens"] == 32
    assert body["stream"] is True  # the client's body is not changed


def test_non_streamed_answer_as_sse_chunks() -> None:
    answer = {
        "id": "x",
        "model": "m",
        "choices": [
            {"index": 0, "message": {"content": "Paris."}, "token_ids": [7, 8], "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 10},
    }
    chunks = as_stream_chunks(answer)
    assert chunks[-1] == b"data: [DONE]\n\n"
    first = json.loads(chunks[0].decode()[len("data: ") :])
    assert first["choices"][0]["delta"]["content"] == "Paris." and first["choices"][0]["token_ids"] == [7, 8]
    assert json.loads(chunks[1].decode()[len("data: ") :])["usage"] == {"prompt_tokens": 10}


async def _fake_engine(role: str, seen: list[dict[str, Any]]) -> tuple[Any, str]:
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"role": role, **body})
        n = len(seen)
        params = (
            {**D_PARAMS, "remote_request_id": f"{role}-{n}"} if role == "D" else {"do_remote_prefill": True}
        )
        choice = {
            "index": 0,
            "message": {"content": f"answer {n}"},
            "token_ids": [n],
            "finish_reason": "length",
        }
        return web.json_response({"id": str(n), "choices": [choice], "kv_transfer_params": params})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return await serve_app(app)


async def test_proxy_carries_ds_params_to_the_next_turn_of_the_same_conversation() -> None:
    seen: list[dict[str, Any]] = []
    p_runner, p_url = await _fake_engine("P", seen)
    d_runner, d_url = await _fake_engine("D", seen)
    runner, url = await serve_app(build_app(p_url, d_url, decode_stream=False))
    try:
        body = chat_body([{"role": "user", "content": "hi"}], 8)
        t1 = await asyncio.to_thread(stream_chat, url, body, {CONVERSATION_HEADER: "c1"})
        t2 = await asyncio.to_thread(stream_chat, url, body, {CONVERSATION_HEADER: "c1"})
        t3 = await asyncio.to_thread(stream_chat, url, body, {CONVERSATION_HEADER: "other"})
    finally:
        for r in (runner, p_runner, d_runner):
            await r.cleanup()
    assert [s["role"] for s in seen] == ["P", "D"] * 3
    p1, d1, p2, _, p3, _ = seen
    assert p1["kv_transfer_params"] == {"do_remote_decode": True} and p1["max_tokens"] == 1
    assert d1["kv_transfer_params"] == {"do_remote_prefill": True} and d1["stream"] is False
    # Turn 2 of c1: P gets what D returned for turn 1, so it may read the history back from D.
    assert p2["kv_transfer_params"]["remote_request_id"] == "D-2"
    assert p2["kv_transfer_params"]["do_remote_decode"] is True
    assert p3["kv_transfer_params"] == {"do_remote_decode": True}
    assert (t1.text, t2.text, t3.text) == ("answer 2", "answer 4", "answer 6")
    assert t1.token_ids == [2] and t1.ttft_s > 0


class _CharTokenizer:
    """One token per 4 characters, plus 20 for the template."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> list[int]:
        return [0] * (20 + len(messages[0]["content"]) // 4)


def test_fit_message_hits_the_target_from_below() -> None:
    text, n = fit_message(_CharTokenizer(), "x" * 100_000, 2048)
    assert n == 2048 and text.endswith("section by section.")
    short, n_short = fit_message(_CharTokenizer(), "tiny doc", 2048)
    assert "tiny doc" in short and n_short < 2048


def _row(setup: str, turn: int, ttft: float, ids: list[int], prompt: int = 2100) -> dict[str, Any]:
    return {
        "setup": setup,
        "conversation": "c0",
        "turn": turn,
        "prompt_tokens": prompt,
        "answer_tokens": len(ids),
        "ttft_s": ttft,
        "turn_s": ttft + 1,
        "cached_tokens": 0,
        "token_ids": ids,
    }


def _setups(broker_ids: list[int]) -> dict[str, Any]:
    ttfts = {"single": (5.0, 0.2), "nocache": (5.0, 5.0), "nixl": (6.0, 2.0), "broker": (5.5, 0.25)}
    return {
        name: {
            "available": True,
            "wall_s": 10.0,
            "rows": [
                _row(name, 1, t1, [1, 2], prompt=2048),
                _row(name, 2, t2, broker_ids if name == "broker" else [3, 4]),
            ],
        }
        for name, (t1, t2) in ttfts.items()
    }


def test_answers_compared_across_every_setup() -> None:
    assert compare_answers(_setups([3, 4]))["all"] is True
    different = compare_answers(_setups([3, 5]))
    assert different["all"] is False and not different["cases"]["c0 turn2"]["identical"]


def test_targets_are_ratios_of_p50s() -> None:
    results = per_turn(_setups([3, 4]))
    by = {t["target"]: t for t in targets(results, "full")}
    assert by["turn-2 TTFT: recompute / kvbroker P/D >= 10x"]["value"] == 20.0
    assert by["turn-2 TTFT: recompute / kvbroker P/D >= 10x"]["verdict"] == "met"
    assert by["turn-2 TTFT: kvbroker P/D / prefix-cache hit <= 1.5x"]["value"] == 1.25
    assert by["turn-1 TTFT: kvbroker P/D / one engine <= 1.15x"]["verdict"] == "met"  # 1.10x
    assert by["turn-1 TTFT: kvbroker P/D / NixlConnector P/D < 1x"]["verdict"] == "met"
    quick = targets(results, "quick")
    assert all(t["verdict"].startswith("n/a") for t in quick)


def test_targets_missed_when_slower() -> None:
    setups = _setups([3, 4])
    setups["broker"]["rows"][1]["ttft_s"] = 1.0  # turn 2: 5x the prefix-cache hit, 5x faster than recompute
    by = {t["target"]: t for t in targets(per_turn(setups), "full")}
    assert by["turn-2 TTFT: recompute / kvbroker P/D >= 10x"]["verdict"] == "MISSED"
    assert by["turn-2 TTFT: kvbroker P/D / prefix-cache hit <= 1.5x"]["verdict"] == "MISSED"


def test_a_turn_our_proxy_served_on_one_engine_is_not_counted_as_pd() -> None:
    setups = _setups([3, 4])
    setups["broker"]["rows"][1]["fallback"] = "single: no prefill engine answered"
    turn2 = per_turn(setups)["broker"]["turn2"]
    assert turn2["ok"] == 0 and turn2["fallback"] == 1 and turn2["failed"] == 0 and "ttft" not in turn2
    by = {t["target"]: t for t in targets(per_turn(setups), "full")}
    assert by["turn-2 TTFT: recompute / kvbroker P/D >= 10x"]["verdict"] == "not measured"


def test_follow_ups_are_sized_as_asked_and_the_workload_is_printed() -> None:
    from bench.chats.compare import workload_line
    from bench.chats.workload import sized_follow_up

    class Words:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [0] * len(text.split())

    excerpt = " ".join(f"w{i}" for i in range(500))
    message = sized_follow_up(Words(), "Why is that?", excerpt, 120)
    assert message.startswith("Why is that?") and len(message.split()) == 120
    line = workload_line(
        {
            "first_prompt_tokens": [2048],
            "follow_up_tokens": "96-160",
            "answer_tokens": 96,
            "concurrency": 2,
            "cores": "P/D setups: P pinned to 1 core, D to the other; one-engine setups: 2 cores",
        }
    )
    assert "follow-ups 96-160 tokens" in line and "2 chat(s) at once" in line and "1 core" in line

"""Drive a plan's sessions against one OpenAI URL, all at once, and time every turn at the client.

Each session is a task: it waits for its arrival, sends turn 1 as a streamed greedy
`/v1/completions` request with a token-id prompt (`ignore_eos`, `answer_tokens` tokens,
usage in the stream), appends the model's answer to its history, thinks, sends turn 2,
and so on. A failed turn ends its session (its history cannot grow without the answer):
the turn counts as failed and the turns it would have sent as not sent.

A turn records its TTFT (sending to the first token), its time per output token after
the first (TPOT), its prompt tokens and the cached tokens vLLM reported in
`usage.prompt_tokens_details.cached_tokens` (engines run with
`--enable-prompt-tokens-details`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from bench.fleet.agent_sessions import Plan, Session

SESSION_HEADER = "X-Conversation-Id"  # bench.chats.nixl_proxy and bench.fleet.router key turns by it


@dataclass
class Turn:
    sid: str
    turn: int
    sent_s: float  # since the run started
    prompt_tokens: int
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunRecord:
    turns: list[Turn]
    not_sent: int
    wall_s: float
    outputs: dict[str, list[list[int]]]  # session id -> every answer's token ids


async def one_turn(http: Any, url: str, body: dict[str, Any], sid: str, turn: Turn) -> list[int]:
    """One streamed `/v1/completions` request (`body` asks for `return_token_ids`): the answer's
    token ids; `turn` gets its TTFT, end-to-end time, output and cached tokens. RuntimeError on a
    status other than 200, an error in the stream, or a stream with no token."""
    ids: list[int] = []
    sent = time.perf_counter()
    async with http.post(f"{url}/v1/completions", json=body, headers={SESSION_HEADER: sid}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        buffer = b""
        async for chunk in resp.content.iter_any():
            buffer += chunk
            while b"\n" in buffer:
                raw, buffer = buffer.split(b"\n", 1)
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                msg = json.loads(data)
                if "error" in msg:
                    raise RuntimeError(f"stream error: {str(msg['error'])[:300]}")
                for choice in msg.get("choices") or []:
                    new = choice.get("token_ids") or []
                    if new and not ids:
                        turn.ttft_s = time.perf_counter() - sent
                    ids.extend(new)
                usage = msg.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    turn.cached_tokens = int(details["cached_tokens"])
    turn.e2e_s = time.perf_counter() - sent
    turn.output_tokens = len(ids)
    if not ids:
        raise RuntimeError("the stream carried no token")
    return ids


async def _session(
    http: Any,
    url: str,
    plan: Plan,
    session: Session,
    model: str,
    salt: str,
    started: float,
    record: RunRecord,
    timeout_s: float,
) -> None:
    await asyncio.sleep(max(0.0, started + session.start_s - time.perf_counter()))
    answers: list[list[int]] = []
    for k in range(session.turns):
        if k:
            await asyncio.sleep(session.think_s[k - 1])
        prompt = plan.prompt(session, k, answers)
        turn = Turn(session.sid, k, time.perf_counter() - started, len(prompt))
        record.turns.append(turn)
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": plan.spec.answer_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": salt,
        }
        try:
            ids = await asyncio.wait_for(one_turn(http, url, body, session.sid, turn), timeout_s)
        except (TimeoutError, RuntimeError, OSError, ValueError, aiohttp.ClientError) as e:
            turn.error = f"{type(e).__name__}: {e}"[:400]
            record.not_sent += session.turns - k - 1
            return
        answers.append(ids)
        record.outputs.setdefault(session.sid, []).append(ids)


async def _run(url: str, plan: Plan, model: str, salt: str, timeout_s: float) -> RunRecord:
    record = RunRecord([], 0, 0.0, {})
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout_s)
    ) as http:
        started = time.perf_counter()
        await asyncio.gather(
            *(_session(http, url, plan, s, model, salt, started, record, timeout_s) for s in plan.sessions)
        )
        record.wall_s = time.perf_counter() - started
    return record


def warm_up(url: str, *, model: str, requests: int, prompt_tokens: int = 64) -> None:
    """`requests` short requests one after another (a round robin reaches every engine), so that
    no run's first turns pay for the engines' first steps; raises when one fails."""
    import urllib.request

    for i in range(requests):
        body = {
            "model": model,
            "prompt": [10 + (i * 31 + k) % 300 for k in range(prompt_tokens)],
            "max_tokens": 4,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_salt": f"warm-up-{i}",
        }
        req = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", SESSION_HEADER: f"warm-up-{i}"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            resp.read()


def drive(url: str, plan: Plan, *, model: str, salt: str, timeout_s: float = 300.0) -> RunRecord:
    """Run every session of `plan` against `url` (an OpenAI server or router); `salt` (vLLM's
    cache_salt) keeps this run's prefixes apart from every earlier run's on the same engines."""
    return asyncio.run(_run(url, plan, model, salt, timeout_s))

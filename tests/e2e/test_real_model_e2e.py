"""Real chats on a real model, end to end: SmolLM2-135M-Instruct (30 layers) on a real broker
process, a prefill engine P and a decode engine D (vLLM CPU build, our connector, real NIXL) and
the P/D proxy, all started once for the module.

Every conversation goes through the proxy as chat text (the model's chat template): turn 1
prefills on P and decodes on D; D holds the finished turn (prompt + answer, `multi_turn`), and
turn 2's prompt starts with those blocks, so P pulls them from D instead of recomputing. Each
output is compared token for token with one engine answering the same conversation alone (P,
under a cache_salt nobody else uses). The fault tests run last: the broker is killed and
restarted under load, then D is killed under load.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import wire_chain
from kvbroker.tools.chat import chat_body, stream_chat
from kvbroker.tools.launch import EngineProcess
from kvbroker.v1 import broker_pb2 as pb
from testkit.chat import (
    Conversation,
    ConversationRun,
    doc_conversations,
    mismatches,
    run_conversations,
)
from testkit.engines import BLOCK_SIZE, SESSION_TTL_MS, read_stats, start_engine
from testkit.processes import BrokerProcess, ProxyProcess
from testkit.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "smollm2"
THRESHOLD = 32  # one block: a one-block answer is still pulled
HOLD_TTL_MS = 8000  # D's multi-turn holds end this long after a turn nobody continues
P_HOLD_TTL_MS = 30000  # the adapter's default, for P's holds a D has not read
KV_CACHE_BYTES = 512 << 20  # about 340 blocks of 1.5 MB
CONVERSATIONS, TURNS, MAX_TOKENS, WORDS = 8, 5, 24, 30


@dataclass
class Cluster:
    broker: BrokerProcess
    p: EngineProcess
    d: EngineProcess
    proxy_url: str
    stats: dict[str, Path]
    log_dir: Path

    def stat(self, name: str, key: str) -> int:
        time.sleep(0.3)  # the stats file is written from a thread, a moment after the answer
        return int(read_stats(self.stats[name], settle=False).get(key, 0))


def _ranked(client: BrokerClient) -> set[str]:
    return {e.engine_id for e in client.list_engines().engines if e.ranks and e.ranks[0].agent_name}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from kvbroker.tools.real_model import RealModelError, ensure_real_model

    try:
        model = ensure_real_model()
    except RealModelError as e:
        pytest.skip(str(e))
    log_dir = tmp_path_factory.mktemp("real-e2e")
    broker = BrokerProcess(log_dir).start()
    engines: list[EngineProcess] = []
    proxy: ProxyProcess | None = None
    holder: dict[str, BrokerProcess] = {"broker": broker}
    try:
        common: dict[str, Any] = dict(
            broker_address=broker.address,
            kv_cache_bytes=KV_CACHE_BYTES,
            served_model_name=MODEL,
            kv_recompute_threshold=THRESHOLD,
        )
        # P's holds wait for D's pull (the adapter's default TTL, generous for a starved host);
        # D's multi-turn holds end soon after a conversation's last turn.
        p, p_stats = start_engine(model, log_dir, name="P", role="prefill", **common)
        engines.append(p)
        d, d_stats = start_engine(
            model, log_dir, name="D", role="decode", multi_turn=True, hold_ttl_ms=HOLD_TTL_MS, **common
        )
        engines.append(d)
        for engine in engines:
            engine.wait_ready(timeout=600, progress=print)
        with BrokerClient(broker.address) as client:
            assert wait_for(lambda: _ranked(client) == {"P", "D"}, 30), "engines did not register"
        proxy = ProxyProcess(
            log_dir / "proxy.log",
            prefill={"P": p.url},
            decode={"D": d.url},
            broker=broker.address,
            # Every turn prefills on P, so turn 2 pulls the history D holds (the default
            # would let D, holding all but the new message, serve the turn alone).
            local_prefill_tokens=0,
        )
        proxy.start()
        print(f"real-model e2e logs in {log_dir}")
        running = Cluster(broker, p, d, proxy.url, {"P": p_stats, "D": d_stats}, log_dir)
        yield running
        holder["broker"] = running.broker  # the broker test replaces it
    finally:
        if proxy is not None:
            proxy.stop()
        for engine in engines:
            engine.stop()
        holder["broker"].stop()
        broker.stop()


@dataclass
class Load:
    """The conversations every load test runs (each under its own cache_salt, so no run finds
    another's blocks), and their answers from P alone: the reference, computed once."""

    convs: list[Conversation]
    reference: list[ConversationRun]

    def run(self, cluster: Cluster, **kw: Any) -> list[ConversationRun]:
        salt = f"load-{uuid.uuid4().hex[:8]}"
        return run_conversations(
            cluster.proxy_url, self.convs, model=MODEL, max_tokens=MAX_TOKENS, salt_prefix=salt, **kw
        )


@pytest.fixture(scope="module")
def load(cluster: Cluster) -> Load:
    convs = doc_conversations(CONVERSATIONS, TURNS, seed=1, words=WORDS)
    # On P alone under a fresh cache_salt: only P's own prefix cache of each
    # conversation's earlier turns helps it (no pull can).
    reference = run_conversations(
        cluster.p.url, convs, model=MODEL, max_tokens=MAX_TOKENS, salt_prefix=f"ref-{uuid.uuid4().hex[:8]}"
    )
    assert all(not r.error for r in reference), [r.error for r in reference]
    return Load(convs, reference)


def _active_leases(cluster: Cluster) -> list[Any]:
    with BrokerClient(cluster.broker.address) as client:
        return list(client.list_leases().leases)


def _assert_nothing_pinned(cluster: Cluster, engines: tuple[str, ...]) -> None:
    """After the hold TTL: no lease is active at the broker and no engine keeps blocks for a reader."""
    deadline_s = max(HOLD_TTL_MS, P_HOLD_TTL_MS) / 1000 + SESSION_TTL_MS / 1000 + 5
    assert wait_for(lambda: not _active_leases(cluster), deadline_s, 0.5), (
        f"leases still active: {[(le.holder_engine_id, le.reader_engine_id, le.state) for le in _active_leases(cluster)]}"
    )
    for name in engines:
        assert wait_for(lambda n=name: cluster.stat(n, "held_blocks") == 0, 5), f"{name} still holds blocks"


def _failures(runs: list[ConversationRun]) -> list[tuple[float, float, str]]:
    return [f for run in runs for turn in run.turns for f in turn.failures]


# --------------------------------------------------------------------------- one chat, two turns


def _tokenize_chat(engine: EngineProcess, messages: list[dict[str, str]]) -> list[int]:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    req = urllib.request.Request(
        f"{engine.url}/tokenize", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return list(json.loads(resp.read())["tokens"])


def _wait_until_named(cluster: Cluster, holder: str, tokens: list[int], blocks: int) -> None:
    with BrokerClient(cluster.broker.address) as client:
        layout = next(e.layout_id for e in client.list_engines().engines if e.engine_id == holder)
        namespace = pb.Namespace(layout_id=layout, tenant="")
        hashes = wire_chain(tokens, BLOCK_SIZE)

        def named() -> bool:
            matches = client.resolve(namespace=namespace, block_hashes=hashes).matches
            return any(m.engine_id == holder and m.matched_blocks >= blocks for m in matches)

        assert wait_for(named, 10), f"the broker never named {holder} for {blocks} blocks"
    time.sleep(0.5)  # and P's index mirror has it too


TEACHER = (
    "You are a patient teacher. You explain computing ideas to a curious student in plain words, "
    "with one short example each time, and you build on what you said before."
)
QUESTIONS = (
    "What is a cache in a computer, and why does it make programs faster?",
    "Give me one everyday example of such a cache.",
)


@dataclass
class TwoTurns:
    messages: list[dict[str, str]]
    answers: tuple[list[int], list[int]]
    d_pulled: int  # turn 1: blocks D pulled from P (the prompt P prefilled)
    p_pulled: int  # turn 2: blocks P pulled from D (the history)
    expected_p_pulled: int  # what D holds of turn 2's prompt beyond P's own hit of turn 1's
    d_held: int  # blocks D held after turn 1: its prompt and answer
    rid: str


def _two_turns(cluster: Cluster, system: str) -> TwoTurns:
    """Turn 1 and turn 2 of one chat through the proxy, with what each engine pulled."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]
    rid = f"real-chat-{uuid.uuid4().hex[:6]}"
    before = (cluster.stat("D", "pulled_blocks"), cluster.stat("P", "pulled_blocks"))
    first = stream_chat(cluster.proxy_url, chat_body(messages, model=MODEL, max_tokens=64), f"{rid}-t1")
    assert first.header("X-KVBroker-Mode") == "pd" and first.text.strip()
    d_pulled = cluster.stat("D", "pulled_blocks") - before[0]
    prompt1, answer1 = first.prompt_token_ids, first.token_ids
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": QUESTIONS[1]}]
    turn2 = _tokenize_chat(cluster.p, messages)
    # What D computed for turn 1 (its last answer token is sampled, never computed) and holds:
    d_tokens = prompt1 + answer1[:-1]
    common = next((i for i, (a, b) in enumerate(zip(d_tokens, turn2, strict=False)) if a != b), len(d_tokens))
    # The chat template renders the answer text back into the same token ids:
    # turn 2 shares every full block D computed, the answer's included.
    assert common >= len(d_tokens) - 1, f"turn 2 diverges from turn 1 + answer at token {common}"
    shared_blocks = min(common, len(d_tokens)) // BLOCK_SIZE
    p_local = len(prompt1) // BLOCK_SIZE  # P prefilled turn 1's prompt itself
    assert shared_blocks > p_local, "the answer adds no full block beyond the prompt: test set-up"
    _wait_until_named(cluster, "D", turn2, shared_blocks)
    second = stream_chat(cluster.proxy_url, chat_body(messages, model=MODEL, max_tokens=64), f"{rid}-t2")
    assert second.header("X-KVBroker-Mode") == "pd"
    return TwoTurns(
        messages,
        (answer1, second.token_ids),
        d_pulled,
        cluster.stat("P", "pulled_blocks") - before[1],
        shared_blocks - p_local,
        len(d_tokens) // BLOCK_SIZE,
        rid,
    )


def test_turn_two_pulls_turn_one_prompt_and_answer_from_decode(cluster: Cluster) -> None:
    chat = _two_turns(cluster, TEACHER)
    # P had turn 1's prompt in its own prefix cache and pulled the rest of what D holds.
    assert chat.p_pulled == chat.expected_p_pulled
    with BrokerClient(cluster.broker.address) as client:
        leases = client.list_leases(engine_id="D", include_ended=True).leases
    (hold,) = [le for le in leases if f"{chat.rid}-t1" in le.request_id and le.holder_engine_id == "D"]
    assert hold.reader_engine_id == "P" and hold.state == pb.LEASE_RELEASED
    assert len(hold.block_hashes) == chat.d_held  # prompt + answer, all of it

    # One engine answering the same conversation alone gives the same tokens.
    salt = f"ref-{uuid.uuid4().hex[:8]}"
    alone = [
        stream_chat(cluster.p.url, chat_body(msgs, model=MODEL, max_tokens=64, cache_salt=salt), f"alone{i}")
        for i, msgs in enumerate((chat.messages[:2], chat.messages))
    ]
    assert (alone[0].token_ids, alone[1].token_ids) == chat.answers


# --------------------------------------------------------------------------- load


def test_concurrent_conversations_match_one_engine_and_leave_no_lease(cluster: Cluster, load: Load) -> None:
    p_pulled_before = cluster.stat("P", "pulled_blocks")
    started = time.monotonic()
    runs = load.run(cluster, retries=0)
    elapsed = time.monotonic() - started
    assert not _failures(runs) and not [r.error for r in runs if r.error]
    turns = [t for r in runs for t in r.turns]
    assert len(turns) == CONVERSATIONS * TURNS
    # Every turn goes through P and pulls, except a turn D holds the history of while P is busy with
    # another conversation's prefill: D computes the rest itself (the proxy weighs P's queue).
    modes = [t.answer.header("X-KVBroker-Mode") if t.answer is not None else None for t in turns]
    assert set(modes) <= {"pd", "local"} and "pd" in modes, modes
    p_pulled = cluster.stat("P", "pulled_blocks") - p_pulled_before
    print(f"{len(turns)} turns in {elapsed:.1f} s; P pulled {p_pulled} blocks of history from D")
    assert p_pulled > 0, "no turn pulled its history from D"
    assert mismatches(runs, load.reference) == []
    # Only D's holds of each conversation's last turn may remain, until their TTL.
    for lease in _active_leases(cluster):
        assert (lease.holder_engine_id, lease.reader_engine_id, lease.state) == ("D", "", pb.LEASE_HELD)
    _assert_nothing_pinned(cluster, ("P", "D"))


def _in_background(cluster: Cluster, load: Load) -> tuple[threading.Thread, list[ConversationRun], list[int]]:
    out: list[ConversationRun] = []
    done = [0]

    def count(_: Any) -> None:
        done[0] += 1

    thread = threading.Thread(target=lambda: out.extend(load.run(cluster, on_turn=count)), daemon=True)
    thread.start()
    return thread, out, done


# --------------------------------------------------------------------------- faults under load (last)


def test_broker_killed_and_restarted_under_load_costs_recomputes_not_errors(
    cluster: Cluster, load: Load
) -> None:
    thread, runs, done = _in_background(cluster, load)
    assert wait_for(lambda: done[0] >= CONVERSATIONS, 300, 0.1), "the load did not get going"
    cluster.broker.kill9()
    killed_at = done[0]
    time.sleep(3)  # turns go on without a broker: recomputed
    during_outage = done[0] - killed_at
    cluster.broker = BrokerProcess(cluster.log_dir, port=cluster.broker.port, log_name="broker-2.log").start()
    with BrokerClient(cluster.broker.address) as client:
        assert wait_for(lambda: _ranked(client) == {"P", "D"}, 60, 0.2), "engines did not re-register"
    thread.join(600)
    assert not thread.is_alive()
    print(f"broker killed after {killed_at} turns; {during_outage} turns finished while it was down")
    assert not _failures(runs) and not [r.error for r in runs if r.error]
    assert sum(len(r.turns) for r in runs) == CONVERSATIONS * TURNS
    assert mismatches(runs, load.reference) == []
    # Pulls resume with the re-registered engines: P->D, and D->P for the next turn.
    chat = _two_turns(cluster, TEACHER + " You like short answers.")
    # After the load P's own prefix cache may have lost some of turn 1's prompt
    # blocks: it then pulls those from D too, never less than what only D has.
    assert chat.d_pulled > 0 and 0 < chat.expected_p_pulled <= chat.p_pulled <= chat.d_held, chat
    _assert_nothing_pinned(cluster, ("P", "D"))


def test_decode_killed_under_load_in_flight_fail_once_then_all_succeed(cluster: Cluster, load: Load) -> None:
    thread, runs, done = _in_background(cluster, load)
    assert wait_for(lambda: done[0] >= CONVERSATIONS + 2, 300, 0.1), "the load did not get going"
    killed, killed_after = time.monotonic(), done[0]
    cluster.d.kill9()
    thread.join(600)
    assert not thread.is_alive()
    assert not [r.error for r in runs if r.error], "a request failed again after its retry"
    failures = _failures(runs)
    print(f"D killed -9 after {killed_after} turns; {len(failures)} requests in flight on it failed once")
    # Only requests already in flight when D died may fail; the proxy sends every later one to P.
    assert all(started <= killed for started, _, _ in failures), failures
    assert len(failures) <= CONVERSATIONS
    for run in runs:
        assert all(len(t.failures) <= 1 for t in run.turns)
    assert sum(len(r.turns) for r in runs) == CONVERSATIONS * TURNS
    assert mismatches(runs, load.reference) == []
    # P's holds for D end with D's session; nothing stays pinned on the survivor.
    _assert_nothing_pinned(cluster, ("P",))

"""End to end over broker replicas: two `kvbroker serve --state redis://...` processes over one real
redis-server, a prefill engine P and a decode engine D (real vLLM on the tiny model, our connector,
real NIXL) and the P/D proxy, every one of them given both replicas' addresses.

Both engines and the proxy name replica a first, so their sessions and calls start there: the
kill -9 of a then moves every session at once, the holder's and the reader's, in the middle of
pulls in both directions (P -> D for each turn's prompt, D -> P for the history of the next
turn). On a loaded host a client can find a failing fast (its store slow to answer) and start on
b instead: the test then kills the replica that serves most sessions (each replica's
`kvbroker_own_sessions`), and an engine on the survivor must not notice. Cross-replica traffic
(holder on one replica, reader on the other) is covered by tests/process/test_replicas.py with
Python sessions.

Concurrent multi-turn chats run through the proxy while a is killed. Every request must succeed
with the tokens P alone answers for the same conversation; the killed replica's sessions must
resume on the survivor (same session, leases kept) within 2 s of the kill; pulls go on afterwards; no lease ends because of
the failover, and once the holds are read or expired none is left.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from testkit.redis_server import missing_reason

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(420)]

MODEL = "tiny"
THRESHOLD = 32  # one block: short histories are pulled, not recomputed
HOLD_TTL_MS = 8000  # holds nobody reads (the last turn's) end this long after it
CONVERSATIONS, TURNS, MAX_TOKENS, WORDS = 4, 3, 16, 30
FAILOVER_S = 2.0


@dataclass
class Fleet:
    redis: Any  # testkit.redis_server.RedisServer
    a: Any  # testkit.processes.BrokerProcess: a replica, named first in every client's list
    b: Any  # the other
    p: Any  # kvbroker.tools.launch.EngineProcess
    d: Any
    proxy_url: str
    stats: dict[str, Path]
    log_dir: Path
    metrics_ports: dict[str, int] = field(default_factory=dict)  # "a", "b"

    def stat(self, name: str, key: str, *, settle: bool = True) -> int:
        """`settle`: wait a moment first (the stats file is written from a thread, after the answer)."""
        from testkit.engines import read_stats

        if settle:
            time.sleep(0.3)
        return int(read_stats(self.stats[name], settle=False).get(key, 0))

    def own_sessions(self, replica: str) -> int:
        """The engine sessions whose stream the replica serves (its `kvbroker_own_sessions`)."""
        url = f"http://127.0.0.1:{self.metrics_ports[replica]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            found = re.search(r"^kvbroker_own_sessions (\S+)$", resp.read().decode(), re.MULTILINE)
        assert found, f"replica {replica} serves no kvbroker_own_sessions"
        return int(float(found.group(1)))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Fleet]:
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    from kvbroker.clients.sync import BrokerClient
    from testkit.engines import start_engine
    from testkit.ports import free_port
    from testkit.processes import SERVE, BrokerProcess, ProxyProcess
    from testkit.redis_server import RedisServer
    from testkit.waiting import wait_for

    log_dir = tmp_path_factory.mktemp("replicas-e2e")
    redis = RedisServer(log_dir / "redis")
    redis.start()
    parts: list[Any] = []
    try:
        replicas = []
        metrics_ports = {"a": free_port(), "b": free_port()}
        for name in ("a", "b"):
            args = ["--state", redis.url, "--metrics-port", str(metrics_ports[name])]
            replicas.append(BrokerProcess(log_dir, args, command=SERVE, log_name=f"replica-{name}.log"))
            parts.append(replicas[-1].start())
        a, b = replicas
        both = f"{a.address},{b.address}"
        common: dict[str, Any] = dict(
            broker_address=both,
            served_model_name=MODEL,
            kv_recompute_threshold=THRESHOLD,
            hold_ttl_ms=HOLD_TTL_MS,
        )
        p, p_stats = start_engine(tiny_model_dir, log_dir, name="prefill-0", role="prefill", **common)
        parts.append(p)
        # D holds each finished turn (prompt + answer) so that the next turn's prefill pulls it.
        d, d_stats = start_engine(
            tiny_model_dir, log_dir, name="decode-0", role="decode", multi_turn=True, **common
        )
        parts.append(d)
        for engine in (p, d):
            engine.wait_ready(timeout=600, progress=print)
        with BrokerClient(a.address) as client:

            def ranked() -> set[str]:
                return {
                    e.engine_id for e in client.list_engines().engines if e.ranks and e.ranks[0].agent_name
                }

            assert wait_for(lambda: ranked() == {"prefill-0", "decode-0"}, 90), "engines did not register"
        proxy = ProxyProcess(
            log_dir / "proxy.log",
            prefill={"prefill-0": p.url},
            decode={"decode-0": d.url},
            broker=both,
            # Every turn prefills on P, so turn 2 pulls the history D holds.
            local_prefill_tokens=0,
        )
        parts.append(proxy)
        proxy.start()
        print(f"replicas e2e logs in {log_dir}")
        fleet = Fleet(redis, a, b, p, d, proxy.url, {"P": p_stats, "D": d_stats}, log_dir, metrics_ports)
        yield fleet
    finally:
        for part in reversed(parts):
            with contextlib.suppress(Exception):
                part.stop()
        redis.stop()


@dataclass
class EngineEvents:
    """A Watch stream on one replica (its own events: Watch is per replica), timed on arrival."""

    address: str
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (monotonic, kind, engine)
    _client: Any = None
    _thread: threading.Thread | None = None

    def start(self) -> EngineEvents:
        from kvbroker.clients.sync import BrokerClient

        self._client = BrokerClient(self.address)
        self._client.wait_ready(timeout=10)
        opened = threading.Event()

        def follow() -> None:
            with contextlib.suppress(Exception):  # ends when the test closes the client
                stream = self._client.watch(engine_events=True)
                opened.set()
                for event in stream:
                    self.events.append((time.monotonic(), event.kind, event.engine_id))

        self._thread = threading.Thread(target=follow, name="watch", daemon=True)
        self._thread.start()
        opened.wait(5)
        time.sleep(0.3)  # the stream is open on the replica before anything happens
        return self

    def first(self, kind: str, engine_id: str, after: float = 0.0) -> float | None:
        return next((t for t, k, e in list(self.events) if k == kind and e == engine_id and t > after), None)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def test_kill9_of_the_replica_under_pd_chat_load(fleet: Fleet) -> None:
    from kvbroker.clients.sync import BrokerClient
    from kvbroker.tools.chat import chat_body, stream_chat
    from kvbroker.v1 import broker_pb2 as pb
    from testkit.chat import doc_conversations, mismatches, run_conversations
    from testkit.engines import SESSION_TTL_MS
    from testkit.waiting import wait_for

    convs = doc_conversations(CONVERSATIONS, TURNS, seed=3, words=WORDS)
    # The reference: P alone under a cache_salt of each conversation's own, so only P's own prefix
    # cache of the conversation's earlier turns can help it (no pull can).
    reference = run_conversations(
        fleet.p.url, convs, model=MODEL, max_tokens=MAX_TOKENS, salt_prefix=f"ref-{uuid.uuid4().hex[:8]}"
    )
    assert all(not r.error for r in reference), [r.error for r in reference]

    # The replica to kill serves the sessions: both, unless a loaded host's store made one engine's
    # client find the first replica failing fast and start on the other (then it kills a, whose one
    # session moves, and the other engine must not notice).
    own = {r: fleet.own_sessions(r) for r in ("a", "b")}
    assert sum(own.values()) == 2, own
    victim = "a" if own["a"] >= own["b"] else "b"
    survivor = "b" if victim == "a" else "a"
    watch = EngineEvents(getattr(fleet, survivor).address).start()  # a Watch shows the whole fleet
    done = [0]
    runs: list[Any] = []
    load = threading.Thread(
        target=lambda: runs.extend(
            run_conversations(
                fleet.proxy_url,
                convs,
                model=MODEL,
                max_tokens=MAX_TOKENS,
                salt_prefix=f"load-{uuid.uuid4().hex[:8]}",
                retries=0,  # no request may fail
                on_turn=lambda _: done.__setitem__(0, done[0] + 1),
            )
        ),
        daemon=True,
    )
    try:
        load.start()
        # Every first turn answered: the second turns (P pulling D's history) are under way.
        assert wait_for(lambda: done[0] >= CONVERSATIONS, 120, 0.05), "the load did not get going"
        pulled_before = {name: fleet.stat(name, "pulled_tokens", settle=False) for name in ("P", "D")}
        killed, killed_after = time.monotonic(), done[0]
        getattr(fleet, victim).kill9()

        def resumed() -> dict[str, float]:
            return {
                e: t - killed
                for e in ("prefill-0", "decode-0")
                if (t := watch.first("engine_resumed", e, after=killed)) is not None
            }

        assert wait_for(lambda: len(resumed()) == own[victim], 10, 0.01), (
            f"{own[victim]} sessions of replica {victim} did not resume on {survivor}: {watch.events}"
        )
        moved = resumed()
        load.join(300)
        assert not load.is_alive(), "the load did not finish"
    finally:
        watch.close()

    print(
        f"\nsessions per replica {own}; killed {victim} after {killed_after} of "
        f"{CONVERSATIONS * TURNS} turns; sessions resumed on {survivor} "
        + ", ".join(f"{e} {s * 1000:.0f} ms" for e, s in moved.items())
        + " after the kill"
    )
    # The engines' sessions moved, resumed (not registered anew: their leases and blocks stayed),
    # and the engines kept what they held for readers through it. Time the survivor itself did not
    # run (a starved host: it logs each stall) is no failover's to save: it is added to the budget.
    stalled = sum(
        float(s)
        for s in re.findall(
            r"broker did not run for ([\d.]+) s", (fleet.log_dir / f"replica-{survivor}.log").read_text()
        )
    )
    assert max(moved.values()) < FAILOVER_S + stalled, (moved, f"survivor stalled {stalled:.2f} s")
    assert not [e for t, k, e in watch.events if k == "engine_registered" and t > killed], watch.events
    assert fleet.own_sessions(survivor) == 2, "the survivor serves both sessions"
    for name in ("prefill-0", "decode-0"):
        log = (fleet.log_dir / f"{name}.log").read_text(errors="replace")
        assert "held blocks: broker session lost" not in log, f"{name} freed its holds at the kill"
        assert "registered a new broker session" not in log, f"{name} lost its session"
    # Every request through the proxy succeeded.
    failures = [f for run in runs for turn in run.turns for f in turn.failures]
    assert not failures and not [r.error for r in runs if r.error], failures
    turns = [t for r in runs for t in r.turns]
    assert len(turns) == CONVERSATIONS * TURNS
    # Disaggregated, except a turn D holds the history of while P is busy with another chat's
    # prefill: D computes the rest itself (the proxy weighs P's queue).
    modes = [t.answer.header("X-KVBroker-Mode") if t.answer is not None else None for t in turns]
    assert set(modes) <= {"pd", "local"} and "pd" in modes, modes
    assert mismatches(runs, reference) == []
    pulled_during = {name: fleet.stat(name, "pulled_tokens") - pulled_before[name] for name in ("P", "D")}
    print(f"tokens pulled from the kill to the end of the load: {pulled_during}")
    assert pulled_during["D"] > 0, "no turn of the load pulled its prompt after the kill"

    # Pulls go on over the survivor: D pulls a new chat's prompt from P, and P pulls the history of
    # a chat whose first turn only D answered (alone: D holds it, P never saw it).
    def body(messages: list[dict[str, str]], salt: str) -> dict[str, Any]:
        return chat_body(
            messages, model=MODEL, max_tokens=MAX_TOKENS, cache_salt=f"{salt}-{uuid.uuid4().hex[:8]}"
        )

    fresh = [
        {"role": "system", "content": convs[0].system},
        {"role": "user", "content": convs[0].questions[0]},
    ]
    before = {name: fleet.stat(name, "pulled_tokens") for name in ("P", "D")}
    turn = stream_chat(fleet.proxy_url, body(fresh, "after"), "after-pd")
    assert turn.header("X-KVBroker-Mode") == "pd"
    # The stats file is written from a thread after the answer: a loaded host writes it later.
    assert wait_for(lambda: fleet.stat("D", "pulled_tokens", settle=False) > before["D"], 15, 0.2), (
        "D pulled nothing after the failover"
    )
    history = body(fresh, "history")
    first = stream_chat(fleet.d.url, history, "after-on-d")
    history["messages"] = [
        *fresh,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "and?"},
    ]
    time.sleep(1.0)  # D's hold of that turn is announced and in P's index mirror

    # P's load as the proxy last heard it from the broker is the load's until P's next heartbeat (up
    # to a third of its TTL later on a loaded host) and the proxy's next refresh of the engine list:
    # while P reads as busy there the proxy rightly serves the turn on D. Wait for the proxy's view.
    def p_idle_at_proxy() -> bool:
        with urllib.request.urlopen(f"{fleet.proxy_url}/health", timeout=5) as resp:
            engines = json.loads(resp.read())["engines"]
        return all(e["load"] == 0 for e in engines if e["engine_id"] == "prefill-0")

    assert wait_for(p_idle_at_proxy, 30, 0.1), "P still reads as busy at the proxy long after the load"
    second = stream_chat(fleet.proxy_url, history, "after-history")
    assert second.header("X-KVBroker-Mode") == "pd", second.header("X-KVBroker-Route")
    assert wait_for(lambda: fleet.stat("P", "pulled_tokens", settle=False) > before["P"], 15, 0.2), (
        "P pulled no history after the failover"
    )

    # No lease is left once the holds nobody reads have expired, and none ended for the failover.
    with BrokerClient(getattr(fleet, survivor).address) as client:

        def live() -> list[Any]:
            return list(client.list_leases().leases)

        settle_s = HOLD_TTL_MS / 1000 + SESSION_TTL_MS / 1000 + 5
        assert wait_for(lambda: not live(), settle_s, 0.5), [
            (x.holder_engine_id, x.reader_engine_id, pb.LeaseState.Name(x.state)) for x in live()
        ]
        ended = list(client.list_leases(include_ended=True).leases)
        stats = client.stats()
    assert stats.engines == 2, stats
    lost = [x for x in ended if x.cause in (pb.REVOKE_READER_GONE, pb.REVOKE_HOLDER_GONE)]
    assert lost == [], lost
    released = [x for x in ended if x.state == pb.LEASE_RELEASED]
    assert released, "no lease was released: nothing was pulled"
    # A hold whose answer was lost with the replica may exist at the broker, so its holder keeps the
    # blocks until a notice names its request, or else until the backstop (hold TTL + 2 session TTLs).
    backstop_s = HOLD_TTL_MS / 1000 + 2 * SESSION_TTL_MS / 1000
    for name in ("P", "D"):
        settle_s = max(0.0, killed + backstop_s - time.monotonic()) + 5
        assert wait_for(lambda n=name: fleet.stat(n, "held_blocks") == 0, settle_s), (
            f"{name} still holds blocks"
        )

"""A data-parallel fleet end to end: a busy prefix holder's request goes to a free engine that pulls.

One real broker process, two real vLLM engines (CPU build, tiny model, real
NIXL), both in ``kv_both`` with our connector and neither P nor D, and the
proxy with ``--no-disaggregate`` (its load-aware placement, common/placement.py).
A long prompt lands on one engine (A), which then caches its prefix. A is
made busy with long requests sent to it directly (not through the proxy: the
proxy learns A's load only from A's heartbeats to the broker). The next
request sharing the prefix goes to the other engine (B), which pulls the
prefix from A over NIXL, and its greedy output equals one engine computing
the whole prompt itself. And a pull on a busy reader takes the fewest steps
of the reader's scheduler: leased, read and released in the step vLLM
allocated its blocks in, its prefill scheduled in the next.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import wire_chain
from kvbroker.tools.launch import EngineProcess
from kvbroker.v1 import broker_pb2 as pb
from testkit.engines import (
    BLOCK_SIZE,
    complete,
    completion_request,
    output_ids,
    prompt_of,
    read_stats,
    recompute_reference,
    start_engine,
)
from testkit.processes import BrokerProcess, ProxyProcess
from testkit.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(900)]

PREFIX = 512  # 16 full blocks shared by both requests
MAX_TOKENS = 8
STEP_WAIT_MS = 10_000


@dataclass
class Fleet:
    broker: BrokerProcess
    engines: dict[str, EngineProcess]
    stats: dict[str, Path]
    proxy: ProxyProcess


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from kvbroker.tools.tiny_model import build_tiny_model

    log_dir = tmp_path_factory.mktemp("e2e-dp-fleet")
    model = build_tiny_model(log_dir / "model")
    broker = BrokerProcess(log_dir).start()
    engines: dict[str, EngineProcess] = {}
    stats: dict[str, Path] = {}
    proxy: ProxyProcess | None = None
    try:
        for name in ("E1", "E2"):
            # role both, no multi_turn: an engine's prefix cache is what it offers to the others.
            engines[name], stats[name] = start_engine(
                model,
                log_dir,
                name=name,
                broker_address=broker.address,
                role="both",
                # A bound only (a wait ends with the broker's answer): on a loaded test machine
                # the answer may take longer than the default 20 ms, which would cost a step.
                step_wait_ms=STEP_WAIT_MS,
                log_stats=True,  # vLLM's /metrics: how many requests an engine runs (admission's test)
            )
        for engine in engines.values():
            engine.wait_ready(timeout=600, progress=print)
        proxy = ProxyProcess(
            log_dir / "proxy.log",
            engines={name: e.url for name, e in engines.items()},
            broker=broker.address,
            extra_args=["--no-disaggregate", "--refresh-interval-s", "0.2"],
        ).start()
        yield Fleet(broker, engines, stats, proxy)
    finally:
        if proxy is not None:
            proxy.stop()
        for engine in engines.values():
            engine.stop()
        broker.stop()
        print("e2e logs in", log_dir)


def through_proxy(
    fleet: Fleet, prompt: list[int], request_id: str, proxy_url: str = "", max_tokens: int = MAX_TOKENS
) -> tuple[list[int], dict[str, str]]:
    """A greedy completion through the fleet's proxy (or the one at `proxy_url`): its tokens and headers."""
    engine = next(iter(fleet.engines.values()))
    req = completion_request(engine, prompt, max_tokens=max_tokens)
    proxied = urllib.request.Request(
        (proxy_url or fleet.proxy.url) + "/v1/completions",
        data=req.data,
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    with urllib.request.urlopen(proxied, timeout=300) as resp:
        answer = json.loads(resp.read())
        return list(answer["choices"][0]["token_ids"]), dict(resp.headers)


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode())


def proxy_get(fleet: Fleet, path: str) -> str:
    return http_get(fleet.proxy.url + path)


def load_at_proxy(fleet: Fleet, name: str) -> float:
    engines = json.loads(proxy_get(fleet, "/health"))["engines"]
    return float(next(e["load"] for e in engines if e["engine_id"] == name))


def holds(fleet: Fleet, name: str, chain: list[int]) -> bool:
    with BrokerClient(fleet.broker.address) as client:
        layout = next((e.layout_id for e in client.list_engines().engines if e.engine_id == name), "")
        answer = client.resolve(namespace=pb.Namespace(layout_id=layout, tenant=""), block_hashes=chain)
    return any(m.engine_id == name and m.matched_blocks >= len(chain) for m in answer.matches)


def keep_busy(
    engine: EngineProcess, n: int, stop: threading.Event, seed: int = 100
) -> list[threading.Thread]:
    """`n` long streamed requests straight to `engine`, each sent again when it ends, read until
    `stop` is set: the engine stays busy however long a loaded machine takes to route the turn."""

    def run(seed: int) -> None:
        while not stop.is_set():
            req = completion_request(engine, prompt_of(64, seed=seed), max_tokens=1500, stream=True)
            try:
                with urllib.request.urlopen(req, timeout=600) as resp:
                    while not stop.is_set() and resp.readline():
                        pass
            except OSError:
                return  # the engine stopped under it at teardown: no matter

    threads = [threading.Thread(target=run, args=(seed + i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_a_busy_holder_sends_the_request_to_a_free_engine_that_pulls_the_prefix(fleet: Fleet) -> None:
    prefix = prompt_of(PREFIX, seed=21)
    first, headers = through_proxy(fleet, prefix + prompt_of(32, seed=22), "dp-e2e-1")
    assert headers["X-KVBroker-Mode"] == "dp" and len(first) == MAX_TOKENS
    holder = headers["X-KVBroker-Decode"]
    (other,) = [name for name in fleet.engines if name != holder]
    chain = wire_chain(prefix, BLOCK_SIZE)
    assert wait_for(lambda: holds(fleet, holder, chain), 30), f"the broker names {holder} for the prefix"

    stop = threading.Event()
    busy = keep_busy(fleet.engines[holder], 3, stop)
    try:
        # The holder heartbeats its load to the broker; the proxy re-reads it every 0.2 s.
        assert wait_for(lambda: load_at_proxy(fleet, holder) >= 2, 120), f"{holder} never reported busy"
        pulled_before = read_stats(fleet.stats[other]).get("pulled_blocks", 0)
        turn2 = prefix + prompt_of(32, seed=23)
        out, headers = through_proxy(fleet, turn2, "dp-e2e-2")
        load_after = load_at_proxy(fleet, holder)
    finally:
        stop.set()
    assert (headers["X-KVBroker-Decode"], headers["X-KVBroker-Route"]) == (other, "dp_pull_busy_holder"), (
        f"the proxy sent turn 2 to {headers['X-KVBroker-Decode']} ({headers['X-KVBroker-Route']}); "
        f"{holder}'s load at the proxy right after: {load_after}"
    )
    assert wait_for(
        lambda: read_stats(fleet.stats[other]).get("pulled_blocks", 0) >= pulled_before + 8, 30
    ), f"{other} pulled the prefix from {holder}: {read_stats(fleet.stats[other])}"
    metrics = proxy_get(fleet, "/metrics")
    counted = re.search(
        r'kvbroker_proxy_route_choices_total\{reason="dp_pull_busy_holder"\} ([\d.]+)', metrics
    )
    assert counted is not None and float(counted.group(1)) >= 1
    for t in busy:
        t.join(60)
    # Greedy: the same tokens as one engine computing the whole prompt itself.
    assert out == recompute_reference(fleet.engines[other], turn2, MAX_TOKENS)


def test_a_pull_on_a_busy_reader_is_ready_for_the_next_step(fleet: Fleet) -> None:
    holder, reader = "E1", "E2"
    for seed in (41, 31):  # 41: a first pull from this holder, which sets up NIXL's connection
        prefix = prompt_of(PREFIX, seed=seed)
        complete(fleet.engines[holder], prefix + prompt_of(32, seed=seed + 1), max_tokens=2)
        chain = wire_chain(prefix, BLOCK_SIZE)
        assert wait_for(lambda chain=chain: holds(fleet, holder, chain), 30)  # type: ignore[misc]
        if seed == 41:
            complete(fleet.engines[reader], prefix + prompt_of(32, seed=seed + 2), max_tokens=2)
    stop = threading.Event()
    busy = keep_busy(fleet.engines[reader], 3, stop, seed=300)  # prompts nobody holds
    try:
        # The reader decodes a batch: a step is a forward pass over it, and a pull's
        # wait is counted in those steps, not in milliseconds.
        assert wait_for(lambda: read_stats(fleet.stats[reader]).get("load", 0) >= 2, 120)
        before = read_stats(fleet.stats[reader])
        turn = prefix + prompt_of(32, seed=33)
        answer = complete(fleet.engines[reader], turn, max_tokens=MAX_TOKENS)
    finally:
        stop.set()
    assert wait_for(
        lambda: read_stats(fleet.stats[reader]).get("loads_ready", 0) == before.get("loads_ready", 0) + 1, 30
    )
    after = read_stats(fleet.stats[reader])
    assert after["pulled_blocks"] == before.get("pulled_blocks", 0) + PREFIX // BLOCK_SIZE, after
    # Allocated in step N: leased, read, released and reported finished in N; prefill in N+1.
    assert after["figures"]["last_load_ready_steps"] == 1, after
    for t in busy:
        t.join(60)
    assert output_ids(answer) == recompute_reference(fleet.engines[reader], turn, MAX_TOKENS)


ADMIT_ARGS = [
    "--no-disaggregate",
    "--refresh-interval-s",
    "0.2",
    "--admit-per-engine",
    "1",
    "--admit-ttft-goal-ms",
    "60000",
]


def engine_running(engine: EngineProcess) -> float:
    text = http_get(engine.url + "/metrics")
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} ([\d.]+)$", text, re.M)
    assert found is not None, "vLLM's /metrics has no vllm:num_requests_running"
    return float(found.group(1))


def test_admission_holds_requests_at_the_proxy_and_answers_every_one_as_an_engine_would(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A proxy with --admit-per-engine 1 in front of the two real engines: six requests at once,
    so at most two run on the engines and the rest wait at the proxy; every answer is the one an
    engine computes alone, and every waiting request is let in (none refused, no place kept)."""
    proxy = ProxyProcess(
        tmp_path / "proxy-admit.log",
        engines={name: e.url for name, e in fleet.engines.items()},
        broker=fleet.broker.address,
        extra_args=ADMIT_ARGS,
    ).start()
    prompts = [prompt_of(48, seed=500 + i) for i in range(6)]
    answers: dict[int, list[int]] = {}
    most = [0.0]  # the most requests the engines ran together
    errors: list[str] = []
    done = threading.Event()

    def send(i: int) -> None:
        answers[i], _ = through_proxy(fleet, prompts[i], f"dp-admit-{i}", proxy.url, max_tokens=48)

    def watch() -> None:
        try:
            while not done.is_set():
                most.append(sum(engine_running(engine) for engine in fleet.engines.values()))
                done.wait(0.02)
        except Exception as e:  # reported below: a watcher that died saw nothing
            errors.append(repr(e))

    watcher = threading.Thread(target=watch, daemon=True)
    senders = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    try:
        watcher.start()
        for t in senders:
            t.start()
        for t in senders:
            t.join(300)
        done.set()
        watcher.join(30)
        metrics = http_get(proxy.url + "/metrics")
    finally:
        done.set()
        proxy.stop()
    assert sorted(answers) == list(range(6)), f"answered: {sorted(answers)}"
    assert not errors, errors
    # One place per engine, two in all (the placement chooses the engine: both may go to one).
    assert max(most) == 2, f"requests running on the engines together, as polled: {sorted(set(most))}"
    counts = {
        order: float(n)
        for order, n in re.findall(
            r'kvbroker_proxy_admission_wait_seconds_count\{order="(\w+)"\} ([\d.]+)', metrics
        )
    }
    assert sum(counts.values()) == 6 and counts.get("in_time", 0) >= 1, counts
    assert (
        "kvbroker_proxy_requests_running 0.0" in metrics and "kvbroker_proxy_requests_waiting 0.0" in metrics
    )
    engine = next(iter(fleet.engines.values()))
    for i, prompt in enumerate(prompts):
        assert answers[i] == recompute_reference(engine, prompt, 48), f"request {i}"


def streamed_through(proxy_url: str, engine: EngineProcess, prompt: list[int], max_tokens: int) -> list[dict]:
    """A greedy streamed completion through a proxy, asking for token ids and usage: its events."""
    sent = completion_request(engine, prompt, max_tokens=max_tokens, stream=True, include_usage=True)
    req = urllib.request.Request(
        proxy_url + "/v1/completions", data=sent.data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read().decode()
    assert raw.rstrip().endswith("data: [DONE]"), raw[-300:]
    return [json.loads(p[len("data: ") :]) for p in raw.split("\n\n") if p.startswith("data: {")]


def test_waiting_requests_get_their_first_token_early_and_the_answer_an_engine_computes(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Six streamed requests at once through a proxy with one place per engine and a 300 ms
    first-token goal: those that wait past it get their first token from a one-token request
    to a real engine and the rest when a place frees (clients/proxy/early_token.py). Each
    client sees one answer, token for token the one an engine computes alone, with usage
    counting the prompt and the whole answer."""
    proxy = ProxyProcess(
        tmp_path / "proxy-early.log",
        engines={name: e.url for name, e in fleet.engines.items()},
        broker=fleet.broker.address,
        extra_args=[*ADMIT_ARGS[:-1], "300"],
    ).start()
    engine = next(iter(fleet.engines.values()))
    prompts = [prompt_of(48, seed=700 + i) for i in range(6)]
    answers: dict[int, list[dict]] = {}

    def send(i: int) -> None:
        answers[i] = streamed_through(proxy.url, engine, prompts[i], 64)

    senders = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    try:
        for t in senders:
            t.start()
        for t in senders:
            t.join(300)
        metrics = http_get(proxy.url + "/metrics")
    finally:
        proxy.stop()
    assert sorted(answers) == list(range(6)), f"answered: {sorted(answers)}"
    early = re.search(r'kvbroker_proxy_early_first_tokens_total\{result="sent"\} ([\d.]+)', metrics)
    assert early is not None and float(early.group(1)) >= 1, "no request got its first token early"
    assert (
        "kvbroker_proxy_requests_running 0.0" in metrics and "kvbroker_proxy_requests_waiting 0.0" in metrics
    )
    for i, prompt in enumerate(prompts):
        events = answers[i]
        tokens = [t for e in events for c in e["choices"] for t in c["token_ids"]]
        assert tokens == recompute_reference(engine, prompt, 64), f"request {i}"
        assert len({(e["id"], e["created"]) for e in events}) == 1, f"request {i}: one answer's id"
        given = [c["prompt_token_ids"] for e in events for c in e["choices"] if c.get("prompt_token_ids")]
        assert given == [prompt], f"request {i}: the prompt's ids, once"
        usage = events[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (48, 64), f"request {i}: {usage}"

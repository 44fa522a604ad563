"""End to end: the proxy in front of a real broker process and two real vLLM engines with our connector.

One stack per module (the demo's own start-up code): broker, prefill and decode
engines, proxy. Checks that requests through the proxy are disaggregated (D
pulls P's blocks over NIXL, under a lease that ends released), that the answer
equals a single engine's greedy answer, that multi-turn chat and streaming
work, and that the request still succeeds when the prefill engine is killed.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.waiting import wait_for
from tests.clients.proxy.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from kvbroker.tools.demo import start_stack
    from kvbroker.tools.launch import free_port

    workdir = tmp_path_factory.mktemp("serving-e2e")
    # Every process of the stack (broker, engines, proxy) inherits these and
    # exports its spans to the receiver, quickly.
    otel_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    saved = {k: os.environ.get(k) for k in otel_env}
    os.environ.update(otel_env)
    try:
        s = start_stack(workdir, proxy_port=0, broker_port=free_port(), threshold=32)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield s
    finally:
        s.stop()


def post(url: str, body: dict[str, Any], request_id: str) -> tuple[dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read()), {k.lower(): v for k, v in resp.headers.items()}


def stats(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())) if path.exists() else {}


def leases_of(address: str, request_id: str) -> list[Any]:
    from kvbroker.clients.sync import BrokerClient

    with BrokerClient(address) as client:
        return [x for x in client.list_leases(include_ended=True).leases if request_id in x.request_id]


PROMPT = "the broker knows which engine holds which block of a prompt and engines move them " * 6


def test_pd_request_pulls_from_prefill_and_matches_single_engine(stack: Any) -> None:
    from kvbroker.v1 import broker_pb2 as pb

    before = stats(stack.stats["decode-0"]).get("pulled_tokens", 0)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    answer, headers = post(stack.proxy_url + "/v1/completions", body, "e2e-pd-1")
    assert headers["x-kvbroker-mode"] == "pd"
    assert headers["x-kvbroker-prefill"] == "prefill-0" and headers["x-kvbroker-decode"] == "decode-0"
    prompt_tokens = answer["usage"]["prompt_tokens"]
    # Every token came from P, its partial last block included; D computed only the last one.
    # (D's stats file is written after the answer: on a loaded machine, well after it.)
    assert wait_for(
        lambda: stats(stack.stats["decode-0"]).get("pulled_tokens", 0) - before == prompt_tokens - 1 > 0, 15
    ), (stats(stack.stats["decode-0"]), before, prompt_tokens)
    (lease,) = [x for x in leases_of(stack.broker_address, "e2e-pd-1") if x.holder_engine_id == "prefill-0"]
    assert lease.reader_engine_id == "decode-0"
    assert lease.state == pb.LEASE_RELEASED
    # The same greedy request on one engine, recomputed: a cache salt of its own
    # puts it in another namespace, so no cached or remote block can match.
    single, _ = post(
        stack.prefill.url + "/v1/completions", {**body, "cache_salt": "recompute"}, "e2e-single-1"
    )
    assert answer["choices"][0]["text"] == single["choices"][0]["text"]


def test_a_request_the_decode_engine_rejects_ends_the_prefill_hold_at_once(stack: Any) -> None:
    """D's vLLM refuses max_tokens beyond the model's length (P's one-token prefill passed): the
    proxy declines P's hold, so P frees the prompt's blocks now instead of after the hold TTL (30 s).
    A request no engine accepts (max_tokens -1) is refused by the proxy before P prefills it."""
    import urllib.error

    from kvbroker.v1 import broker_pb2 as pb

    with pytest.raises(urllib.error.HTTPError) as invalid:
        post(
            stack.proxy_url + "/v1/completions",
            {"model": "tiny", "prompt": PROMPT, "max_tokens": -1},
            "e2e-inv",
        )
    assert invalid.value.code == 400 and leases_of(stack.broker_address, "e2e-inv") == []
    body = {"model": "tiny", "prompt": PROMPT + " rejected", "max_tokens": 100_000}
    with pytest.raises(urllib.error.HTTPError) as rejected:
        post(stack.proxy_url + "/v1/completions", body, "e2e-reject-1")
    answered = time.monotonic()
    assert rejected.value.code == 400

    def declined() -> list[Any]:
        return [
            x
            for x in leases_of(stack.broker_address, "e2e-reject-1")
            if x.holder_engine_id == "prefill-0" and x.state == pb.LEASE_REVOKED
        ]

    while not declined() and time.monotonic() - answered < 1.0:
        time.sleep(0.02)
    (lease,) = declined()
    assert lease.cause == pb.REVOKE_DECLINED


def test_streamed_multi_turn_chat(stack: Any) -> None:
    from kvbroker.tools.demo import SYSTEM_PROMPT, chat_turn

    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "first question"}]
    first = chat_turn(stack.proxy_url, messages, "e2e-chat-1", max_tokens=12)
    assert first["usage"]["completion_tokens"] == 12 and first["ttft_s"] is not None
    messages += [{"role": "assistant", "content": first["answer"]}, {"role": "user", "content": "second one"}]
    second = chat_turn(stack.proxy_url, messages, "e2e-chat-2", max_tokens=12)
    assert second["usage"]["completion_tokens"] == 12
    assert second["headers"]["X-KVBroker-Mode"] == "pd"
    # D keeps turn 1 in its prefix cache: turn 2 reuses it instead of recomputing.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


def test_a_proxy_with_its_default_lets_d_serve_a_turn_it_holds_alone(stack: Any, tmp_path: Path) -> None:
    """The demo's proxy prefills every turn on P; a proxy with the default --local-prefill-tokens
    sends turn 2 to D alone when D holds all of it but the new message."""
    from kvbroker.tools.demo import SYSTEM_PROMPT, chat_turn
    from testkit.processes import ProxyProcess

    proxy = ProxyProcess(
        tmp_path / "proxy.log",
        prefill={"prefill-0": stack.prefill.url},
        decode={"decode-0": stack.decode.url},
        broker=stack.broker_address,
        name="proxy-default",
    ).start()
    try:
        url = proxy.url
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "local one"}]
        first = chat_turn(url, messages, "e2e-local-1", max_tokens=12)
        messages += [{"role": "assistant", "content": first["answer"]}, {"role": "user", "content": "and?"}]
        before = stats(stack.stats["decode-0"]).get("pulled_blocks", 0)
        second = chat_turn(url, messages, "e2e-local-2", max_tokens=12)
        assert second["headers"]["X-KVBroker-Mode"] == "local"
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # D's own cache
        assert stats(stack.stats["decode-0"]).get("pulled_blocks", 0) == before  # nothing to pull
    finally:
        proxy.stop()


def test_one_trace_spans_proxy_broker_and_the_transfer(stack: Any, receiver: OtlpReceiver) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    # A prompt no engine has seen, so D pulls all of it (nothing cached locally).
    body = {"model": "tiny", "prompt": "a traced request: " + PROMPT, "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        stack.proxy_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "traceparent": traceparent, "X-Request-Id": "e2e-trace"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    spans: list[ReceivedSpan] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
        pulled = any(s.name == "kvbroker.pull" and "kvbroker.bytes" in s.attributes for s in spans)
        if pulled and any(s.name == "POST /v1/completions" for s in spans):
            break
        time.sleep(0.5)
    names = {(s.service, s.name) for s in spans}
    assert ("kvbroker-proxy", "POST /v1/completions") in names, names
    assert any(service == "kvbroker" for service, _ in names), f"no broker span in {names}"
    # One tree: every span's parent is in the trace, except the root, whose parent is the client's span.
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_span_id not in ids]
    assert [r.name for r in roots] == ["POST /v1/completions"] and roots[
        0
    ].parent_span_id == "00f067aa0ba902b7"
    adapter_spans = [
        (s.name, s.trace_id) for s in receiver.snapshot() if s.service == "kvbroker-engine-adapter"
    ]
    pulls = [s for s in spans if s.name == "kvbroker.pull"]
    assert len(pulls) == 1, f"pull spans in the trace: {pulls}; adapter spans anywhere: {adapter_spans}"
    pull = pulls[0]
    by_id = {s.span_id: s for s in spans}
    assert by_id[pull.parent_span_id].name == "proxy.decode"
    a = pull.attributes
    assert a["kvbroker.blocks"] > 0 and a["kvbroker.bytes"] > 0 and a["kvbroker.tier"]
    assert a["kvbroker.source_engine_id"] == "prefill-0" and a["kvbroker.destination_engine_id"] == "decode-0"
    assert a["kvbroker.lease_id"] and a["kvbroker.duration_ms"] > 0 and a["kvbroker.gb_per_s"] > 0
    assert str(a["kvbroker.source_ranks"]).startswith("pp0/tp0:[0,")
    assert a["kvbroker.committed"] is True
    # The adapter's lease calls are broker RPCs inside the pull: Release commits the read.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
        if any(s.name.endswith("/Release") for s in spans):
            break
        time.sleep(0.5)
    releases = [s for s in spans if s.service == "kvbroker" and s.name.endswith("/Release")]
    assert [r.parent_span_id for r in releases] == [pull.span_id], [(s.service, s.name) for s in spans]
    # vLLM's own request spans (the launcher passes --otlp-traces-endpoint) join the same tree,
    # under the proxy's call to each engine.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
        if len([s for s in spans if s.name == "llm_request"]) >= 2:
            break
        time.sleep(0.5)
    by_id = {s.span_id: s for s in spans}
    vllm_parents = sorted(by_id[s.parent_span_id].name for s in spans if s.name == "llm_request")
    assert vllm_parents == ["proxy.decode", "proxy.prefill"], [(s.service, s.name) for s in spans]


def test_request_survives_a_dead_prefill_engine(stack: Any) -> None:
    stack.prefill.kill9()
    body = {"model": "tiny", "prompt": PROMPT + " once more", "max_tokens": 8, "temperature": 0}
    answer, headers = post(stack.proxy_url + "/v1/completions", body, "e2e-dead-p")
    assert answer["usage"]["completion_tokens"] == 8
    assert headers["x-kvbroker-mode"] == "single" and headers["x-kvbroker-decode"] == "decode-0"

"""The adaptive pull policy where P/D runs: a prefill-only P and a decode-only D both decide by the model.

One stack as `make run` starts it (the demo's start-up code: a real broker
process, a prefill and a decode vLLM engine with our connector, real NIXL, the
proxy prefilling every turn on P) and the adaptive policy. P's requests finish
in the step that computes them and D never prefills a prompt of its own; after
a short chat neither may have fallen back to the fixed rule for lack of timing:
P times its prefill steps, D predicts with the fit P hands it (cost_model.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from kvbroker.tools.demo import start_stack
    from kvbroker.tools.launch import free_port

    s = start_stack(
        tmp_path_factory.mktemp("pd-roles"), proxy_port=0, broker_port=free_port(), threshold=None
    )
    try:
        yield s
    finally:
        s.stop()


# A first turn long enough (about 2,800 tokens of the tiny model's tokenizer) that pulling it
# beats recomputing it by a wide margin whatever this host's speed: on the tiny model a
# prefill of a hundred tokens costs a few ms, less than a pull's fixed part, so a short turn
# may rightly be recomputed (a fast CI host did; then D pulled nothing and these tests,
# which are about pulls, had nothing to check).
LONG_FIRST_QUESTION = "background " * 350


def stats(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())) if path.exists() else {}


def test_p_and_d_decide_by_the_model_after_a_short_chat(stack: Any) -> None:
    from kvbroker.tools.demo import SYSTEM_PROMPT, chat_turn

    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": LONG_FIRST_QUESTION},
    ]
    for turn in range(3):
        answer = chat_turn(stack.proxy_url, messages, f"pd-roles-{turn}", max_tokens=40)
        assert answer["headers"]["X-KVBroker-Mode"] == "pd"
        messages += [
            {"role": "assistant", "content": answer["answer"]},
            {"role": "user", "content": f"follow-up number {turn} " * 12},
        ]
    p, d = stats(stack.stats["prefill-0"]), stats(stack.stats["decode-0"])
    for name, s in (("P", p), ("D", d)):
        assert s.get("fallback_no_prefill_timing", 0) == 0, (name, s)
        assert s.get("decisions_by_model", 0) >= 1, (name, s)
        assert s["cost_model"]["prefill_ready"] is True, (name, s["cost_model"])
    # P learned from its own prefills (each finished in the step that computed it) ...
    assert p["cost_model"]["prefill_source"] == "own" and p["cost_model"]["prefill_steps"] >= 3
    # ... and D from P's fit until it has timed a prefill of its own (the tokens it computes
    # beyond a pull); its first decision came before any, and was the model's all the same.
    assert d["cost_model"]["prefill_source"] in ("own", "holder:prefill-0"), d["cost_model"]
    assert d["cost_model"]["steps"] > d["cost_model"]["prefill_steps"]
    # Turn 1 (long) is pulled; later turns the model may recompute (on the tiny model a few new
    # tokens cost less than a pull), by its prediction, not for lack of one.
    assert d.get("pulls", 0) >= 1
    assert d.get("decided_pull_adaptive", 0) + d.get("decided_recompute_adaptive", 0) >= 3


def test_per_pair_counters_equal_the_readers_own(stack: Any) -> None:
    """The broker counts what each reader says it read (ReleaseRequest.read_blocks/read_bytes),
    not the whole lease: its per-pair totals equal the readers' own counters within 1%."""
    import re
    import urllib.request

    from kvbroker.tools.demo import SYSTEM_PROMPT, chat_turn

    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "pairs " * 480}]
    for turn in range(2):
        answer = chat_turn(stack.proxy_url, messages, f"pd-pairs-{turn}", max_tokens=24)
        messages += [
            {"role": "assistant", "content": answer["answer"]},
            {"role": "user", "content": "more " * 30},
        ]
    body = urllib.request.urlopen(stack.broker_metrics_url, timeout=10).read().decode()

    def pair(metric: str, holder: str, reader: str) -> float:
        pattern = rf'^{metric}_total\{{holder="{holder}",reader="{reader}",tier="gpu"\}} (\S+)$'
        found = re.search(pattern, body, re.M)
        return float(found.group(1)) if found else 0.0

    for holder, reader in (("prefill-0", "decode-0"), ("decode-0", "prefill-0")):
        own = stats(stack.stats[reader])
        own_gpu = own.get("pulled_blocks_tier_gpu", 0)
        if reader == "decode-0":
            assert own_gpu > 0, own
        # Each reader pulls from one holder here: its own GPU-tier counters are that pair's.
        assert pair("kvbroker_pair_blocks", holder, reader) == pytest.approx(own_gpu, rel=0.01, abs=0)
        assert pair("kvbroker_pair_unreported_reads", holder, reader) == 0
    d = stats(stack.stats["decode-0"])
    assert pair("kvbroker_pair_bytes", "prefill-0", "decode-0") == pytest.approx(d["pulled_bytes"], rel=0.01)


def test_a_turn_held_on_d_does_not_wait_for_a_busy_p(stack: Any) -> None:
    """`make run`'s proxy (--local-prefill-tokens 0) prefills every turn on an idle P; while P works
    on another chat's prefill (here: P's engine core frozen with it in flight; its API server still
    answers /tokenize and /health, as a busy P's does), a turn whose history D holds is served by D
    alone, and the proxy's metrics say why."""
    import signal
    import threading
    import urllib.request

    import psutil

    from kvbroker.tools.demo import SYSTEM_PROMPT, chat_turn

    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "busy p " * 20}]
    first = chat_turn(stack.proxy_url, messages, "pd-busy-1", max_tokens=24)
    messages += [{"role": "assistant", "content": first["answer"]}, {"role": "user", "content": "and then?"}]
    core = psutil.Process(stack.prefill.pid).children(recursive=True)  # the engine core and its worker
    assert core, "P's API server has no engine core process"
    for proc in core:
        proc.send_signal(signal.SIGSTOP)
    other: dict[str, Any] = {}
    try:
        other_chat = [{"role": "user", "content": "another conversation entirely " * 60}]
        t = threading.Thread(
            target=lambda: other.update(chat_turn(stack.proxy_url, other_chat, "pd-busy-other", max_tokens=4))
        )
        t.start()
        time.sleep(0.5)  # the other chat's prefill is in flight on P
        second = chat_turn(stack.proxy_url, messages, "pd-busy-2", max_tokens=8)
    finally:
        for proc in core:
            proc.send_signal(signal.SIGCONT)
    t.join(timeout=120)
    assert second["headers"]["X-KVBroker-Mode"] == "local", second["headers"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # D's own history
    body = urllib.request.urlopen(stack.proxy_url + "/metrics", timeout=10).read().decode()
    assert 'kvbroker_proxy_route_choices_total{reason="local_p_busy"}' in body
    assert 'kvbroker_proxy_route_choices_total{reason="pd_p_idle"}' in body

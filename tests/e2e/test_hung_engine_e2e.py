"""End to end, the way `make up` runs: the demo's stack (a real broker, P and D vLLM engines with
our connector, the proxy) plus a second decode engine, all real processes on the tiny model.

In order (the module shares one stack; the last tests disturb it):

- the engines' /metrics carry vLLM's own series and the broker serves /metrics;
- the OpenAI surface through the proxy on real engines, with the official `openai` client
  and plain HTTP: chat, completions, /v1/responses, /tokenize, /detokenize, /version, JSON
  errors, and a request D rejects (max_tokens -1) logged with its status;
- the commands `make up` prints run as printed;
- a SIGSTOPped decode engine: a proxy with a second decode engine serves every new request
  there within a bound, /health says why, /metrics counts it; a proxy whose only engine is
  the frozen one fails fast with a 504 naming the hang; SIGCONT brings it back;
- kill -9 of the broker: the stack's supervisor starts a new one, engines and proxy stay up,
  and requests keep working.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 3.0
PROBE_S = 2.0


class Extra:
    """What the module adds to the demo's stack: decode-1 and two more proxies."""

    def __init__(self) -> None:
        self.decode1: Any = None
        self.proxies: list[Any] = []
        self.two_decoders = ""  # proxy: prefill-0, decode-0 and decode-1
        self.only_decode0 = ""  # proxy: decode-0 alone


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from kvbroker.tools.demo import start_stack
    from kvbroker.tools.launch import free_port

    workdir = tmp_path_factory.mktemp("ops-e2e")
    s = start_stack(workdir, proxy_port=0, broker_port=free_port(), threshold=32)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def extra(stack: Any) -> Iterator[Extra]:
    from testkit.engines import start_engine
    from testkit.processes import ProxyProcess

    out = Extra()
    out.decode1, _ = start_engine(
        stack.prefill.model_dir,
        stack.workdir,
        name="decode-1",
        broker_address=stack.broker_address,
        role="decode",
        served_model_name=stack.served_name,
        kv_recompute_threshold=32,
    )
    try:
        out.decode1.wait_ready(timeout=600)

        def proxy(name: str, engines: list[str]) -> str:
            child = ProxyProcess(
                stack.workdir / f"{name}.log",
                broker=stack.broker_address,
                extra_args=[
                    "--first-byte-timeout-s",
                    str(BUDGET_S),
                    "--probe-timeout-s",
                    str(PROBE_S),
                    *engines,
                ],
                name=name,
            )
            out.proxies.append(child)
            child.start()
            return child.url

        out.two_decoders = proxy(
            "proxy-2d",
            [
                "--prefill",
                f"prefill-0={stack.prefill.url}",
                "--decode",
                f"decode-0={stack.decode.url}",
                "--decode",
                f"decode-1={out.decode1.url}",
            ],
        )
        out.only_decode0 = proxy("proxy-d0", ["--engine", f"decode-0={stack.decode.url}"])
        yield out
    finally:
        for p in out.proxies:
            p.stop()
        out.decode1.stop()


def http(method: str, url: str, body: Any = None, timeout: float = 120) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode())


def completion(tag: str, max_tokens: int = 8) -> dict[str, Any]:
    prompt = f"{tag}: the broker knows which engine holds which block of a prompt " * 4
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_engines_and_broker_serve_metrics(stack: Any) -> None:
    status, _, _ = http("POST", stack.proxy_url + "/v1/completions", completion("metrics"))
    assert status == 200
    for engine in (stack.prefill, stack.decode):
        text = get_text(engine.url + "/metrics")
        assert "vllm:kv_cache_usage_perc" in text, text[:2000]
        assert "vllm:prompt_tokens_total" in text
    assert stack.broker_metrics_url.startswith("http://127.0.0.1:")
    text = get_text(stack.broker_metrics_url)
    assert "kvbroker_" in text


def test_openai_surface_through_the_proxy(stack: Any) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello there " * 8}], max_tokens=8
    )
    assert chat.choices[0].message.content is not None and chat.usage is not None
    assert 1 <= chat.usage.completion_tokens <= 8
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt="tell me " * 20, max_tokens=8, stream=True)
    )
    assert text
    response = client.responses.create(model="tiny", input="hello " * 8, max_output_tokens=8)
    assert response.status in ("completed", "incomplete") and response.output
    with pytest.raises(openai.BadRequestError) as rejected:
        client.completions.create(model="tiny", prompt="rejected " * 20, max_tokens=-1)
    assert rejected.value.status_code == 400
    client.close()

    status, _, raw = http("POST", stack.proxy_url + "/tokenize", {"model": "tiny", "prompt": "hello world"})
    assert status == 200, raw
    tokens = json.loads(raw)["tokens"]
    status, _, raw = http("POST", stack.proxy_url + "/detokenize", {"model": "tiny", "tokens": tokens})
    assert status == 200 and "hello world" in json.loads(raw)["prompt"]
    status, _, raw = http("GET", stack.proxy_url + "/version")
    assert status == 200 and json.loads(raw)["version"].startswith("0.")
    status, headers, raw = http("GET", stack.proxy_url + "/v1/chat")
    assert status == 404 and headers["content-type"].startswith("application/json")
    assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
    status, _, raw = http("GET", stack.proxy_url + "/v1/completions")
    assert status == 405 and json.loads(raw)["error"]["code"] == 405
    # The rejected request left its line in the proxy's access log.
    assert wait_for(
        lambda: any(
            "POST /v1/completions 400 " in line
            for line in (stack.workdir / "proxy.log").read_text(errors="replace").splitlines()
        ),
        timeout=10,
    )


def test_printed_commands_run_as_printed(stack: Any) -> None:
    from kvbroker.tools.demo import try_commands

    commands = try_commands(stack)
    assert any(c.startswith(".venv/bin/kvbroker ") for c in commands), commands
    for command in commands:
        bench = "vllm bench serve" in command
        if bench:  # the same command, shorter: 2 prompts of 64 tokens
            command = command.replace("--random-input-len 256", "--random-input-len 64").replace(
                "--num-prompts 8", "--num-prompts 2"
            )
        done = subprocess.run(
            command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        if bench:
            served = re.search(r"Successful requests:\s+(\d+)", done.stdout)
            assert served is not None and int(served.group(1)) == 2, done.stdout[-2000:]
        elif "engines" in command:
            assert "decode-0" in done.stdout and "prefill-0" in done.stdout
        else:
            assert json.loads(done.stdout)["choices"][0]["message"]["content"] is not None


def _health(url: str) -> dict[str, dict[str, Any]]:
    _, _, raw = http("GET", url + "/health", timeout=10)
    return {e["engine_id"] or e["url"]: e for e in json.loads(raw)["engines"]}


def _metric(url: str, prefix: str) -> float:
    total = 0.0
    for line in get_text(url + "/metrics").splitlines():
        if line.startswith(prefix):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _group_signal(engine: Any, sig: int) -> None:
    os.killpg(os.getpgid(engine.pid), sig)


def test_a_frozen_decode_engine_is_routed_around(stack: Any, extra: Extra) -> None:
    url = extra.two_decoders
    status, headers, _ = http("POST", url + "/v1/completions", completion("warm"))
    assert status == 200 and headers["x-kvbroker-mode"] == "pd"
    _group_signal(stack.decode, signal.SIGSTOP)
    try:
        # Right away (before the broker drops decode-0's session) and after: every new request
        # is answered by decode-1, within the budget plus one probe plus the request itself.
        for i in range(4):
            started = time.monotonic()
            status, headers, raw = http(
                "POST", url + "/v1/completions", completion(f"frozen-{i}"), timeout=60
            )
            took = time.monotonic() - started
            assert status == 200, raw
            assert headers["x-kvbroker-decode"] == "decode-1", headers
            assert took < BUDGET_S + PROBE_S + 20, took
        hung = _metric(url, 'kvbroker_proxy_engine_failures_total{engine="decode-0",kind="hung"')
        gone = lambda: "broker session ended" in (_health(url)["decode-0"]["reason"] or "")  # noqa: E731
        # decode-0 was tried and abandoned, unless the broker dropped it before its turn came.
        assert hung >= 1 or gone(), get_text(url + "/metrics")
        if hung:
            assert _metric(url, 'kvbroker_proxy_engine_retries_total{engine="decode-0"') >= 1
        # The broker drops the frozen engine's session (TTL 5 s); /health says so.
        assert wait_for(gone, timeout=30), _health(url)
        health = _health(url)
        assert health["decode-0"]["healthy"] is False and health["decode-1"]["healthy"] is True
        assert 'kvbroker_proxy_engine_healthy{engine="decode-0"' in get_text(url + "/metrics")

        # A proxy with no other engine fails fast, with an OpenAI error that names the hang.
        started = time.monotonic()
        status, _, raw = http("POST", extra.only_decode0 + "/v1/completions", completion("alone"), timeout=60)
        assert time.monotonic() - started < BUDGET_S + PROBE_S + 10
        assert status == 504, raw
        error = json.loads(raw)["error"]
        assert error["type"] == "timeout" and "decode-0" in error["message"]
        assert "no first byte within" in error["message"]
    finally:
        _group_signal(stack.decode, signal.SIGCONT)

    # Back: its connector registers again, /health shows it healthy, and it serves again.
    recovered: Callable[[], bool] = lambda: _health(url)["decode-0"]["healthy"] is True  # noqa: E731
    assert wait_for(recovered, timeout=90, interval=1.0), _health(url)
    served_by: set[str] = set()
    for i in range(4):
        status, headers, _ = http("POST", url + "/v1/completions", completion(f"back-{i}"))
        assert status == 200
        served_by.add(headers["x-kvbroker-decode"])
    assert "decode-0" in served_by


def test_the_stack_rides_through_a_broker_kill(stack: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from kvbroker.clients.sync import BrokerClient

    supervisor = stack.broker_supervisor
    old_pid = stack.broker.pid
    os.kill(old_pid, signal.SIGKILL)
    # While no broker runs, requests are still answered (no scores, no pull: recomputed).
    status, _, raw = http("POST", stack.proxy_url + "/v1/completions", completion("no-broker"), timeout=60)
    assert status == 200, raw
    assert wait_for(lambda: supervisor.restarts == 1 and stack.broker.alive(), timeout=30)
    assert stack.broker.pid != old_pid
    assert stack.proxy.alive() and stack.prefill.is_healthy() and stack.decode.is_healthy()

    def registered() -> bool:
        try:
            with BrokerClient(stack.broker_address) as client:
                names = {e.engine_id for e in client.list_engines(timeout=2).engines}
        except Exception:
            return False
        return {"prefill-0", "decode-0"} <= names

    # The engines reconnect to the new broker, and P/D requests work again.
    assert wait_for(registered, timeout=60, interval=1.0)
    status, _, _ = http("POST", stack.proxy_url + "/v1/completions", completion("after-kill"))
    assert status == 200
    assert wait_for(
        lambda: (
            http("POST", stack.proxy_url + "/v1/completions", completion("pd-again"))[1].get(
                "x-kvbroker-mode"
            )
            == "pd"
        ),
        timeout=30,
        interval=1.0,
    )
    printed = capsys.readouterr().out
    assert "!! the broker exited (code -9); starting it again in 1 s" in printed, printed
    assert "!! the broker is running again" in printed, printed

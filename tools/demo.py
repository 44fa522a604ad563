"""One command that shows the whole system working on a CPU machine.

    python -m kvbroker.tools.demo                 # build, start, chat 3 turns, stop
    python -m kvbroker.tools.demo --keep-running  # ... then keep the stack up until Ctrl-C

It builds the tiny model, starts the broker (`python -m kvbroker.broker`), a prefill
and a decode vLLM engine with our BrokerConnector, and the P/D proxy
(`python -m kvbroker.clients.proxy`), then runs a multi-turn chat through the proxy
and prints per turn: time to first token, which engines served it, tokens
pulled over NIXL versus computed (and from which engine and tier), transfer
GB/s, and each lease's lifecycle as the broker saw it. Everything it started
runs in its own process group and is stopped on exit, on an error and on
Ctrl-C.
"""

from __future__ import annotations

import argparse
import atexit
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbroker.tools.launch import EngineProcess, EngineStartError, connector_config, free_port
from kvbroker.tools.tiny_model import build_tiny_model, is_tiny_model_dir

# A system prompt long enough to fill a few 32-token blocks, so even turn 1 has
# whole blocks for P to hold and D to pull.
SYSTEM_PROMPT = (
    "You are a helpful assistant inside a small demo of a KV cache broker. The broker knows which "
    "engine holds which blocks of a prompt, and engines move those blocks peer to peer. Answer briefly."
)
TURNS = (
    "Tell me about the cache broker and how a prefill engine hands its blocks to a decode engine.",
    "And what happens to the lease when the decode engine dies in the middle of a transfer?",
    "Thanks. One more question: how does the next turn find the engine holding its history?",
)
# A log line the adapter's worker writes per finished read (see engine_adapter/worker.py).
_READ_LINE = re.compile(
    r"request (?P<req>\S+): read (?P<blocks>\d+) blocks \((?P<bytes>\d+) bytes\) from (?P<src>\S+) "
    r"in (?P<ms>[\d.]+) ms \((?P<gbps>[\d.]+) GB/s\)"
)
_TIER = {1: "GPU", 2: "CPU"}


def say(msg: str) -> None:
    print(msg, flush=True)


class ChildProcess:
    """A helper process (broker, proxy) in its own process group, logging to a file."""

    def __init__(self, name: str, cmd: list[str], log_path: Path) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ChildProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        import os

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        except ProcessLookupError:
            pass


@dataclass
class Stack:
    workdir: Path
    broker: ChildProcess | None = None
    broker_address: str = ""
    prefill: EngineProcess | None = None
    decode: EngineProcess | None = None
    proxy: ChildProcess | None = None
    proxy_url: str = ""
    stats: dict[str, Path] = field(default_factory=dict)
    _stopped: bool = False

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for part in (self.proxy, self.decode, self.prefill, self.broker):
            if part is not None:
                try:
                    part.stop()
                except Exception as e:
                    print(f"warning: stopping {part}: {e}", file=sys.stderr)


def _wait_http(url: str, what: str, timeout: float, alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{what} exited while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s")


def start_stack(workdir: Path, *, proxy_port: int, broker_port: int, threshold: int) -> Stack:
    stack = Stack(workdir)
    atexit.register(stack.stop)
    model_dir = workdir / "tiny-model"
    if not is_tiny_model_dir(model_dir):
        say(f"[1/4] building the tiny model in {model_dir} ...")
        build_tiny_model(model_dir)
    else:
        say(f"[1/4] tiny model already in {model_dir}")

    stack.broker_address = f"127.0.0.1:{broker_port}"
    say(f"[2/4] starting the broker on {stack.broker_address} ...")
    stack.broker = ChildProcess(
        "broker",
        [sys.executable, "-m", "kvbroker.broker", "--address", stack.broker_address],
        workdir / "broker.log",
    ).start()
    from kvbroker.clients.sync import BrokerClient

    with BrokerClient(stack.broker_address) as client:
        client.wait_ready(timeout=30)

    say("[3/4] starting the prefill and decode vLLM engines (CPU, about a minute) ...")

    def make_engine(name: str, role: str, attempt: int) -> EngineProcess:
        stats = workdir / f"{name}-stats.json"
        stack.stats[name] = stats
        config = connector_config(
            broker_address=stack.broker_address,
            engine_id=name,
            role=role,
            kv_recompute_threshold=threshold,
            stats_path=str(stats),
            # D holds each finished turn (prompt + answer) so the next turn's prefill can pull it.
            multi_turn=(role == "decode"),
        )
        return EngineProcess(
            model_dir,
            name=name,
            kv_transfer_config=config,
            served_model_name="tiny",
            max_model_len=4096,
            extra_args=["--enable-prompt-tokens-details"],
            log_path=workdir / f"{name}{'-retry' if attempt else ''}.log",
        ).start()

    stack.prefill = make_engine("prefill-0", "prefill", 0)
    stack.decode = make_engine("decode-0", "decode", 0)
    for role in ("prefill", "decode"):
        engine = stack.prefill if role == "prefill" else stack.decode
        try:
            engine.wait_ready(timeout=300, progress=lambda m: say("      " + m))
        except EngineStartError as e:
            # Another process may have taken the port picked for it (free ports
            # are only free when picked): one more try on a new port.
            say(f"      {engine.name} failed to start, retrying on a new port: {str(e).splitlines()[0]}")
            engine.stop()
            engine = make_engine(engine.name, role, 1)
            if role == "prefill":
                stack.prefill = engine
            else:
                stack.decode = engine
            engine.wait_ready(timeout=300, progress=lambda m: say("      " + m))

    stack.proxy_url = f"http://127.0.0.1:{proxy_port}"
    say(f"[4/4] starting the proxy on {stack.proxy_url} ...")
    stack.proxy = ChildProcess(
        "proxy",
        [
            sys.executable,
            "-m",
            "kvbroker.clients.proxy",
            "--host",
            "127.0.0.1",
            "--port",
            str(proxy_port),
            "--prefill",
            f"prefill-0={stack.prefill.url}",
            "--decode",
            f"decode-0={stack.decode.url}",
            "--broker",
            stack.broker_address,
        ],
        workdir / "proxy.log",
    ).start()
    proxy = stack.proxy
    _wait_http(stack.proxy_url + "/health", "proxy", 30, proxy.alive)
    return stack


class LeaseWatcher:
    """Collects the broker's lease events in a background thread."""

    def __init__(self, address: str) -> None:
        from kvbroker.clients.sync import BrokerClient

        self.events: list[Any] = []
        self._client = BrokerClient(address)
        self._thread = threading.Thread(target=self._run, daemon=True, name="demo-watch")
        self._thread.start()

    def _run(self) -> None:
        from kvbroker.clients.errors import BrokerError

        try:
            for event in self._client.watch(lease_events=True):
                self.events.append(event)
        except (BrokerError, ValueError):
            pass  # broker stopped or channel closed: the demo is ending

    def for_request(self, request_id: str) -> dict[str, list[Any]]:
        by_lease: dict[str, list[Any]] = {}
        for e in list(self.events):
            if request_id in e.lease.request_id:
                by_lease.setdefault(e.lease.lease_id, []).append(e)
        return by_lease

    def close(self) -> None:
        self._client.close()


def _read_stats(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _reads_in_log(engine: EngineProcess, request_id: str) -> list[dict[str, str]]:
    try:
        text = engine.log_path.read_text(errors="replace")
    except OSError:
        return []
    return [m.groupdict() for m in _READ_LINE.finditer(text) if request_id in m.group("req")]


def chat_turn(
    proxy_url: str, messages: list[dict[str, str]], request_id: str, max_tokens: int
) -> dict[str, Any]:
    """One streamed chat turn; returns the answer, TTFT, usage and routing headers."""
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        proxy_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    start = time.monotonic()
    ttft = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        headers = dict(resp.headers)
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"proxy stream error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    ttft = ttft if ttft is not None else time.monotonic() - start
                    text.append(content)
            usage = chunk.get("usage") or usage
    return {
        "answer": "".join(text),
        "ttft_s": ttft,
        "total_s": time.monotonic() - start,
        "usage": usage,
        "headers": headers,
    }


def _diff(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def run_chat(stack: Stack, turns: int, max_tokens: int) -> None:
    assert stack.prefill is not None and stack.decode is not None
    watcher = LeaseWatcher(stack.broker_address)
    engines = {"prefill-0": stack.prefill, "decode-0": stack.decode}
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    try:
        for turn, question in enumerate(TURNS[:turns], start=1):
            messages.append({"role": "user", "content": question})
            request_id = f"demo-t{turn}-{uuid.uuid4().hex[:8]}"
            before = {name: _read_stats(path) for name, path in stack.stats.items()}
            result = chat_turn(stack.proxy_url, messages, request_id, max_tokens)
            time.sleep(0.5)  # let leases end and stats files land
            after = {name: _read_stats(path) for name, path in stack.stats.items()}
            messages.append({"role": "assistant", "content": result["answer"]})

            h = {k.lower(): v for k, v in result["headers"].items()}
            usage = result["usage"]
            prompt_tokens = int(usage.get("prompt_tokens", 0))
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            say("")
            say(f"── turn {turn} ── request {request_id}")
            say(f"   user: {question}")
            say(
                f"   route: prefill on {h.get('x-kvbroker-prefill', '-')}, decode on "
                f"{h.get('x-kvbroker-decode', '-')} (mode {h.get('x-kvbroker-mode', '?')}"
                f"{', fallback: ' + h['x-kvbroker-fallback'] if 'x-kvbroker-fallback' in h else ''})"
            )
            ttft = result["ttft_s"]
            say(
                f"   time to first token: {ttft * 1000:.0f} ms   total: {result['total_s'] * 1000:.0f} ms   "
                f"answer: {usage.get('completion_tokens', '?')} tokens"
            )
            d_pulled = _diff(after.get("decode-0", {}), before.get("decode-0", {}), "pulled_blocks")
            d_pulled_tokens = d_pulled * stack.decode.block_size
            say(
                f"   decode-0 prompt: {prompt_tokens} tokens = {cached} from its own prefix cache + "
                f"{d_pulled_tokens} pulled + {max(prompt_tokens - cached - d_pulled_tokens, 0)} computed"
            )
            for name, engine in engines.items():
                pulled_blocks = _diff(after.get(name, {}), before.get(name, {}), "pulled_blocks")
                pulled_bytes = _diff(after.get(name, {}), before.get(name, {}), "pulled_bytes")
                reads = _reads_in_log(engine, request_id)
                if pulled_blocks or reads:
                    for r in reads:
                        say(
                            f"   {name}: pulled {r['blocks']} blocks ({int(r['blocks']) * engine.block_size} tokens, "
                            f"{int(r['bytes']) / 1e6:.2f} MB) from {r['src']} in {float(r['ms']):.1f} ms "
                            f"= {float(r['gbps']):.3f} GB/s"
                        )
                    if not reads:
                        say(f"   {name}: pulled {pulled_blocks} blocks ({pulled_bytes / 1e6:.2f} MB)")
                else:
                    skips = {
                        k: v - before.get(name, {}).get("skips", {}).get(k, 0)
                        for k, v in after.get(name, {}).get("skips", {}).items()
                    }
                    why = ", ".join(f"{k}" for k, v in skips.items() if v > 0) or "nothing remote to pull"
                    say(f"   {name}: pulled nothing ({why})")
            leases = watcher.for_request(request_id)
            if not leases:
                say("   leases: none")
            for lease_id, events in leases.items():
                last = events[-1].lease
                flow = " → ".join(e.kind.removeprefix("lease_") for e in events)
                cause = f" ({events[-1].detail})" if events[-1].detail else ""
                say(
                    f"   lease {lease_id[:12]}: holder {last.holder_engine_id} → reader "
                    f"{last.reader_engine_id or '-'}, {len(last.block_hashes)} blocks on "
                    f"{_TIER.get(last.tier, '?')}: {flow}{cause}"
                )
    finally:
        watcher.close()


def print_access(stack: Stack) -> None:
    assert stack.prefill is not None and stack.decode is not None
    say("")
    say("The stack is running. Reach it with:")
    say(f"  proxy (OpenAI API):  {stack.proxy_url}   model name: tiny")
    say(f"  broker (gRPC):       {stack.broker_address}")
    say(f"  prefill engine:      {stack.prefill.url}")
    say(f"  decode engine:       {stack.decode.url}")
    say(f"  logs:                {stack.workdir}")
    say("Try:")
    say(f"  curl -s {stack.proxy_url}/v1/chat/completions -H 'Content-Type: application/json' \\")
    say(
        '       -d \'{"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}\''
    )
    say(f"  KVBROKER_ADDR={stack.broker_address} kvbroker engines   # or: kvbroker leases --all")
    say("Press Ctrl-C to stop everything.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbroker.tools.demo",
        description="Start broker + prefill and decode vLLM engines + P/D proxy locally and run a multi-turn chat.",
    )
    parser.add_argument(
        "--keep-running", action="store_true", help="keep the stack up after the chat until Ctrl-C"
    )
    parser.add_argument(
        "--turns", type=int, default=3, choices=range(0, len(TURNS) + 1), help="chat turns to run (0-3)"
    )
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default 48)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where model, logs and stats go (default: a new temp dir)"
    )
    parser.add_argument("--proxy-port", type=int, default=0, help="proxy port (default: a free port)")
    parser.add_argument("--broker-port", type=int, default=0, help="broker port (default: a free port)")
    parser.add_argument(
        "--threshold", type=int, default=32, help="kv_recompute_threshold in tokens (default 32)"
    )
    args = parser.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvbroker-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stack_box: list[Stack] = []

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack = start_stack(
            workdir,
            proxy_port=args.proxy_port or free_port(),
            broker_port=args.broker_port or free_port(),
            threshold=args.threshold,
        )
        stack_box.append(stack)
        if args.turns:
            run_chat(stack, args.turns, args.max_tokens)
        if args.keep_running:
            print_access(stack)
            while all(p is not None and p.alive() for p in (stack.broker, stack.proxy)):
                time.sleep(1)
            say("a part of the stack exited; stopping")
    except KeyboardInterrupt:
        say("\ninterrupted")
    except Exception as e:
        print(f"demo failed: {e}\nlogs: {workdir}", file=sys.stderr)
        return 1
    finally:
        say("stopping everything ...")
        for stack in stack_box:
            stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

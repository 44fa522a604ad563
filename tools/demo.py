"""One command that shows the whole system working on a CPU machine.

    python -m kvbroker.tools.demo                 # real model: start, chat 3 turns, stop
    python -m kvbroker.tools.demo --model tiny    # the same on the 2-layer random-weight model (faster)
    python -m kvbroker.tools.demo --keep-running  # ... then keep the stack up until Ctrl-C
    python -m kvbroker.tools.demo --topology dp:2 # two data-parallel engines instead of P and D

It starts the broker (`python -m kvbroker.broker`), a prefill and a decode vLLM
engine with our BrokerConnector, and the P/D proxy (`python -m
kvbroker.clients.proxy`) (tools/demo_stack.py), then runs a multi-turn chat
through the proxy and prints per turn: the question and answer, time to first
token next to one engine alone answering the same conversation, which engines
served it, tokens pulled over NIXL versus computed (and from which engine and
tier), transfer GB/s, and each lease's lifecycle as the broker saw it. From
turn 2 on, the prefill engine pulls the earlier turns' prompt and answer
blocks from the decode engine, which held them when it finished. With
`--topology dp:N` the engines are neither P nor D: each turn goes whole to the
engine the proxy's placement picks (the route line says why), and an engine
without the history pulls it from the one that holds it. Everything
it started runs in its own process group and is stopped on exit, on an error
and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kvbroker.tools.chat import ChatAnswer, chat_body, stream_chat
from kvbroker.tools.demo_stack import TOPOLOGIES, ChildProcess, Stack, parse_topology, say, start_stack
from kvbroker.tools.launch import EngineProcess, free_port

__all__ = ["ChildProcess", "Stack", "chat_turn", "main", "start_stack"]

# A system prompt long enough to fill a few 32-token blocks, so even turn 1 has
# whole blocks for P to hold and D to pull.
SYSTEM_PROMPT = (
    "You are a helpful assistant inside a small demo of a KV cache broker. The broker knows which "
    "engine holds which blocks of a prompt, and engines move those blocks peer to peer. Answer briefly."
)
# The tiny model's answers are noise whatever it is asked.
TURNS = (
    "Tell me about the cache broker and how a prefill engine hands its blocks to a decode engine.",
    "And what happens to the lease when the decode engine dies in the middle of a transfer?",
    "Thanks. One more question: how does the next turn find the engine holding its history?",
)
# The real model's conversation: each turn builds on the one before. No system message: the
# model's chat template puts its own default system prompt first, the same for every chat.
REAL_SYSTEM_PROMPT = ""
# Each answer runs to a few full blocks, so from turn 2 on the history P pulls from D
# includes answer blocks P never saw (a one-line answer would fit in P's own last block).
REAL_TURNS = (
    "Tell me about Paris, the capital of France.",
    "Tell me about the Eiffel Tower in Paris.",
    "And what can I see in the Louvre museum?",
)
# The demo pauses between turns (it runs each turn on one engine alone too): the decode
# engine keeps a finished turn for the next one this long (the adapter's default is 30 s).
DEMO_HOLD_TTL_MS = 120_000
# A log line the adapter's worker writes per finished read (see engine_adapter/worker.py).
_READ_LINE = re.compile(
    r"request (?P<req>\S+): read (?P<blocks>\d+) blocks \((?P<bytes>\d+) bytes\) from (?P<src>\S+) "
    r"in (?P<ms>[\d.]+) ms \((?:(?P<gbps>[\d.]+) GB/s|(?P<first>first read from this peer)[^)]*)\)"
)
_TIER = {1: "GPU", 2: "CPU"}


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
    proxy_url: str,
    messages: list[dict[str, str]],
    request_id: str,
    max_tokens: int,
    *,
    model: str = "tiny",
    ignore_eos: bool = True,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """One streamed chat turn; returns the answer, TTFT, usage and routing headers.

    ignore_eos=True (the tiny model's default: its answers are noise) always
    generates max_tokens; a real model should stop at its end-of-turn token."""
    body = chat_body(
        messages, model=model, max_tokens=max_tokens, ignore_eos=ignore_eos, cache_salt=cache_salt
    )
    a = stream_chat(proxy_url, body, request_id)
    return {
        "answer": a.text,
        "token_ids": a.token_ids,
        "ttft_s": a.ttft_s,
        "total_s": a.total_s,
        "usage": a.usage,
        "headers": a.headers,
    }


def _diff(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def _print_leases(watcher: LeaseWatcher, request_id: str, label: str = "") -> None:
    for lease_id, events in watcher.for_request(request_id).items():
        last = events[-1].lease
        flow = " → ".join(e.kind.removeprefix("lease_") for e in events)
        cause = f" ({events[-1].detail})" if events[-1].detail else ""
        say(
            f"   {label}lease {lease_id[:12]}: holder {last.holder_engine_id} → reader "
            f"{last.reader_engine_id or '-'}, {len(last.block_hashes)} blocks on "
            f"{_TIER.get(last.tier, '?')}: {flow}{cause}"
        )


def _print_pulls(
    engines: dict[str, EngineProcess], before: dict[str, Any], after: dict[str, Any], rid: str
) -> int:
    """One line per engine: its NIXL reads for this request, or why it pulled nothing. Returns the
    prompt tokens P pulled (P/D) or every engine pulled (data-parallel)."""
    pulled_by_p = 0
    for name, engine in engines.items():
        pulled_blocks = _diff(after.get(name, {}), before.get(name, {}), "pulled_blocks")
        pulled_bytes = _diff(after.get(name, {}), before.get(name, {}), "pulled_bytes")
        # What vLLM took as computed: a prompt's partial last block counts its own tokens.
        pulled_tokens = _diff(after.get(name, {}), before.get(name, {}), "pulled_tokens")
        if not name.startswith("decode"):
            pulled_by_p += pulled_tokens
        reads = _reads_in_log(engine, rid)
        if pulled_blocks or reads:
            for r in reads:
                say(
                    f"   {name}: pulled {r['blocks']} blocks ({int(r['bytes']) / 1e6:.2f} MB) from {r['src']} "
                    f"in {float(r['ms']):.1f} ms "
                    + (
                        f"= {float(r['gbps']):.3f} GB/s"
                        if r["gbps"]
                        else "(the first read from this peer: NIXL's connection set-up, not a bandwidth)"
                    )
                )
            if not reads:
                say(f"   {name}: pulled {pulled_blocks} blocks ({pulled_bytes / 1e6:.2f} MB)")
            if pulled_tokens:
                say(f"   {name}: {pulled_tokens} prompt tokens loaded instead of computed")
        else:
            skips = {
                k: v - before.get(name, {}).get("skips", {}).get(k, 0)
                for k, v in after.get(name, {}).get("skips", {}).items()
            }
            why = ", ".join(f"{k}" for k, v in skips.items() if v > 0) or "nothing remote to pull"
            say(f"   {name}: pulled nothing ({why})")
    return pulled_by_p


def wait_idle(proxy_url: str, timeout_s: float = 10.0) -> bool:
    """Whether the proxy saw every engine idle (load 0 in its /health) within `timeout_s`."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(proxy_url + "/health", timeout=5) as resp:
                engines = json.loads(resp.read()).get("engines", [])
            if all(not e.get("load") for e in engines):
                return True
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def run_chat(stack: Stack, turns: int, max_tokens: int, compare: bool = True) -> list[dict[str, Any]]:
    """The chat through the proxy; with `compare`, each turn again on prefill-0 alone (same
    conversation under its own cache_salt: only that engine's prefix cache helps it)."""
    alone = stack.prefill or next(iter(stack.engines.values()))
    real = stack.model == "real"
    system, questions = (REAL_SYSTEM_PROMPT, REAL_TURNS) if real else (SYSTEM_PROMPT, TURNS)
    watcher = LeaseWatcher(stack.broker_address)
    engines = stack.engines
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    single_salt = f"demo-single-{uuid.uuid4().hex[:8]}"
    rows: list[dict[str, Any]] = []
    previous = ""
    try:
        for turn, question in enumerate(questions[:turns], start=1):
            messages.append({"role": "user", "content": question})
            request_id = f"demo-t{turn}-{uuid.uuid4().hex[:8]}"
            if stack.topology == "dp":
                # One turn at a time: the comparison run just ended on one engine; its load
                # reaches the proxy with the engine's next heartbeat (the placement weighs it).
                wait_idle(stack.proxy_url)
            body = chat_body(messages, model=stack.served_name, max_tokens=max_tokens, ignore_eos=not real)
            before = {name: _read_stats(path) for name, path in stack.stats.items()}
            result = stream_chat(stack.proxy_url, body, request_id)
            time.sleep(0.5)  # let leases end and stats files land
            after = {name: _read_stats(path) for name, path in stack.stats.items()}
            single: ChatAnswer | None = None
            if compare:
                single = stream_chat(alone.url, {**body, "cache_salt": single_salt}, f"{request_id}-alone")
            messages.append({"role": "assistant", "content": result.text})

            h = {k.lower(): v for k, v in result.headers.items()}
            prompt_tokens = int(result.usage.get("prompt_tokens", 0))
            say("")
            say(f"── turn {turn} ── request {request_id}")
            say(f"   user: {question}")
            say(f"   assistant: {' '.join(result.text.split())}")
            served = h.get("x-kvbroker-decode", "-")
            if stack.topology == "dp":
                say(
                    f"   route: {served} (mode {h.get('x-kvbroker-mode', '?')}, {h.get('x-kvbroker-route', '?')})"
                )
            else:
                say(
                    f"   route: prefill on {h.get('x-kvbroker-prefill', '-')}, decode on "
                    f"{served} (mode {h.get('x-kvbroker-mode', '?')}"
                    f"{', fallback: ' + h['x-kvbroker-fallback'] if 'x-kvbroker-fallback' in h else ''})"
                )
            ttft_ms = (result.ttft_s or 0.0) * 1000
            line = f"   time to first token: {ttft_ms:.0f} ms through {'the proxy' if stack.topology == 'dp' else 'P/D'}"
            if single is not None:
                line += f" | {(single.ttft_s or 0.0) * 1000:.0f} ms on one engine alone"
            say(f"{line}   (answer: {len(result.token_ids)} tokens in {result.total_s * 1000:.0f} ms)")
            server = served if served in engines else "decode-0"
            d_pulled_tokens = _diff(after.get(server, {}), before.get(server, {}), "pulled_tokens")
            # A whole request's cached_tokens counts what the connector loaded too (vLLM's
            # computed-before-the-first-step figure); P/D's decode is told its prompt separately.
            own = result.cached_tokens - (d_pulled_tokens if stack.topology == "dp" else 0)
            own = max(own, 0)
            say(
                f"   {server} prompt: {prompt_tokens} tokens = {own} from its own prefix cache + "
                f"{d_pulled_tokens} pulled + {max(prompt_tokens - own - d_pulled_tokens, 0)} computed"
            )
            pulled_by_p = _print_pulls(engines, before, after, request_id)
            if previous:
                _print_leases(watcher, previous, "earlier turn's ")
            _print_leases(watcher, request_id)
            previous = request_id
            rows.append(
                {
                    "turn": turn,
                    "prompt_tokens": prompt_tokens,
                    "ttft_ms": ttft_ms,
                    "single_ttft_ms": (single.ttft_s or 0.0) * 1000 if single else None,
                    "history_pulled_tokens": pulled_by_p,
                    "identical": single.token_ids == result.token_ids if single else None,
                    "answer_tokens": len(result.token_ids),
                }
            )
    finally:
        watcher.close()
    _print_summary(rows, alone.name, stack.topology)
    return rows


def _print_summary(rows: list[dict[str, Any]], alone: str = "prefill-0", topology: str = "pd") -> None:
    if not rows:
        return
    say("")
    via, puller = ("P/D", "by P") if topology == "pd" else ("DP ", "(all)")
    say(
        f"turn  prompt tokens  TTFT {via} ms  TTFT one engine ms  history pulled {puller} (tokens)  same tokens"
    )
    for r in rows:
        single = "-" if r["single_ttft_ms"] is None else f"{r['single_ttft_ms']:.0f}"
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        say(
            f"{r['turn']:<4}  {r['prompt_tokens']:<13}  {r['ttft_ms']:<11.0f}  {single:<18}  "
            f"{r['history_pulled_tokens']:<28}  {same}"
        )
    say(
        f"(one engine: {alone} answering the same conversation alone, its own prefix cache warm from "
        "the earlier turns; the machine's cores are shared by everything here)"
    )
    say(workload_line(rows, os.getloadavg()[0], os.cpu_count() or 1))


def workload_line(rows: list[dict[str, Any]], load: float, cores: int) -> str:
    """The workload every figure above was measured under: follow-up length, concurrency, cores, load."""
    follow_ups = [
        r["prompt_tokens"] - prev["prompt_tokens"] - prev.get("answer_tokens", 0)
        for prev, r in itertools.pairwise(rows)
    ]
    follow = ", ".join(str(max(0, f)) for f in follow_ups) or "none"
    loaded = " (measured under load: other work shares these cores)" if load > cores else ""
    return (
        f"workload: 1 chat, one request at a time; first prompt {rows[0]['prompt_tokens']} tokens, "
        f"follow-ups of {follow} tokens (chat template included); P/D: P pinned to 1 core and D to another; "
        f"one engine: prefill-0 on its 1 core; load average {load:.1f} on {cores} cores{loaded}"
    )


def venv_command(name: str) -> str:
    """How to run this venv's `name` script from the current directory, as printed in hints:
    `.venv/bin/kvbroker` under `make up`, not a bare name that needs the venv on PATH."""
    script = Path(sys.executable).parent / name
    try:
        relative = os.path.relpath(script)
    except ValueError:
        return str(script)
    return relative if not relative.startswith("..") else str(script)


def try_commands(stack: Stack) -> list[str]:
    """The commands `make up` prints, runnable as printed from the directory it ran in."""
    first = stack.prefill or next(iter(stack.engines.values()))
    kvbroker = venv_command("kvbroker")
    chat = json.dumps(
        {
            "model": stack.served_name,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
        }
    )
    return [
        f"curl -s {stack.proxy_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{chat}'",
        f"{kvbroker} --broker {stack.broker_address} engines   # or: leases --all, stats, watch",
        f"{kvbroker} vllm bench serve --base-url {stack.proxy_url} --model {stack.served_name} "
        f"--tokenizer {first.model_dir} --dataset-name random --random-input-len 256 "
        "--random-output-len 32 --num-prompts 8",
    ]


def print_access(stack: Stack) -> None:
    say("")
    say("The stack is running. Reach it with:")
    say(f"  proxy (OpenAI API):  {stack.proxy_url}   model name: {stack.served_name}")
    say(f"  proxy health:        {stack.proxy_url}/health   (metrics: {stack.proxy_url}/metrics)")
    say(f"  broker (gRPC):       {stack.broker_address}   (metrics: {stack.broker_metrics_url})")
    for name, engine in stack.engines.items():
        say(f"  {name + ' engine:':<20} {engine.url}   (metrics: {engine.url}/metrics)")
    say(f"  logs:                {stack.workdir}")
    say("Try (from this directory):")
    for command in try_commands(stack):
        say(f"  {command}")
    say("The broker is supervised: if it dies it is started again; engines and proxy ride through.")
    say("Press Ctrl-C to stop everything.")


def _topology(text: str) -> str:
    try:
        parse_topology(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbroker.tools.demo",
        description="Start broker + vLLM engines (P and D, or data-parallel) + proxy locally and run a multi-turn chat.",
    )
    parser.add_argument(
        "--model",
        choices=("real", "tiny"),
        default="real",
        help="real: SmolLM2-135M-Instruct (default); tiny: the 2-layer random-weight test model (faster)",
    )
    parser.add_argument(
        "--keep-running", action="store_true", help="keep the stack up after the chat until Ctrl-C"
    )
    parser.add_argument(
        "--topology",
        type=_topology,
        default="pd",
        help=f"pd: a prefill and a decode engine (default); dp:N: N data-parallel engines in kv_both "
        f"that pull prefixes from each other, placed by load and prefix ({TOPOLOGIES})",
    )
    parser.add_argument("--turns", type=int, default=3, choices=range(0, 4), help="chat turns to run (0-3)")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per answer at most (default: 64 real, 48 tiny)"
    )
    parser.add_argument(
        "--no-compare", action="store_true", help="skip running each turn again on one engine alone"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where logs, stats (and the tiny model) go (default: a new temp dir)",
    )
    parser.add_argument("--proxy-port", type=int, default=0, help="proxy port (default: a free port)")
    parser.add_argument("--broker-port", type=int, default=0, help="broker port (default: a free port)")
    parser.add_argument(
        "--threshold",
        type=int,
        default=None,
        help="the fixed pull rule: pull when at least this many tokens are held elsewhere "
        "(default: the adaptive policy, which times prefills and pulls)",
    )
    args = parser.parse_args(argv)
    max_tokens = args.max_tokens or (64 if args.model == "real" else 48)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvbroker-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stack_box: list[Stack] = []
    started = time.monotonic()
    say(f"logs, stats and the model go to {workdir}")

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack = start_stack(
            workdir,
            proxy_port=args.proxy_port,
            broker_port=args.broker_port or free_port(),
            threshold=args.threshold,
            model=args.model,
            connector_extra={"hold_ttl_ms": DEMO_HOLD_TTL_MS},
            topology=args.topology,
        )
        stack_box.append(stack)
        say(f"stack up after {time.monotonic() - started:.0f} s")
        if args.turns:
            run_chat(stack, args.turns, max_tokens, compare=not args.no_compare)
        if args.keep_running:
            print_access(stack)
            # The broker has its supervisor; the proxy ending ends the stack.
            while stack.proxy is not None and stack.proxy.alive():
                time.sleep(1)
            say("the proxy exited; stopping")
    except KeyboardInterrupt:
        say("\ninterrupted")
    except Exception as e:
        print(f"demo failed: {e}\nlogs: {workdir}", file=sys.stderr)
        return 1
    finally:
        say("stopping everything ...")
        for stack in stack_box:
            stack.stop()
    say(f"done in {time.monotonic() - started:.0f} s; logs and stats kept in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

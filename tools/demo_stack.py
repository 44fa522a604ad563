"""The demo's stack: broker, vLLM engines with our connector, and the proxy, each a child process
in its own process group with its log in the work directory. Two topologies:

- `pd` (the default): a prefill and a decode engine behind the P/D proxy;
- `dp:N`: N engines that are neither P nor D (each serves whole requests, in
  kv_both, pulling a prefix from whichever engine holds it) behind the proxy in
  its data-parallel mode (`--no-disaggregate`: each request goes to the engine
  with the lowest predicted time to first token, common/placement.py).

`start_stack(workdir, model="real" | "tiny", ...)` starts it and returns a `Stack`
whose `stop()` ends everything (also registered with atexit). The broker is
supervised: when it dies it is started again on the same address, with
backoff, while the engines and the proxy stay up and reconnect to it (the
guarantee the stack is there to show). Engines keep vLLM's stats on, so their
/metrics has the `vllm:*` series (KV cache usage); the broker serves /metrics
on a port of its own. Two models:

- `real`: SmolLM2-135M-Instruct (kvbroker.tools.real_model, converted once and
  cached outside the repository); a real chat model, served as `smollm2`;
- `tiny`: the 2-layer random-weight model (kvbroker.tools.tiny_model), built in
  the work directory in a second, served as `tiny`: fast, but its answers are
  noise.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbroker.tools.children import ChildProcess, ProxyProcess
from kvbroker.tools.launch import EngineProcess, EngineStartError, connector_config, pin_apart

# model choice -> the name the proxy and engines serve it under
SERVED_NAMES = {"real": "smollm2", "tiny": "tiny"}
TOPOLOGIES = "pd, dp:N (N data-parallel engines, 1-8)"
MAX_DP_ENGINES = 8


def parse_topology(text: str) -> tuple[str, int]:
    """("pd", 2) or ("dp", N) from `pd` or `dp:N`; ValueError with what to write instead."""
    kind, _, count = text.strip().lower().partition(":")
    if kind == "pd" and not count:
        return "pd", 2
    if kind == "dp":
        try:
            n = int(count or "2")
        except ValueError:
            n = 0
        if 1 <= n <= MAX_DP_ENGINES:
            return "dp", n
    raise ValueError(f"topology {text!r}: choose one of {TOPOLOGIES}, e.g. dp:2")


# KV cache per engine: about 340 blocks of the real model (1.5 MB each, 10,900 tokens), thousands of the tiny one's.
KV_CACHE_BYTES = {"real": 512 << 20, "tiny": 256 << 20}
# Data-parallel engines' CPU offload tier, in blocks (here and in the fleet benchmark's ours-dp
# setups; SmolLM2-135M: 360 MiB of host memory per engine): a pull from a busy holder reads its
# CPU copy, pinned at once, instead of waiting for the holder's scheduler step to pin its GPU copy
# (docs/serving.md, "Data-parallel fleets").
DP_CPU_TIER_BLOCKS = 256


def say(msg: str) -> None:
    print(msg, flush=True)


class Supervisor:
    """Starts a child process again whenever it exits, waiting 1, 2, 4 ... s (at most `max_backoff_s`)
    between tries; the wait drops back to 1 s once the child has stayed up for `stable_s`."""

    def __init__(
        self,
        child: ChildProcess,
        *,
        min_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stable_s: float = 60.0,
        report: Callable[[str], None] = say,
    ) -> None:
        self.child = child
        self.min_backoff_s, self.max_backoff_s, self.stable_s = min_backoff_s, max_backoff_s, stable_s
        self.report = report
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"supervise-{child.name}", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        backoff = self.min_backoff_s
        up_since = time.monotonic()
        while not self._stop.wait(0.2):
            if self.child.alive():
                if time.monotonic() - up_since >= self.stable_s:
                    backoff = self.min_backoff_s
                continue
            code = self.child.returncode
            self.report(
                f"!! the {self.child.name} exited (code {code}); starting it again in {backoff:g} s "
                f"(engines and proxy stay up and reconnect; log: {self.child.log_path})"
            )
            if self._stop.wait(backoff):
                return
            self.child.start()
            self.restarts += 1
            up_since = time.monotonic()
            self.report(
                f"!! the {self.child.name} is running again (pid {self.child.pid}, restart {self.restarts})"
            )
            backoff = min(backoff * 2, self.max_backoff_s)


@dataclass
class Stack:
    workdir: Path
    model: str = "tiny"
    served_name: str = "tiny"
    broker: ChildProcess | None = None
    broker_address: str = ""
    broker_metrics_url: str = ""
    broker_supervisor: Supervisor | None = None
    prefill: EngineProcess | None = None
    decode: EngineProcess | None = None
    topology: str = "pd"  # or "dp"
    engines: dict[str, EngineProcess] = field(default_factory=dict)  # every engine, by name
    proxy: ChildProcess | None = None
    proxy_url: str = ""
    stats: dict[str, Path] = field(default_factory=dict)
    _stopped: bool = False

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.broker_supervisor is not None:
            self.broker_supervisor.stop()
        for part in (self.proxy, *reversed(self.engines.values()), self.broker):
            if part is not None:
                try:
                    part.stop()
                except Exception as e:
                    print(f"warning: stopping {part}: {e}", file=sys.stderr)


def model_folder(model: str, workdir: Path) -> Path:
    """The model's checkpoint folder, built first if needed (progress on stdout)."""
    if model == "real":
        from kvbroker.tools.real_model import ensure_real_model

        folder = ensure_real_model(log=lambda m: say("      " + m))
        say(f"[1/4] SmolLM2-135M-Instruct (float32, 30 layers) in {folder}")
        return folder
    if model != "tiny":
        raise ValueError(f"model {model!r}: choose one of {sorted(SERVED_NAMES)}")
    from kvbroker.tools.tiny_model import build_tiny_model, is_tiny_model_dir

    folder = workdir / "tiny-model"
    if not is_tiny_model_dir(folder):
        say(f"[1/4] building the tiny model in {folder} ...")
        build_tiny_model(folder)
    else:
        say(f"[1/4] tiny model already in {folder}")
    return folder


def start_stack(
    workdir: Path,
    *,
    proxy_port: int,
    broker_port: int,
    threshold: int | None,
    model: str = "tiny",
    connector_extra: dict[str, Any] | None = None,
    broker_metrics_port: int = 0,
    local_prefill_tokens: int = 0,
    topology: str = "pd",
) -> Stack:
    """Build or find the model, start broker, the engines of `topology` (`pd` or `dp:N`) and the
    proxy; `connector_extra` adds kv_connector_extra_config keys to every engine (e.g. hold_ttl_ms).
    With P/D the proxy prefills
    every turn on P (`local_prefill_tokens` 0), so the demo shows turn 2 pulling the history
    D holds; the proxy's own default (256) lets D serve such a turn alone. `proxy_port` 0: a free
    one. Whatever fails, what was started is stopped before the error goes on."""
    stack = Stack(workdir, model=model, served_name=SERVED_NAMES.get(model, model))
    atexit.register(stack.stop)
    try:
        _start_parts(
            stack,
            workdir,
            proxy_port=proxy_port,
            broker_port=broker_port,
            threshold=threshold,
            connector_extra=connector_extra,
            broker_metrics_port=broker_metrics_port,
            local_prefill_tokens=local_prefill_tokens,
            topology=topology,
        )
    except BaseException:
        stack.stop()
        raise
    return stack


def _start_parts(
    stack: Stack,
    workdir: Path,
    *,
    proxy_port: int,
    broker_port: int,
    threshold: int | None,
    connector_extra: dict[str, Any] | None,
    broker_metrics_port: int,
    local_prefill_tokens: int,
    topology: str,
) -> None:
    model = stack.model
    model_dir = model_folder(model, workdir)

    from kvbroker.tools.launch import free_port

    stack.broker_address = f"127.0.0.1:{broker_port}"
    metrics_port = broker_metrics_port or free_port()
    stack.broker_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    say(f"[2/4] starting the broker on {stack.broker_address} (metrics: {stack.broker_metrics_url}) ...")
    stack.broker = ChildProcess(
        "broker",
        [
            sys.executable,
            "-m",
            "kvbroker.broker",
            "--address",
            stack.broker_address,
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(metrics_port),
        ],
        workdir / "broker.log",
    ).start()
    from kvbroker.clients.sync import BrokerClient

    with BrokerClient(stack.broker_address) as client:
        client.wait_ready(timeout=30)
    stack.broker_supervisor = Supervisor(stack.broker).start()

    kind, count = parse_topology(topology)
    stack.topology = kind
    roles = (
        {"prefill-0": "prefill", "decode-0": "decode"}
        if kind == "pd"
        else {f"engine-{i}": "both" for i in range(count)}
    )
    what = "the prefill and decode vLLM engines" if kind == "pd" else f"{count} data-parallel vLLM engines"
    say(f"[3/4] starting {what} (CPU; 1-2 minutes, progress every 5 s) ...")

    def make_engine(name: str, role: str, attempt: int) -> EngineProcess:
        stats = workdir / f"{name}-stats.json"
        stack.stats[name] = stats
        config = connector_config(
            broker_address=stack.broker_address,
            engine_id=name,
            role=role,
            kv_recompute_threshold=threshold,
            # None: the adaptive policy (the engines' default), which learns what a prefill
            # and a pull cost here; a threshold selects the fixed rule.
            stats_path=str(stats),
            # D holds each finished turn (prompt + answer) so the next turn's prefill can pull it.
            # Data-parallel engines offer what their prefix caches hold (pinned when pulled).
            multi_turn=(role == "decode"),
            **({"cpu_tier_blocks": DP_CPU_TIER_BLOCKS} if role == "both" else {}) | (connector_extra or {}),
        )
        return EngineProcess(
            model_dir,
            name=name,
            kv_transfer_config=config,
            served_model_name=stack.served_name,
            max_model_len=4096,
            kv_cache_bytes=KV_CACHE_BYTES.get(model, KV_CACHE_BYTES["tiny"]),
            extra_args=["--enable-prompt-tokens-details"],
            # vLLM's stats on: the engines' /metrics then has the vllm:* series (KV cache usage).
            log_stats=True,
            log_path=workdir / f"{name}{'-retry' if attempt else ''}.log",
        ).start()

    for name, role in roles.items():
        stack.engines[name] = make_engine(name, role, 0)
    for name, role in roles.items():
        engine = stack.engines[name]
        try:
            engine.wait_ready(timeout=600, progress=lambda m: say("      " + m))
        except EngineStartError as e:
            # Another process may have taken the port picked for it (free ports
            # are only free when picked): one more try on a new port.
            say(f"      {engine.name} failed to start, retrying on a new port: {str(e).splitlines()[0]}")
            engine.stop()
            engine = stack.engines[name] = make_engine(name, role, 1)
            engine.wait_ready(timeout=600, progress=lambda m: say("      " + m))
    stack.prefill, stack.decode = stack.engines.get("prefill-0"), stack.engines.get("decode-0")
    # On one machine each engine gets cores of its own, as on hardware of its own:
    # otherwise each engine's steps also pay for the others' busy-polling.
    pin_apart(list(stack.engines.values()), lambda m: say("      " + m))

    # Port 0: ProxyProcess picks one now, after the engines took theirs (a port picked earlier may
    # be taken by then), and a second try gets a new one if another process took it all the same.
    for attempt in range(1 if proxy_port else 2):
        try:
            stack.proxy = _start_proxy(stack, workdir, proxy_port, local_prefill_tokens)
            break
        except Exception as e:
            if attempt or proxy_port:
                raise
            say(f"      the proxy failed to start on {stack.proxy_url}, retrying on a new port: {e}")


def _start_proxy(stack: Stack, workdir: Path, port: int, local_prefill_tokens: int) -> ProxyProcess:
    """The proxy on `port` (0: a free one), started and answering."""
    if stack.topology == "pd":
        assert stack.prefill is not None and stack.decode is not None
        proxy = ProxyProcess(
            workdir / "proxy.log",
            prefill={"prefill-0": stack.prefill.url},
            decode={"decode-0": stack.decode.url},
            broker=stack.broker_address,
            local_prefill_tokens=local_prefill_tokens,
            port=port,
        )
    else:
        proxy = ProxyProcess(
            workdir / "proxy.log",
            engines={name: e.url for name, e in stack.engines.items()},
            broker=stack.broker_address,
            extra_args=["--no-disaggregate"],
            port=port,
        )
    stack.proxy_url = proxy.url
    say(f"[4/4] starting the proxy on {stack.proxy_url} ...")
    return proxy.start()

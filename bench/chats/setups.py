"""The four setups of bench.chats.compare: what each starts and where its client sends chats.

- `single`: one vLLM engine, prefix caching on (the physical limit for turn 2+);
- `nocache`: one vLLM engine, prefix caching off (pure recompute);
- `nixl`: P and D with vLLM's NixlConnector (`bidirectional_kv_xfer` on, NIXL
  without its spinning progress thread: `bench.harness.nixl_quiet`) behind
  `bench.chats.nixl_proxy` (conversation -> D's kv_transfer_params);
- `broker`: a broker process, P and D with our BrokerConnector (D `multi_turn`)
  behind our proxy, `python -m kvbroker.clients.proxy`.

Every engine: the real model (SmolLM2-135M-Instruct, float32), block size 32,
max model length 4096, 1 GiB of KV cache, served as "smollm2", with
`--enable-prompt-tokens-details` so answers report their prefix-cache hits.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chats.workload import ROOT, SERVED_MODEL
from bench.harness.baselines import nixl_engine
from bench.harness.engines import broker_connector_config, pin_pair
from bench.harness.output import log
from kvbroker.tools.launch import EngineProcess, engine_environment, free_port
from testkit.engines import BLOCK_SIZE, read_stats
from testkit.processes import BrokerProcess, ChildProcess, ProxyProcess, python_env

SETUPS = ("single", "nocache", "nixl", "broker", "broker-local")
KV_CACHE_BYTES = 1 << 30
MAX_MODEL_LEN = 4096
ENGINE_ARGS = ("--enable-prompt-tokens-details",)


def _engine(
    model: Path,
    work: Path,
    name: str,
    *,
    kv_cache_bytes: int,
    cls: type[EngineProcess] = EngineProcess,
    **kw: Any,
) -> EngineProcess:
    extra = list(ENGINE_ARGS) + list(kw.pop("extra_args", ()))
    return cls(
        model,
        name=name,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=kv_cache_bytes,
        served_model_name=SERVED_MODEL,
        extra_args=extra,
        log_path=work / f"{name}.log",
        **kw,
    )


@dataclass
class Setup:
    """One running setup: where the client sends chats, and what to read after each turn."""

    name: str
    url: str = ""
    engines: list[EngineProcess] = field(default_factory=list)
    children: list[ChildProcess] = field(default_factory=list)
    broker: BrokerProcess | None = None
    stats_paths: dict[str, Path] = field(default_factory=dict)  # our connector's counters, per engine
    direct: dict[str, str] = field(default_factory=dict)  # role -> engine URL (profiling pass)

    def logs(self) -> dict[str, Path]:
        out = {e.name: e.log_path for e in self.engines}
        out.update({c.name: c.log_path for c in self.children})
        return out

    def pulled_tokens(self) -> dict[str, int]:
        """Our connector's pulled-token counter per engine (what vLLM took as computed)."""
        return {
            n: int(read_stats(p, settle=False).get("pulled_tokens", 0)) for n, p in self.stats_paths.items()
        }

    def stop(self) -> None:
        for c in self.children:
            c.stop()
        for e in self.engines:
            e.stop()
        if self.broker is not None:
            self.broker.stop()


def start_setup(
    name: str, model: Path, work: Path, start_timeout_s: float, kv_cache_bytes: int = KV_CACHE_BYTES
) -> Setup:
    """Start a setup's processes and wait until its client endpoint answers."""
    if name not in SETUPS:
        raise ValueError(f"unknown setup {name!r}; one of {SETUPS}")
    setup = Setup(name)
    try:
        if name in ("single", "nocache"):
            extra = ["--no-enable-prefix-caching"] if name == "nocache" else []
            engine = _engine(model, work, name, kv_cache_bytes=kv_cache_bytes, extra_args=extra).start()
            setup.engines = [engine]
            engine.wait_ready(timeout=start_timeout_s, progress=log)
            setup.url = engine.url
        elif name == "nixl":
            _start_nixl(setup, model, work, start_timeout_s, kv_cache_bytes)
        else:
            _start_broker(setup, model, work, start_timeout_s, kv_cache_bytes)
    except BaseException:
        setup.stop()
        raise
    return setup


def _start_pair(setup: Setup, engines: list[EngineProcess], start_timeout_s: float) -> tuple[str, str]:
    setup.engines = [e.start() for e in engines]
    for e in setup.engines:
        e.wait_ready(timeout=start_timeout_s, progress=log)
    p, d = setup.engines
    pin_pair(p, d)
    setup.direct = {"prefill": p.url, "decode": d.url}
    return p.url, d.url


def _start_nixl(setup: Setup, model: Path, work: Path, start_timeout_s: float, kv_cache_bytes: int) -> None:
    """The baseline (bench.harness.baselines) behind bench.chats.nixl_proxy."""
    engines = [
        nixl_engine(
            model,
            work,
            role,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=kv_cache_bytes,
            served_model_name=SERVED_MODEL,
            extra_args=list(ENGINE_ARGS),
        )
        for role in ("P-nixl", "D-nixl")
    ]
    p_url, d_url = _start_pair(setup, engines, start_timeout_s)
    port = free_port()
    proxy = ChildProcess(
        "nixl-proxy",
        [
            sys.executable,
            "-m",
            "bench.chats.nixl_proxy",
            "--prefill",
            p_url,
            "--decode",
            d_url,
            "--port",
            str(port),
        ],
        work / "nixl-proxy.log",
        env=python_env(engine_environment()),
        cwd=ROOT,
    ).start()
    setup.children.append(proxy)
    setup.url = f"http://127.0.0.1:{port}"
    proxy.wait_http(setup.url + "/health", 60)


def _start_broker(setup: Setup, model: Path, work: Path, start_timeout_s: float, kv_cache_bytes: int) -> None:
    """Our P/D: a broker, P and D with our connector (D multi_turn), our proxy."""
    setup.broker = BrokerProcess(work).start()
    engines = []
    for eng_name, role, role_extra in (("P", "prefill", {}), ("D", "decode", {"multi_turn": True})):
        stats = work / f"{eng_name}-stats.json"
        config = broker_connector_config(setup.broker.address, eng_name, role, stats, **role_extra)
        engines.append(
            _engine(model, work, eng_name, kv_cache_bytes=kv_cache_bytes, kv_transfer_config=config)
        )
        setup.stats_paths[eng_name] = stats
    p_url, d_url = _start_pair(setup, engines, start_timeout_s)
    proxy = ProxyProcess(
        work / "proxy.log",
        prefill={"P": p_url},
        decode={"D": d_url},
        broker=setup.broker.address,
        # broker: every turn prefills on P (the pull path the targets judge);
        # broker-local: the proxy's default, D serves a turn it holds but for a few tokens.
        local_prefill_tokens=0 if setup.name == "broker" else None,
    )
    setup.children.append(proxy)
    proxy.start(timeout=60)
    setup.url = proxy.url

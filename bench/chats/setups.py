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

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chats.workload import ROOT, SERVED_MODEL
from bench.harness.output import log
from kvbroker.tools.launch import EngineProcess, connector_config, engine_environment, free_port, pin_apart
from testkit.engines import ACQUIRE_WAIT_MS, BLOCK_SIZE, RESOLVE_WAIT_MS, read_stats
from testkit.processes import BrokerProcess

SETUPS = ("single", "nocache", "nixl", "broker", "broker-local")
KV_CACHE_BYTES = 1 << 30
MAX_MODEL_LEN = 4096
ENGINE_ARGS = ("--enable-prompt-tokens-details",)


class LoggingStatsEngine(EngineProcess):
    """Keeps vLLM's periodic stats logging on: NixlConnector reports its transfers only there."""

    def command(self) -> list[str]:
        return [a for a in super().command() if a != "--disable-log-stats"]


class Child:
    """A helper process (broker proxy, NIXL proxy) in its own process group, logging to a file."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.log_path, self.env = name, cmd, log_path, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        out = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=self.env,
            cwd=str(ROOT),
        )
        return self

    def wait_http(self, url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not answer {url} in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        except ProcessLookupError:
            pass


def _env_with_repo() -> dict[str, str]:
    env = engine_environment()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


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
    children: list[Child] = field(default_factory=list)
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


def pin_pair(p: EngineProcess, d: EngineProcess) -> None:
    """P's scheduler and worker on the first half of this process's cores, D's on the other half.

    Both P/D setups (NixlConnector's and ours) get this; the one-engine setups
    keep every core. In a deployment P and D have hardware of their own; on one
    small machine each engine would otherwise also pay for the other's
    busy-polling (EngineProcess.pin_engine_cpus)."""
    pin_apart([p, d], log)


def start_setup(
    name: str, model: Path, work: Path, start_timeout_s: float, kv_cache_bytes: int = KV_CACHE_BYTES
) -> Setup:
    """Start a setup's processes and wait until its client endpoint answers."""
    setup = Setup(name)
    try:
        if name in ("single", "nocache"):
            extra = ["--no-enable-prefix-caching"] if name == "nocache" else []
            engine = _engine(model, work, name, kv_cache_bytes=kv_cache_bytes, extra_args=extra).start()
            setup.engines = [engine]
            engine.wait_ready(timeout=start_timeout_s, progress=log)
            setup.url = engine.url
        elif name == "nixl":
            engines = []
            for role in ("P-nixl", "D-nixl"):
                env = _env_with_repo()
                env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
                env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
                env["VLLM_LOG_STATS_INTERVAL"] = "2"
                config = {
                    "kv_connector": "NixlConnector",
                    "kv_connector_module_path": "bench.harness.nixl_quiet",
                    "kv_role": "kv_both",
                    "kv_buffer_device": "cpu",
                    "engine_id": role,
                    "kv_connector_extra_config": {"bidirectional_kv_xfer": True},
                }
                engines.append(
                    _engine(
                        model,
                        work,
                        role,
                        kv_cache_bytes=kv_cache_bytes,
                        cls=LoggingStatsEngine,
                        kv_transfer_config=config,
                        env=env,
                    )
                )
            setup.engines = [e.start() for e in engines]
            for e in setup.engines:
                e.wait_ready(timeout=start_timeout_s, progress=log)
            p, d = setup.engines
            pin_pair(p, d)
            port = free_port()
            proxy = Child(
                "nixl-proxy",
                [
                    sys.executable,
                    "-m",
                    "bench.chats.nixl_proxy",
                    "--prefill",
                    p.url,
                    "--decode",
                    d.url,
                    "--port",
                    str(port),
                ],
                work / "nixl-proxy.log",
                env=_env_with_repo(),
            ).start()
            setup.children.append(proxy)
            setup.url = f"http://127.0.0.1:{port}"
            proxy.wait_http(setup.url + "/health")
            setup.direct = {"prefill": p.url, "decode": d.url}
        elif name in ("broker", "broker-local"):
            setup.broker = BrokerProcess(work).start()
            roles: tuple[tuple[str, str, dict[str, Any]], ...] = (
                ("P", "prefill", {}),
                ("D", "decode", {"multi_turn": True}),
            )
            for eng_name, role, role_extra in roles:
                stats = work / f"{eng_name}-stats.json"
                config = connector_config(
                    broker_address=setup.broker.address,
                    engine_id=eng_name,
                    role=role,
                    session_ttl_ms=5000,
                    resolve_wait_ms=RESOLVE_WAIT_MS,
                    acquire_wait_ms=ACQUIRE_WAIT_MS,
                    stats_path=str(stats),
                    **role_extra,
                )
                config["kv_load_failure_policy"] = "recompute"
                setup.engines.append(
                    _engine(
                        model, work, eng_name, kv_cache_bytes=kv_cache_bytes, kv_transfer_config=config
                    ).start()
                )
                setup.stats_paths[eng_name] = stats
            for e in setup.engines:
                e.wait_ready(timeout=start_timeout_s, progress=log)
            p, d = setup.engines
            pin_pair(p, d)
            port = free_port()
            proxy = Child(
                "proxy",
                [
                    sys.executable,
                    "-m",
                    "kvbroker.clients.proxy",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--prefill",
                    f"P={p.url}",
                    "--decode",
                    f"D={d.url}",
                    "--broker",
                    setup.broker.address,
                    # broker: every turn prefills on P (the pull path the targets judge);
                    # broker-local: the proxy's default, D serves a turn it holds but for a few tokens.
                    *(("--local-prefill-tokens", "0") if name == "broker" else ()),
                ],
                work / "proxy.log",
            ).start()
            setup.children.append(proxy)
            setup.url = f"http://127.0.0.1:{port}"
            proxy.wait_http(setup.url + "/health")
            setup.direct = {"prefill": p.url, "decode": d.url}
        else:
            raise ValueError(f"unknown setup {name!r}; one of {SETUPS}")
    except BaseException:
        setup.stop()
        raise
    return setup

"""Start and stop a real vLLM OpenAI server as a child process.

Used by tests, the demo, the local topology and the benchmarks: one place that
knows which flags and environment a vLLM engine needs on a small CPU machine
(float32, block size a multiple of 32, eager mode, one OpenMP thread, a small
KV cache) and how to wait for it and tear it down without leaving orphans.

The server runs in its own process group: vLLM forks an engine-core process
(and workers), and signalling the whole group is the only way to be sure none
survives. `kill9()` SIGKILLs the group, which is what "the engine died" means
in death tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbroker.common.telemetry import http_traces_url
from kvbroker.tools import doctor

DEFAULT_BLOCK_SIZE = 32
DEFAULT_MAX_MODEL_LEN = 4096
# 256 MiB of KV cache: thousands of blocks of the tiny model, small enough
# that several engines fit on a laptop.
DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024


# Pipeline parallel on vLLM 0.32's CPU backend: in eager mode with an explicit
# KV cache size the CPU worker skips its warm-up run, and that run is what
# allocates the buffer a later pipeline stage receives activations in; the
# first request then dies in sync_and_gather_intermediate_tensors
# (AssertionError). One Dynamo trace with the eager backend (no Inductor, a few
# seconds) brings the warm-up back. Use with enforce_eager=False.
PIPELINE_PARALLEL_CPU_ARGS = ("--compilation-config", '{"mode": 2, "backend": "eager"}')


class EngineStartError(RuntimeError):
    """The engine exited or did not become healthy in time; the message has its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def engine_environment(base: Mapping[str, str] | None = None, omp_threads: int = 1) -> dict[str, str]:
    """The environment for a CPU vLLM engine that shares a small machine.

    - one OpenMP thread and no core pinning: several engines share two cores,
      and vLLM's automatic binding would pin them all onto the same core;
    - PYTHONHASHSEED removed: with the default sha256 prefix hash vLLM uses a
      fixed seed, so every engine and the broker's hashing agree; a set
      PYTHONHASHSEED would silently change every block hash;
    - no usage statistics, no hub access (the model is local).
    """
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONHASHSEED", None)
    env.update(
        {
            "OMP_NUM_THREADS": str(omp_threads),
            "MKL_NUM_THREADS": str(omp_threads),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def connector_config(
    *,
    broker_address: str,
    engine_id: str,
    role: str,
    kv_recompute_threshold: int | None = None,
    cpu_tier_blocks: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """kv_transfer_config that loads our BrokerConnector into vLLM."""
    extra_config: dict[str, Any] = {"broker_address": broker_address, "engine_id": engine_id, "role": role}
    if kv_recompute_threshold is not None:
        extra_config["kv_recompute_threshold"] = kv_recompute_threshold
    if cpu_tier_blocks is not None:
        extra_config["cpu_tier_blocks"] = cpu_tier_blocks
    extra_config.update(extra)
    return {
        "kv_connector": "BrokerConnector",
        "kv_connector_module_path": "kvbroker.engine_adapter.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra_config,
    }


def vllm_otlp_traces_endpoint(env: Mapping[str, str]) -> str:
    """Where vLLM's own request spans go: the OTLP endpoint the engine's OTEL_* variables name.

    Empty when none is set or OTEL_TRACES_EXPORTER leaves OTLP out. vLLM hands
    the value to its exporter as the full URL, so with OTLP over HTTP a base
    endpoint gets its ``/v1/traces`` path.
    """
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if "otlp" not in exporters:
        return ""
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    )
    if base and protocol.strip().lower() == "http/protobuf":
        return http_traces_url(base)
    return base


# "1": one-rank engines run their model in the engine core's process (docs/adapter.md: the tests).
ONE_PROCESS_ENV = "KVBROKER_ENGINE_ONE_PROCESS"


def _one_rank(args: Sequence[str]) -> bool:
    """No parallel sizes above 1 and no executor named in the engine's own arguments."""
    sizes = ("tensor", "pipeline", "data")
    flags = {f"--{size}-parallel-size" for size in sizes} | {f"-{size[0]}p" for size in sizes}
    for arg, after in zip(args, [*args[1:], ""], strict=False):
        flag, eq, value = arg.partition("=")
        if flag in flags and (value if eq else after) != "1":
            return False
    return not any(a.startswith("--distributed-executor-backend") for a in args)


def _http_get_status(url: str, timeout: float) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError):
        return None


class EngineProcess:
    """One `python -m vllm.entrypoints.openai.api_server` child process.

    Use as a context manager (starts and waits for /health, stops on exit), or
    call `start()`, `wait_ready()` and `stop()` yourself.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        name: str = "engine",
        port: int | None = None,
        host: str = "127.0.0.1",
        kv_transfer_config: Mapping[str, Any] | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        served_model_name: str | None = None,
        extra_args: Sequence[str] = (),
        enforce_eager: bool = True,
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        python: str = sys.executable,
        log_stats: bool = False,
        one_process: bool | None = None,
    ) -> None:
        if block_size % 32 != 0:
            raise ValueError(f"block_size {block_size}: vLLM's CPU backend needs a multiple of 32")
        self.model_dir = Path(model_dir)
        self.name = name
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.kv_transfer_config = dict(kv_transfer_config) if kv_transfer_config else None
        self._publish_url()
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_cache_bytes = kv_cache_bytes
        self.served_model_name = served_model_name
        self.extra_args = list(extra_args)
        # False for pipeline parallel on CPU: see PIPELINE_PARALLEL_CPU_ARGS.
        self.enforce_eager = enforce_eager
        # vLLM's stats (and with them /metrics' engine and connector series) cost a little
        # every step; benchmarks and tests leave them off unless they read /metrics.
        self.log_stats = log_stats
        self.env = engine_environment() if env is None else dict(env)
        # None: as ONE_PROCESS_ENV says. vLLM's CPU build takes "uni" only with V1 multiprocessing off.
        wanted = os.environ.get(ONE_PROCESS_ENV) == "1" if one_process is None else one_process
        self.one_process_worker = wanted and _one_rank(self.extra_args)
        if self.one_process_worker:
            self.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if log_path is None:
            log_dir = Path(tempfile.mkdtemp(prefix="kvbroker-engine-"))
            log_path = log_dir / f"{name}.log"
        self.log_path = Path(log_path)
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    def _publish_url(self) -> None:
        """Give our connector this engine's URL (a broker label routers use), unless set."""
        cfg = self.kv_transfer_config
        if cfg is None or cfg.get("kv_connector") != "BrokerConnector":
            return
        extra = dict(cfg.get("kv_connector_extra_config") or {})
        extra.setdefault("url", self.url)
        cfg["kv_connector_extra_config"] = extra

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
        ]
        otlp = vllm_otlp_traces_endpoint(self.env)
        if otlp and "--otlp-traces-endpoint" in self.extra_args:
            otlp = ""
        # vLLM's request tracing reads each request's stats (its output processor
        # asserts they exist), so an engine that exports spans keeps stats on.
        if not self.log_stats and not otlp:
            cmd.append("--disable-log-stats")
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.one_process_worker:
            cmd += ["--distributed-executor-backend", "uni"]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        if otlp:
            cmd += ["--otlp-traces-endpoint", otlp]  # vLLM's own request spans join the traces
        return cmd + self.extra_args

    def start(self) -> EngineProcess:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already started (pid {self.proc.pid})")
        if Path(self.python).resolve() == Path(sys.executable).resolve():
            # A CUDA torch under vLLM's CPU build fails deep in vLLM's start-up; say why now.
            found = doctor.problems()
            if found:
                raise EngineStartError(f"{self.name}: cannot start vLLM here: " + " ".join(found))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it open; closed on stop
        log.write(f"$ {' '.join(self.command())}\n".encode())
        log.flush()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,  # own process group: stop() reaches engine core and workers
        )
        self._log_file = log
        return self

    def is_healthy(self, timeout: float = 2.0) -> bool:
        return _http_get_status(f"{self.url}/health", timeout) == 200

    def wait_ready(
        self,
        timeout: float = 240.0,
        progress: Callable[[str], None] | None = None,
        progress_every_s: float = 5.0,
    ) -> float:
        """Block until /health answers 200; returns seconds since start.

        Raises EngineStartError if the process exits or `timeout` passes; the
        message carries the end of the engine's log.
        """
        if self.proc is None or self.started_at is None:
            raise RuntimeError("start() first")
        deadline = self.started_at + timeout
        next_progress = time.monotonic() + progress_every_s
        while True:
            if self.proc.poll() is not None:
                raise EngineStartError(
                    f"{self.name} exited with code {self.proc.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.is_healthy():
                self.ready_after_s = time.monotonic() - self.started_at
                if progress:
                    progress(f"{self.name} ready at {self.url} after {self.ready_after_s:.1f} s")
                return self.ready_after_s
            now = time.monotonic()
            if now > deadline:
                tail = self.log_tail()
                self.stop()
                raise EngineStartError(
                    f"{self.name} not healthy after {timeout:.0f} s; log {self.log_path}:\n{tail}"
                )
            if progress and now >= next_progress:
                next_progress = now + progress_every_s
                last = self.log_tail(1).strip()
                progress(f"{self.name} starting... {now - self.started_at:.0f} s  | {last[-100:]}")
            time.sleep(0.5)

    def log_tail(self, lines: int | None = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text if lines is None else "\n".join(text.splitlines()[-lines:])  # None: the whole log

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def group_alive(self) -> bool:
        """True while any live (non-zombie) process of the engine's group remains."""
        if self.proc is None:
            return False
        pgid = self.proc.pid
        proc_root = Path("/proc")
        if not proc_root.is_dir():  # not Linux: ask the kernel about the group as a whole
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return False
            return True
        return any(state != "Z" for _, _, state in self._group_processes())

    def _group_processes(self) -> list[tuple[int, str, str]]:
        """(pid, command name, state) of every process in the engine's group (Linux /proc)."""
        if self.proc is None:
            return []
        out = []
        for stat_file in Path("/proc").glob("[0-9]*/stat"):
            try:
                head, _, tail = stat_file.read_text().rpartition(")")
                # Fields after the parenthesised command name: state ppid pgrp ...
                fields = tail.split()
                if int(fields[2]) == self.proc.pid:
                    out.append((int(stat_file.parent.name), head.partition("(")[2], fields[0]))
            except (OSError, IndexError, ValueError):
                continue
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, s) used so far by each live process of the engine's group,
        keyed "name[pid]" (Linux /proc; empty elsewhere)."""
        if self.proc is None:
            return {}
        tick = os.sysconf("SC_CLK_TCK")
        out: dict[str, float] = {}
        for pid, name, _state in self._group_processes():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                # utime and stime are fields 14 and 15 of stat; 12 and 13 after the name.
                out[f"{name}[{pid}]"] = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                continue
        return out

    def deprioritize_workers(self, niceness: int = 10) -> int:
        """Lower the CPU priority of the engine's worker processes; returns how many.

        vLLM's workers busy-poll their message queue for a second after every
        message. On a small shared machine (several multi-rank engines on two
        cores) that starves everything else: the engine's own scheduler, its
        broker session's heartbeats, the broker. Nice workers spin only on what
        is left over. Every thread is reniced: on Linux a niceness belongs to a
        thread, and a worker's OpenMP threads (which spin after each parallel
        region) would keep the old one. Linux only; elsewhere it does nothing."""
        return self._each_thread(
            ("VLLM::Worker",), lambda tid: os.setpriority(os.PRIO_PROCESS, tid, niceness)
        )

    def pin_engine_cpus(self, cpus: set[int]) -> int:
        """Pin the engine's scheduler and worker processes (every thread) to ``cpus``; returns how
        many (one where the engine core runs the model: ``one_process_worker``).

        Disaggregated P and D run on hardware of their own. Sharing one small
        machine, each engine's worker computes while the other engine's worker
        and scheduler busy-poll vLLM's message queues (for a second after every
        message; a one-process engine has no such queue between them), so every
        step of one engine also pays for the other's polling.
        Giving each engine its own cores is the small-machine analogue of its own
        GPU; the API server stays unpinned. Linux only; elsewhere it does nothing."""
        return self._each_thread(
            ("VLLM::Worker", "VLLM::EngineCor"), lambda tid: os.sched_setaffinity(tid, cpus)
        )

    def _each_thread(self, names: tuple[str, ...], apply: Callable[[int], None]) -> int:
        """Call ``apply`` on every thread of the group's live processes named ``names*``; returns how many
        processes. A thread that is gone (or refuses) is skipped."""
        count = 0
        for pid, name, state in self._group_processes():
            if not name.startswith(names) or state == "Z":
                continue
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                tids = [pid]
            for tid in tids:
                with contextlib.suppress(OSError):
                    apply(tid)
            count += 1
        return count

    def _wait_group_gone(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                # A killed engine can still take a while to exit on a loaded machine
                # (unmapping gigabytes); never let a slow exit fail the caller's clean-up.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=60)
        # Children (engine core, workers) may outlive the API server for a moment.
        self._signal_group(signal.SIGKILL)
        self._wait_group_gone(30.0)
        self._close_log()
        return self.proc.returncode

    def kill9(self) -> None:
        """SIGKILL the whole engine at once (API server, engine core, workers): a crash."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._wait_group_gone(10.0)
        self._close_log()

    def _close_log(self) -> None:
        log = getattr(self, "_log_file", None)
        if log is not None and not log.closed:
            log.close()

    def __enter__(self) -> EngineProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EngineProcess({self.name!r}, url={self.url!r}, pid={self.pid})"


def pin_apart(engines: Sequence[EngineProcess], say: Callable[[str], None] | None = None) -> list[list[int]]:
    """Each engine's scheduler and worker on cores of its own: this process's cores split evenly.

    What a P/D pair on one small machine needs to behave like one on hardware of
    its own (EngineProcess.pin_engine_cpus). With fewer cores than engines it
    pins nothing and returns []; otherwise the cores given to each engine (the
    last one takes what an uneven split leaves)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < len(engines) or not engines:
        return []
    share = len(cpus) // len(engines)
    out = []
    for i, engine in enumerate(engines):
        mine = cpus[i * share :] if i == len(engines) - 1 else cpus[i * share : (i + 1) * share]
        n = engine.pin_engine_cpus(set(mine))
        if say is not None:
            say(f"{engine.name}: scheduler and worker pinned to cores {mine} ({n} processes)")
        out.append(mine)
    return out

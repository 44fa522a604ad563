"""Child processes: one class for every helper process the demo, the tests and the benchmarks start.

`ChildProcess` runs a command in its own process group (so a stop reaches its
children too) with its output in a log file, and knows three ways to tell it
is up: a line in its log, a port that accepts, an HTTP URL that answers 200.
`ProxyProcess` is the P/D proxy (`python -m kvbroker.clients.proxy`) on one.
The demo's stack uses these; testkit.processes adds the broker and re-exports
both for tests/ and bench/ (vLLM engines have their own, EngineProcess in
kvbroker.tools.launch, which knows vLLM's start-up and threads).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from kvbroker.tools.launch import free_port

# How long a child asked for its stacks (SIGABRT, answered by faulthandler) gets to write them.
STACKS_WAIT_S = 5.0
# A SIGKILLed child is gone at once on a quiet host; on a starved one (a CI machine of two cores
# shared with vLLM engines) the kernel took more than 10 s to let it die and be reaped.
KILLED_WAIT_S = 60.0


class ChildProcess:
    """`argv` as a child in its own process group, stdout and stderr appended to `log_path`.

    `env` replaces the environment (None: inherit), `cwd` the working folder,
    `priority` is set on the child where this user may (None: leave it),
    `fresh_log` truncates the log at each start. `start()` may be called again
    after the child exited or was stopped (a restart in place). A Python child
    runs with faulthandler on (PYTHONFAULTHANDLER), so a crash or `abort()`
    leaves every thread's stack in its log.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        priority: int | None = None,
        fresh_log: bool = False,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.priority = priority
        self.fresh_log = fresh_log
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The running (or last) child; only after `start()`."""
        assert self._proc is not None, f"{self.name} was not started"
        return self._proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status of the last child (None: running, or never started)."""
        return self._proc.poll() if self._proc is not None else None

    def start(self) -> ChildProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONFAULTHANDLER", "1")
        with open(self.log_path, "wb" if self.fresh_log else "ab") as log:  # the child keeps its own
            self._log_offset = log.tell()
            self._proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(self.cwd) if self.cwd is not None else None,
                start_new_session=True,
            )
        if self.priority is not None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self.pid, self.priority)
        return self

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _up_or_raise(self, what: str) -> None:
        if not self.alive():
            raise RuntimeError(f"{self.name} exited ({self.returncode}) before {what}:\n{self.log_tail()}")

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float, interval: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            self._up_or_raise(what)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no {what} within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(interval)

    def wait_line(self, line: bytes, timeout: float = 30.0) -> None:
        """Until `line` appears in what this start wrote to the log."""

        def written() -> bool:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                return line in log.read()

        self._wait(written, repr(line.decode(errors="replace")), timeout, 0.05)

    def wait_port(self, port: int, timeout: float = 60.0, host: str = "127.0.0.1") -> None:
        """Until `host:port` accepts a connection."""

        def accepts() -> bool:
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
                return True
            return False

        self._wait(accepts, f"listener on {host}:{port}", timeout, 0.05)

    def wait_http(self, url: str, timeout: float = 30.0) -> None:
        """Until `url` answers 200."""

        def answers() -> bool:
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(url, timeout=2) as r,
            ):
                return bool(r.status == 200)
            return False

        self._wait(answers, f"answer from {url}", timeout, 0.2)

    def kill9(self) -> None:
        """SIGKILL to the whole group: the child dies without a word to anyone."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(KILLED_WAIT_S)

    def state(self) -> str:
        """What the kernel says of the child and its host (Linux /proc), for an error about a child
        that says nothing: stopped (T) or running, its CPU time, its major page faults (a starved
        or swapping host), its memory; "" where /proc has nothing."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
            load = Path("/proc/loadavg").read_text().split()[:3]
            meminfo = Path("/proc/meminfo").read_text()
        except (OSError, IndexError):
            return ""
        tick = os.sysconf("SC_CLK_TCK")
        rss = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")), "?")
        free = next(
            (line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:")), "0"
        )
        return (
            f"state {stat[0]}, {(int(stat[11]) + int(stat[12])) / tick:.2f} s of CPU, "
            f"{int(stat[9]):,} major page faults, {int(rss) // 1024 if rss.isdigit() else rss} MiB resident; "
            f"host load {' '.join(load)}, {int(free) / (1 << 20):.1f} GiB available"
        )

    def abort(self) -> str:
        """Stop a child that hangs, asking it first where: SIGABRT to the child alone (a Python
        child's faulthandler writes every thread's stack to the log), then SIGKILL to the group.
        Returns the log's tail, with those stacks; "" when the child had already exited."""
        if not self.alive():
            return ""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STACKS_WAIT_S)
        self.kill9()
        return self.log_tail(80)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the group, then SIGKILL after `grace_s`."""
        if not self.alive():
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill9()
        except ProcessLookupError:
            pass

    close = stop

    def __enter__(self) -> ChildProcess:
        # `with child.start():` must not start a second child over the first (which then outlives
        # the block, unstopped): a child already running is entered as it is.
        return self if self.alive() else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, pid={self._proc.pid if self._proc else None})"


def engine_args(role: str, engines: Iterable[tuple[str, str]] | Mapping[str, str]) -> list[str]:
    """`--prefill NAME=URL ...` (role "prefill", "decode" or "engine") for the proxy's command line."""
    pairs = engines.items() if isinstance(engines, Mapping) else engines
    return [arg for name, url in pairs for arg in (f"--{role}", f"{name}={url}")]


class ProxyProcess(ChildProcess):
    """The P/D proxy, `python -m kvbroker.clients.proxy`, on 127.0.0.1 (a free port by default).

    `prefill`, `decode` and `engines` map engine names to URLs; `broker` is the
    broker's address (or a comma-separated list of replicas);
    `local_prefill_tokens` None keeps the proxy's default (D serves a turn it
    holds but for a few tokens), 0 prefills every turn on P; `extra_args` go
    on the command line as given. `start()` returns once /health answers.
    """

    def __init__(
        self,
        log_path: Path,
        *,
        prefill: Mapping[str, str] = {},
        decode: Mapping[str, str] = {},
        engines: Mapping[str, str] = {},
        broker: str = "",
        local_prefill_tokens: int | None = None,
        extra_args: Sequence[str] = (),
        port: int | None = None,
        name: str = "proxy",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-m",
            "kvbroker.clients.proxy",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        argv += (
            engine_args("prefill", prefill) + engine_args("decode", decode) + engine_args("engine", engines)
        )
        if broker:
            argv += ["--broker", broker]
        if local_prefill_tokens is not None:
            argv += ["--local-prefill-tokens", str(local_prefill_tokens)]
        super().__init__(name, [*argv, *extra_args], log_path, env=env)

    def start(self, timeout: float = 30.0) -> ProxyProcess:
        super().start()
        try:
            self.wait_http(self.url + "/health", timeout)
        except BaseException:
            self.stop()
            raise
        return self

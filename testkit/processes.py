"""The broker as a child process, for the process-level and end-to-end tests and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from testkit.ports import free_port

# `python -m kvbroker.broker`; the process tests run `kvbroker serve` instead (SERVE).
BROKER_MODULE = ("-m", "kvbroker.broker")
SERVE = ("-m", "kvbroker.tools.cli", "serve")
READY_LINE = b"kvbroker listening on"
# As docs/broker.md advises on a host shared with engines: the broker before the
# engines' busy-polling workers (where this user may raise priority).
ENGINE_HOST_PRIORITY = -5


class BrokerProcess:
    """The broker on 127.0.0.1 as a child in its own process group, its output in a log file.

    `port` defaults to a free one; keep it to restart a broker in place (a new
    `BrokerProcess` on the same port and log, or `start()` again after `stop()`).
    `extra_args` go on the command line; `priority` is set on the child where
    this user may (None: leave it). `start()` returns once the broker says it
    listens, and raises with the log's tail if it exits first or takes longer
    than `timeout`.
    """

    def __init__(
        self,
        log_dir: Path,
        extra_args: Sequence[str] = (),
        *,
        port: int | None = None,
        log_name: str = "broker.log",
        command: Sequence[str] = BROKER_MODULE,
        log_level: str | None = "info",
        priority: int | None = ENGINE_HOST_PRIORITY,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_dir / log_name
        self.argv = [sys.executable, *command, "--address", self.address]
        if log_level is not None:
            self.argv += ["--log-level", log_level]
        self.argv += list(extra_args)
        self.priority = priority
        self.env = dict(env) if env is not None else None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The running (or last) child; only after `start()`."""
        assert self._proc is not None, "the broker process was not started"
        return self._proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            offset = log.tell()
            self._proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        if self.priority is not None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self.pid, self.priority)
        deadline = time.monotonic() + timeout
        while READY_LINE not in self._log_since(offset):
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill9()
                raise RuntimeError(f"broker did not start in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    def _log_since(self, offset: int) -> bytes:
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return log.read()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL: the broker dies without a word to anyone."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill9()

    close = stop

    def __enter__(self) -> BrokerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""The one launcher of child processes for tests/ and bench/: the broker, the P/D proxy, any helper.

    ChildProcess   a command in its own process group, logging to a file; waits for a log
                   line, a port or an HTTP answer; stop() / kill9()   (kvbroker.tools.children)
    ProxyProcess   `python -m kvbroker.clients.proxy` on a free port   (kvbroker.tools.children)
    BrokerProcess  `python -m kvbroker.broker` (or `kvbroker serve`) on a free port
    python_env()   this environment with the source tree first on PYTHONPATH, for children
                   that run `python -m bench.*` or `python -m testkit.*`
    with_low_soft_limit(), soft_open_files()   a server started under a low soft limit of open
                   files, and a process's limit as the kernel has it

vLLM engines are started by testkit.engines (kvbroker.tools.launch.EngineProcess).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from kvbroker.tools.children import ChildProcess, ProxyProcess
from testkit.ports import free_port

__all__ = [
    "LOW_SOFT_OPEN_FILES",
    "REPO_ROOT",
    "BrokerProcess",
    "ChildProcess",
    "ProxyProcess",
    "python_env",
    "soft_open_files",
    "with_low_soft_limit",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
# `python -m kvbroker.broker`; the process tests run `kvbroker serve` instead (SERVE).
BROKER_MODULE = ("-m", "kvbroker.broker")
SERVE = ("-m", "kvbroker.tools.cli", "serve")
READY_LINE = b"kvbroker listening on"
# A broker is up in under a second on a quiet host; a CI machine of two cores shared with busy
# engines once left one silent for 30 s (the timeout then dumps its stacks to say where it hung).
START_TIMEOUT_S = 60.0
# As docs/broker.md advises on a host shared with engines: the broker before the
# engines' busy-polling workers (where this user may raise priority).
ENGINE_HOST_PRIORITY = -5


def python_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the source tree first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """Process `pid` frozen with SIGSTOP (a hung store or node: no reset, no answer) for the
    block, and continued with SIGCONT after it, whatever the block raised."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


# A server started as many systems start programs: a low soft limit of open files (256 here, the
# failure of 1,024 at a quarter of the connections) under the hard limit this machine has.
LOW_SOFT_OPEN_FILES = 256
_WITH_LOW_SOFT_LIMIT = """
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
sys.argv = [{module!r}, *sys.argv[1:]]
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


def with_low_soft_limit(module: str) -> tuple[str, str]:
    """The interpreter arguments that run `python -m MODULE` under LOW_SOFT_OPEN_FILES."""
    return ("-c", _WITH_LOW_SOFT_LIMIT.format(soft=LOW_SOFT_OPEN_FILES, module=module))


def soft_open_files(pid: int) -> int:
    """Process `pid`'s soft limit of open files, as the kernel has it now (Linux)."""
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    return int(line.split()[3])


class BrokerProcess(ChildProcess):
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
        argv = [*command, "--address", self.address]
        if log_level is not None:
            argv += ["--log-level", log_level]
        super().__init__(
            "broker",
            [sys.executable, *argv, *extra_args],
            log_dir / log_name,
            env=env,
            priority=priority,
        )

    def start(self, timeout: float = START_TIMEOUT_S, attempts: int = 2) -> BrokerProcess:
        """Start, and return once the broker says it listens. A broker alive but silent past
        `timeout` is aborted with its stacks and its state and started again, up to `attempts`
        times in all: a busy CI machine twice left one silent for the whole timeout, stuck in
        its imports. A broker that exits is not started again: its log says why."""
        silent: list[str] = []
        for _ in range(attempts):
            super().start()
            try:
                self.wait_line(READY_LINE, timeout)
            except RuntimeError as err:
                state = self.state()  # before the abort: is it stopped, starved, swapping?
                stacks = self.abort()
                if not stacks:  # it exited on its own
                    raise
                silent.append(f"{err}\nits state: {state}\nits stacks (SIGABRT):\n{stacks}")
                continue
            if silent:
                print(
                    f"{self.name}: up at attempt {len(silent) + 1}, after:\n" + "\n".join(silent),
                    file=sys.stderr,
                )
            return self
        raise RuntimeError(
            "".join(f"\n--- attempt {i} of {attempts} ---\n{text}" for i, text in enumerate(silent, 1))
        )

"""A real redis-server (Debian's binary) on a free loopback port, for tests and benchmarks.

Nothing is persisted (no RDB, no AOF). `REDIS_SERVER` names another binary
(valkey-server works the same). `missing_reason()` says why none can run, so
a test can skip with that reason instead of failing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from testkit.ports import free_port
from testkit.processes import ChildProcess
from testkit.waiting import wait_for


def server_binary() -> str | None:
    return os.environ.get("REDIS_SERVER") or shutil.which("redis-server") or shutil.which("valkey-server")


def missing_reason() -> str:
    """Empty when a server can run, else why not (for pytest.skip)."""
    if server_binary() is None:
        return "no redis-server or valkey-server on PATH (make test installs Debian's redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis client library is missing: pip install '.[redis]'"
    return ""


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = workdir
        self.child: ChildProcess | None = None
        # Free ports picked here are picked again if one is taken before the first start binds it
        # (never on a restart in place: its callers know the old port).
        self._ports_chosen = port is None

    def renew_ports(self) -> None:
        """New free ports (a free port can be taken by another process before the server binds it)."""
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The running redis-server (None: not started, or stopped)."""
        return self.child.proc if self.child is not None else None

    def start(self, timeout: float = 10.0) -> None:
        for attempt in range(3):
            try:
                self._start(timeout)
                self._ports_chosen = False
                return
            except RuntimeError:
                log = self.workdir / f"redis-{self.port}.log"
                taken = log.exists() and "Address already in use" in log.read_text(errors="replace")
                if not (taken and self._ports_chosen) or attempt == 2:
                    raise
                self.renew_ports()

    def _start(self, timeout: float) -> None:
        binary = server_binary()
        if binary is None:
            raise RuntimeError(missing_reason())
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.workdir), *self.extra_args()]
        self.child = ChildProcess("redis-server", argv, self.workdir / f"redis-{self.port}.log").start()
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis(
            port=self.port,
            socket_connect_timeout=0.2,
            socket_timeout=1.0,
            retry=Retry(NoBackoff(), 0),  # each probe once: wait_for is the retry
            **self.client_options(),
        )

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:  # refused, or another process that took the port not answering
                return False

        child = self.child
        try:
            if (
                not wait_for(lambda: not child.alive() or answers(), timeout)
                or not child.alive()
                or not answers()
            ):
                raise RuntimeError(f"redis-server did not start; see {self.workdir}")
        finally:
            client.close()

    def extra_args(self) -> list[str]:
        """More redis-server arguments (a subclass's, e.g. a Cluster node's)."""
        return []

    def client_options(self) -> dict[str, Any]:
        """What a client needs besides the port (a TLS server's: certificates)."""
        return {}

    def stop(self) -> None:
        if self.child is not None:
            self.child.kill9()
        self.child = None


@contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()

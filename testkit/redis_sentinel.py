"""A Sentinel-managed Redis for tests and benchmarks: a primary, a replica of it, and one Sentinel.

All three are the installed ``redis-server`` (the Sentinel runs it with
``--sentinel`` and a config file of its own, which it rewrites as it learns the
topology). The Sentinel marks the primary down after ``DOWN_AFTER_MS`` without
an answer and promotes the replica (quorum 1); ``url`` is what
``kvbroker serve --state`` takes. Nothing is persisted.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from testkit.ports import free_port
from testkit.redis_server import RedisServer, server_binary

SERVICE = "kvbstore"
DOWN_AFTER_MS = 1000


class _Replica(RedisServer):
    def __init__(self, workdir: Path, primary_port: int) -> None:
        super().__init__(workdir)
        self.primary_port = primary_port

    def extra_args(self) -> list[str]:
        return ["--replicaof", "127.0.0.1", str(self.primary_port)]


class RedisSentinel:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.primary = RedisServer(workdir / "primary")
        self.replica = _Replica(workdir / "replica", self.primary.port)
        self.sentinel_port = free_port()
        self.sentinel: subprocess.Popen[bytes] | None = None
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}"

    def start(self, timeout: float = 20.0) -> RedisSentinel:
        import redis

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.primary.start()
        self.replica.start()
        conf = self.workdir / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
        )
        binary = server_binary()
        assert binary is not None
        log = open(self.workdir / "sentinel.log", "ab")  # noqa: SIM115 (the child owns it)
        self.sentinel = subprocess.Popen(
            [binary, str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        deadline = time.monotonic() + timeout
        sentinel = redis.Redis(port=self.sentinel_port, socket_connect_timeout=0.2, decode_responses=True)
        replica = redis.Redis(port=self.replica.port, socket_connect_timeout=0.2, decode_responses=True)
        while True:  # the Sentinel knows the primary and the replica is in sync
            try:
                known = sentinel.execute_command("SENTINEL", "REPLICAS", SERVICE)
                link = replica.info("replication").get("master_link_status")
                if known and link == "up":
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Sentinel setup did not come up; see {self.workdir}")
            time.sleep(0.1)
        sentinel.close()
        replica.close()
        return self

    def primary_port(self) -> int:
        """The port of the primary the Sentinel names now."""
        import redis

        sentinel = redis.Redis(port=self.sentinel_port, decode_responses=True)
        try:
            answer = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            if not answer:
                raise RuntimeError(
                    f"the Sentinel on port {self.sentinel_port} names no primary for {SERVICE}"
                )
            return int(answer[1])
        finally:
            sentinel.close()

    def stop(self) -> None:
        if self.sentinel is not None and self.sentinel.poll() is None:
            self.sentinel.kill()
            self.sentinel.wait(10)
        self.replica.stop()
        self.primary.stop()


@contextmanager
def running_sentinel(workdir: Path) -> Iterator[RedisSentinel]:
    setup = RedisSentinel(workdir)
    try:
        yield setup.start()
    finally:
        setup.stop()

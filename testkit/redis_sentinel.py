"""A Sentinel-managed Redis for tests and benchmarks: a primary, a replica of it, and one Sentinel.

All three are the installed ``redis-server`` (the Sentinel runs it with
``--sentinel`` and a config file of its own, which it rewrites as it learns the
topology). The Sentinel marks the primary down after ``DOWN_AFTER_MS`` without
an answer and promotes the replica (quorum 1); ``url`` is what
``kvbroker serve --state`` takes. Nothing is persisted.

``tls=True``: every one of the three speaks TLS only (no plain port), requires a
client certificate (``tls-auth-clients yes``) and replicates and monitors over TLS;
``url`` is then ``rediss+sentinel://...?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...``
with a client certificate of a test CA (``testkit/certs.py``).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from testkit.ports import free_port
from testkit.redis_server import RedisServer, server_binary

SERVICE = "kvbstore"
DOWN_AFTER_MS = 1000


class _Tls:
    """A test CA, a server certificate (127.0.0.1) for every server, and a client certificate that
    the servers use for their own connections (replication, the Sentinel's) and clients for theirs."""

    def __init__(self, directory: Path) -> None:
        from testkit.certs import CertificateAuthority

        ca = CertificateAuthority.create(directory)
        self.ca, self.server, self.client = (
            ca.cert,
            ca.server("redis"),
            ca.client("kvbroker", "kvbroker://t/redis"),
        )

    def config(self, port: int) -> list[str]:
        """redis-server directives (name, value) for a TLS-only server on `port`."""
        return [
            "port", "0", "tls-port", str(port),
            "tls-cert-file", str(self.server.cert), "tls-key-file", str(self.server.key),
            "tls-client-cert-file", str(self.client.cert), "tls-client-key-file", str(self.client.key),
            "tls-ca-cert-file", str(self.ca), "tls-auth-clients", "yes", "tls-replication", "yes",
        ]  # fmt: skip

    def options(self) -> dict[str, Any]:
        """redis-py's options for a client of these servers."""
        return {
            "ssl": True,
            "ssl_ca_certs": str(self.ca),
            "ssl_certfile": str(self.client.cert),
            "ssl_keyfile": str(self.client.key),
        }


class _Server(RedisServer):
    def __init__(self, workdir: Path, tls: _Tls | None, primary_port: int = 0) -> None:
        super().__init__(workdir)
        self.tls = tls
        self.primary_port = primary_port

    def extra_args(self) -> list[str]:
        args = ["--replicaof", "127.0.0.1", str(self.primary_port)] if self.primary_port else []
        if self.tls is not None:
            pairs = self.tls.config(self.port)
            args += [f"--{a}" if i % 2 == 0 else a for i, a in enumerate(pairs)]
        return args

    def client_options(self) -> dict[str, Any]:
        return self.tls.options() if self.tls is not None else {}


class RedisSentinel:
    def __init__(self, workdir: Path, tls: bool = False) -> None:
        self.workdir = workdir
        self.tls = _Tls(workdir / "pki") if tls else None
        self.primary = _Server(workdir / "primary", self.tls)
        self.replica = _Server(workdir / "replica", self.tls, self.primary.port)
        self.sentinel_port = free_port()
        self.sentinel: subprocess.Popen[bytes] | None = None
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}"
        self.client_options: dict[str, Any] = {}
        if self.tls is not None:
            self.client_options = self.tls.options()
            query = urlencode({k: v for k, v in self.client_options.items() if k != "ssl"})
            self.url = f"rediss+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}?{query}"

    def start(self, timeout: float = 20.0) -> RedisSentinel:
        import redis

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.primary.start()
        self.replica.primary_port = self.primary.port  # its port may have been picked again
        self.replica.start()
        conf = self.workdir / "sentinel.conf"
        tls = (
            self.tls.config(self.sentinel_port) if self.tls is not None else ["port", str(self.sentinel_port)]
        )
        conf.write_text(
            "".join(f"{name} {value}\n" for name, value in zip(tls[::2], tls[1::2], strict=True))
            + f"bind 127.0.0.1\ndir {self.workdir}\n"
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
        options = {"socket_connect_timeout": 0.2, "decode_responses": True, **self.client_options}
        sentinel = redis.Redis(port=self.sentinel_port, **options)
        replica = redis.Redis(port=self.replica.port, **options)
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

        sentinel = redis.Redis(port=self.sentinel_port, decode_responses=True, **self.client_options)
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
def running_sentinel(workdir: Path, tls: bool = False) -> Iterator[RedisSentinel]:
    setup = RedisSentinel(workdir, tls)
    try:
        yield setup.start()
    finally:
        setup.stop()

"""The alternatives a user would pick instead of the broker, each started by the benchmark itself.

- Redis (Debian's ``redis-server`` on a free loopback port; redis-py with hiredis):
  lookup of a 64-block chain with MGET (longest prefix computed by the client) and
  with a server-side Lua chain walk (the server returns the prefix length);
  publishing a chain with a pipeline of 64 ``SET key value PX ttl``.
- Mooncake master (``mooncake_master`` from ``mooncake-transfer-engine-non-cuda``, its
  Python client ``MooncakeDistributedStore``): ``batch_is_exist`` of the 64 keys.
- grpc.aio floors (bench/control_plane/grpc_echo.py): unary echo of 64 x fixed64, and one bidi
  stream ping-pong per client.

A peer that cannot run here raises ``PeerUnavailable`` with the reason; the
benchmarks print it and go on without that peer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.control_plane.chains import longest_prefix
from bench.harness.loops import rss_bytes
from testkit.ports import free_port
from testkit.processes import REPO_ROOT, ChildProcess, python_env


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Send this process's fd 2 to a file for a while (native libraries log there, around Python)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class PeerUnavailable(RuntimeError):
    """The peer cannot run on this machine; the message says why."""


def chain_keys(ns: str, chain: Sequence[int]) -> list[str]:
    """The key of each block of a chain in a key-value store: namespace plus the 64-bit hash in hex."""
    return [f"{ns}:{h:016x}" for h in chain]


# --------------------------------------------------------------------------- Redis

# Longest held prefix of KEYS, walked on the server: stops at the first missing block.
REDIS_CHAIN_WALK_LUA = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return i - 1 end
end
return #KEYS
"""


class RedisPeer:
    """A private redis-server on a free loopback port, with persistence off."""

    def __init__(self, log_dir: Path):
        exe = shutil.which("redis-server")
        if exe is None:
            raise PeerUnavailable(
                "redis-server is not on PATH (install Debian's package: apt-get install redis-server)"
            )
        try:
            import redis
            import redis.utils
        except ImportError as e:
            raise PeerUnavailable(f"redis-py is not installed ({e}); pip install redis hiredis") from e
        self.hiredis = bool(redis.utils.HIREDIS_AVAILABLE)
        self._redis = redis
        self.port = free_port()
        self._dir = tempfile.mkdtemp(prefix="bench-redis-")
        self.proc = ChildProcess(
            "redis-server",
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir,
                "--daemonize",
                "no",
            ],
            log_dir / "redis-server.log",
            cwd=REPO_ROOT,
            fresh_log=True,
        ).start()
        self.proc.wait_port(self.port, 20)
        self.version = self.client().info("server").get("redis_version", "?")
        self._lua_sha = self.client().script_load(REDIS_CHAIN_WALK_LUA)

    def client(self) -> Any:
        return self._redis.Redis(host="127.0.0.1", port=self.port)

    def aclient(self) -> Any:
        """An asyncio client (redis.asyncio, hiredis parser when installed); create it inside the loop."""
        import redis.asyncio

        return redis.asyncio.Redis(host="127.0.0.1", port=self.port)

    def flush(self) -> None:
        self.client().flushall()

    def used_memory(self) -> int:
        return int(self.client().info("memory")["used_memory"])

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def publish_chain(self, r: Any, keys: Sequence[str], value: bytes, ttl_ms: int) -> None:
        p = r.pipeline(transaction=False)
        for k in keys:
            p.set(k, value, px=ttl_ms)
        p.execute()

    def mget_prefix(self, r: Any, keys: Sequence[str]) -> int:
        return longest_prefix(r.mget(keys))

    def lua_prefix(self, r: Any, keys: Sequence[str]) -> int:
        return int(r.evalsha(self._lua_sha, len(keys), *keys))

    async def publish_chain_async(self, r: Any, keys: Sequence[str], value: bytes, ttl_ms: int) -> None:
        p = r.pipeline(transaction=False)
        for k in keys:
            p.set(k, value, px=ttl_ms)
        await p.execute()

    async def mget_prefix_async(self, r: Any, keys: Sequence[str]) -> int:
        return longest_prefix(await r.mget(keys))

    async def lua_prefix_async(self, r: Any, keys: Sequence[str]) -> int:
        return int(await r.evalsha(self._lua_sha, len(keys), *keys))

    def bulk_load(self, keys_iter: Any, value: bytes, ttl_ms: int, batch: int = 2000) -> int:
        """Load keys with big pipelines (for the memory figure); returns how many."""
        r = self.client()
        n = 0
        p = r.pipeline(transaction=False)
        for k in keys_iter:
            p.set(k, value, px=ttl_ms)
            n += 1
            if n % batch == 0:
                p.execute()
        p.execute()
        return n

    def close(self) -> None:
        self.proc.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


# --------------------------------------------------------------------------- Mooncake


class MooncakePeer:
    """A private mooncake_master (with its embedded HTTP metadata server) and one in-process client."""

    def __init__(self, log_dir: Path, segment_mib: int = 256):
        try:
            # An optional peer to compare with: where it is not installed, the benchmark says so.
            import mooncake  # pyright: ignore[reportMissingImports]
            from mooncake.store import MooncakeDistributedStore  # pyright: ignore[reportMissingImports]
        except ImportError as e:
            raise PeerUnavailable(
                f"Mooncake's Python client does not import ({e}); "
                "pip install mooncake-transfer-engine-non-cuda (needs libibverbs1 from apt)"
            ) from e
        self._client_log = log_dir / "mooncake_client.log"
        binary = Path(mooncake.__file__ or ".").parent / "mooncake_master"
        if not binary.exists():
            raise PeerUnavailable(f"mooncake_master binary not found at {binary}")
        self.rpc_port, self.meta_port, self.metrics_port = free_port(), free_port(), free_port()
        self.proc = ChildProcess(
            "mooncake_master",
            [
                sys.executable,
                "-c",
                "from mooncake.cli import main; main()",
                f"--rpc_port={self.rpc_port}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.meta_port}",
                f"--metrics_port={self.metrics_port}",
                "--metrics_host=127.0.0.1",
                "--enable_metric_reporting=false",
                # Objects in this benchmark are index entries, not leased data: keep them.
                "--default_kv_lease_ttl=600000",
            ],
            log_dir / "mooncake_master.log",
            cwd=REPO_ROOT,
            fresh_log=True,
        ).start()
        try:
            self.proc.wait_port(self.rpc_port, 30)
            self.proc.wait_port(self.meta_port, 10)
        except RuntimeError as e:
            self.proc.stop()
            raise PeerUnavailable(f"mooncake_master did not start: {e}") from e
        self.store = MooncakeDistributedStore()
        with stderr_to(log_dir / "mooncake_client.log"):
            rc = self.store.setup(
                "127.0.0.1",
                f"http://127.0.0.1:{self.meta_port}/metadata",
                segment_mib << 20,
                16 << 20,
                "tcp",
                "",
                f"127.0.0.1:{self.rpc_port}",
            )
        if rc != 0:
            self.proc.stop()
            raise PeerUnavailable(f"Mooncake client setup failed with code {rc}")

    def put_keys(self, keys: Sequence[str], value: bytes = b"1", batch: int = 256) -> None:
        """Store a tiny object under each key so that batch_is_exist finds it."""
        for i in range(0, len(keys), batch):
            part = list(keys[i : i + batch])
            rc = self.store.put_batch(part, [value] * len(part))
            if rc != 0:
                raise RuntimeError(f"Mooncake put_batch failed with code {rc}")

    def exist_prefix(self, keys: list[str]) -> int:
        return longest_prefix([x == 1 for x in self.store.batch_is_exist(keys)])

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def close(self) -> None:
        with contextlib.suppress(Exception), stderr_to(self._client_log):
            self.store.close()
        self.proc.stop()


# --------------------------------------------------------------------------- grpc.aio floors


class GrpcEchoPeer:
    """The echo server of bench/control_plane/grpc_echo.py in its own process, plus client helpers."""

    def __init__(self, log_dir: Path):
        self.port = free_port()
        self.proc = ChildProcess(
            "grpc-echo",
            [sys.executable, "-m", "bench.control_plane.grpc_echo", "--port", str(self.port)],
            log_dir / "grpc_echo.log",
            env=python_env(),
            cwd=REPO_ROOT,
            fresh_log=True,
        ).start()
        self.proc.wait_port(self.port, 30)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.stop()

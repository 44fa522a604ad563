"""Engine client processes for the process-level tests (the broker process: testkit.processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from testkit.processes import SERVE, BrokerProcess

if TYPE_CHECKING:
    from collections.abc import Sequence

    from test_process_liveness import Timeline

    from kvbroker.clients.engine_session import EngineSession
    from kvbroker.v1 import broker_pb2 as pb
    from testkit.redis_cluster import RedisCluster
    from testkit.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
ENGINE_CLIENT = Path(__file__).with_name("process_engine_client.py")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def replica(
    tmp_path: Path, store: RedisServer | RedisCluster, name: str, metrics_port: int = 0
) -> BrokerProcess:
    """A `kvbroker serve --state` replica over ``store`` (not started), its log NAME.log."""
    args = ["--state", store.url, "--session-ttl-min-ms", "100", "--expiry-interval-ms", "20"]
    args += ["--metrics-port", str(metrics_port)]
    return BrokerProcess(
        tmp_path, args, command=SERVE, log_name=f"{name}.log", priority=None, env=child_env()
    )


def crossed_sessions(
    first: str, second: str, ttl_ms: int
) -> tuple[EngineSession, EngineSession, Timeline, Timeline]:
    """Engine sessions P (on replica `first`, then `second`) and D (the other way round), so
    every lease between them crosses replicas; quick reconnects; each with its event timeline.
    Not started: (p, d, p_events, d_events)."""
    from process_engine_client import engine_info
    from test_process_liveness import Timeline

    from kvbroker.clients.clock import Backoff
    from kvbroker.clients.engine_session import EngineSession

    fast = Backoff(initial_s=0.05, max_s=0.5)
    p_events, d_events = Timeline(), Timeline()
    p = EngineSession(
        f"{first},{second}", engine_info("P"), ttl_ms=ttl_ms, backoff=fast, **p_events.callbacks()
    )
    d = EngineSession(
        f"{second},{first}", engine_info("D"), ttl_ms=ttl_ms, backoff=fast, **d_events.callbacks()
    )
    return p, d, p_events, d_events


async def hold_for_d(p: EngineSession, blocks: Sequence[int]) -> pb.Lease:
    """P holds its GPU `blocks` (block ids 1, 2, 3, ...) for reader D, for 60 s."""
    from kvbroker.v1 import broker_pb2 as pb

    ids = list(range(1, len(blocks) + 1))
    return await p.hold((p.layout_id, ""), pb.TIER_GPU, blocks, ids, 60_000, reader_engine_id="D")


async def start_with_a_read(
    p: EngineSession, d: EngineSession, blocks: Sequence[int], also: Sequence[int] = ()
) -> tuple[pb.Lease, pb.LeaseResponse]:
    """Start P and D; P announces `blocks` (then `also`) on GPU, holds `blocks` for D, and D
    claims the hold: (the hold, D's acquire)."""
    from kvbroker.v1 import broker_pb2 as pb

    await p.start(wait_connected_s=10.0)
    await d.start(wait_connected_s=10.0)
    p.announce_stored((p.layout_id, ""), pb.TIER_GPU, blocks)
    if also:
        p.announce_stored((p.layout_id, ""), pb.TIER_GPU, also)
    await p.applied()
    held = await hold_for_d(p, blocks)
    return held, await d.acquire(held.lease_id)


async def hold_once(p: EngineSession, blocks: Sequence[int], out: list[pb.Lease]) -> bool:
    """One try of `hold_for_d` for a polling wait: False while the fleet answers UNAVAILABLE."""
    from kvbroker.clients import errors

    try:
        out.append(await hold_for_d(p, blocks))
    except errors.Unavailable:
        return False
    return True


class EngineProcess:
    """tests/process/process_engine_client.py as a child process that reports events as JSON lines."""

    def __init__(self, broker: str, engine_id: str, role: str, *extra: str) -> None:
        self.engine_id = engine_id
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(ENGINE_CLIENT),
                "--broker",
                broker,
                "--engine-id",
                engine_id,
                "--role",
                role,
                *extra,
            ],
            cwd=REPO,
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    @property
    def stdin(self) -> IO[str]:
        assert self.proc.stdin is not None
        return self.proc.stdin

    def expect(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        """The next event line, which must be `event` (blocking read; the child reports promptly)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine {self.engine_id} exited {self.proc.wait()} before {event!r}")
            message = json.loads(line)
            if message["event"] == event:
                return message
        raise RuntimeError(f"engine {self.engine_id}: no {event!r} in {timeout} s")

    def send(self, line: str) -> None:
        self.stdin.write(line + "\n")
        self.stdin.flush()

    def kill(self, sig: int = signal.SIGKILL) -> float:
        """Send `sig`; returns the monotonic time it was sent."""
        sent = time.monotonic()
        self.proc.send_signal(sig)
        return sent

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

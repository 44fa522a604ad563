"""A real `kvbroker serve` and a real `kvbroker watch` process: a quiet stream is not cut.

Both sides run with short keepalive intervals (the broker's
--keepalive-min-ping-interval-ms, the command's --keepalive-ms), so many ping
intervals pass in seconds. A `kvbroker watch` that the broker does cut off for
pinging too often says so, naming the GOAWAY, instead of "cannot reach".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

from process_engine_client import engine_info
from process_harness import child_env

from kvbroker.clients.engine_session import EngineSession
from testkit.processes import SERVE, BrokerProcess

PING_MS = 1_000  # gRPC clients send at most about one ping a second
QUIET_S = 8.0  # gRPC's default server policy cut such a client off after about 4 s


async def _watch(broker: BrokerProcess) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvbroker.tools.cli",
        "--broker",
        broker.address,
        "--keepalive-ms",
        str(PING_MS),
        "watch",
        "--engines",
        "--count",
        "1",
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=child_env(),
    )


def _broker(tmp_path: Path, *flags: str) -> BrokerProcess:
    return BrokerProcess(tmp_path, flags, command=SERVE, log_level=None, priority=None, env=child_env())


async def test_a_quiet_watch_outlives_many_keepalive_pings(tmp_path: Path) -> None:
    with _broker(tmp_path, "--keepalive-min-ping-interval-ms", str(PING_MS // 2)) as broker:
        watch = await _watch(broker)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watch.wait(), QUIET_S)
        assert watch.returncode is None, (await watch.communicate())[1].decode()
        session = EngineSession(broker.address, engine_info("late"))
        await session.start(wait_connected_s=5.0)
        try:
            out, err = await asyncio.wait_for(watch.communicate(), 10.0)
        finally:
            await session.close()
    assert watch.returncode == 0, err.decode()
    event = json.loads(out.decode().splitlines()[0])
    assert event["kind"] == "engine_registered" and event["engine_id"] == "late"
    assert b"GOAWAY" not in err


async def test_watch_names_a_goaway_for_too_many_pings(tmp_path: Path) -> None:
    with _broker(tmp_path) as broker:  # the default: pings at least 10 s apart
        watch = await _watch(broker)
        _, err = await asyncio.wait_for(watch.communicate(), 20.0)
    assert watch.returncode == 3
    line = [x for x in err.decode().splitlines() if x.startswith("kvbroker watch:")]
    assert line, err.decode()
    assert 'GOAWAY ENHANCE_YOUR_CALM "too_many_pings"' in line[0]
    assert "--keepalive-ms" in line[0] and "cannot reach" not in line[0]

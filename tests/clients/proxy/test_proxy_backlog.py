"""The proxy's listen queue (--backlog): a burst of clients connecting at once is queued by the
kernel, not left to retry its SYN a second later (a real `python -m kvbroker.clients.proxy`)."""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import pytest

from kvbroker.clients.proxy.config import build_parser, config_from_args
from testkit.processes import ProxyProcess, stopped

pytestmark = pytest.mark.timeout(60)

BURST = 600


def _somaxconn() -> int:
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return 0


def _queued(port: int, n: int) -> int:
    """How many of `n` connections, opened at once, the kernel completes within a second while
    nobody accepts them (the rest wait in SYN_SENT for a retry)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
        poller = select.poll()
        for s in socks:
            poller.register(s, select.POLLOUT)
        done: set[int] = set()
        deadline = time.monotonic() + 1.0
        while len(done) < n and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                done.add(fd)
        return sum(
            1 for s in socks if s.fileno() in done and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        )
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("backlog", [None, 64])
def test_a_burst_of_connections_is_queued(tmp_path: Path, backlog: int | None) -> None:
    """With the proxy frozen (it accepts nothing), the kernel completes as many connections as the
    listen queue holds: all 600 at the default (aiohttp's own default of 128 left 6-8% of a
    2,000-client burst to wait a second each for a SYN retry), about 64 at --backlog 64."""
    if _somaxconn() < 1_024:
        pytest.skip(f"net.core.somaxconn is {_somaxconn()}: the kernel caps any listen queue there")
    extra = ["--backlog", str(backlog)] if backlog is not None else []
    proxy = ProxyProcess(tmp_path / "proxy.log", engines={"E": "http://127.0.0.1:1"}, extra_args=extra)
    with proxy, stopped(proxy.pid):
        queued = _queued(proxy.port, BURST)
    if backlog is None:
        assert queued == BURST
    else:
        assert backlog <= queued <= backlog + 2, queued


def test_a_backlog_below_one_is_refused() -> None:
    args = build_parser().parse_args(["--engine", "E=http://127.0.0.1:1", "--backlog", "0"])
    with pytest.raises(SystemExit, match="--backlog must be at least 1"):
        config_from_args(args)

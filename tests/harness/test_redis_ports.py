"""The test harness's redis-server: a free port another process takes before the server binds it
(what failed a CI run once, on a Cluster node's bus port) is picked again, not a failed start."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from testkit.redis_cluster import ClusterNode
from testkit.redis_server import RedisServer, missing_reason

pytestmark = pytest.mark.skipif(bool(missing_reason()), reason=missing_reason() or "-")


def _taken(port: int) -> socket.socket:
    """Another process's listener on `port` (it accepts, and never answers)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.mark.parametrize("which", ["port", "bus_port"])
def test_a_cluster_node_whose_port_was_taken_starts_on_new_ones(tmp_path: Path, which: str) -> None:
    node = ClusterNode(tmp_path / "node")
    node.workdir.mkdir(parents=True)
    before = (node.port, node.bus_port)
    with _taken(getattr(node, which)):
        node.start(timeout=10)
        try:
            assert (node.port, node.bus_port) != before
            assert node.client().ping() is True
        finally:
            node.stop()


def test_a_server_given_its_port_is_not_moved(tmp_path: Path) -> None:
    """A caller that named the port (a restart in place) gets the failure, not another port."""
    with _taken(0) as other:
        port = other.getsockname()[1]
        server = RedisServer(tmp_path, port=port)
        with pytest.raises(RuntimeError, match="did not start"):
            server.start(timeout=3)
        assert server.port == port
        server.stop()

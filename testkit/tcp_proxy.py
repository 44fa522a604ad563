"""A TCP forwarder that can go dark: the network partition that sends no reset, for tests and benchmarks.

``TcpProxy(target)`` listens on a free loopback port and forwards every
connection to ``target`` in both directions. ``blackhole()`` makes it stop
forwarding without closing anything: bytes from either side are read and
dropped (so no buffer fills and no window closes), connections stay open, new
connections are accepted and go nowhere. That is what a client sees of a
partition or a host that froze: silence, not an error. ``restore()`` forwards
again (bytes dropped meanwhile stay lost, as on a real link that healed after
the peers gave up). Threads, not asyncio, so it runs beside any event loop.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from testkit.ports import free_port

_CHUNK = 65536


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target`` (``host:port``) until ``blackhole()``."""

    def __init__(self, target: str, port: int | None = None) -> None:
        host, _, target_port = target.rpartition(":")
        self.target = (host.strip("[]"), int(target_port))
        self.port = port or free_port()
        self.dark = threading.Event()
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self.dropped_bytes = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, name=f"tcp-proxy-{self.port}", daemon=True).start()
        return self

    def blackhole(self) -> None:
        """Stop forwarding, close nothing."""
        self.dark.set()

    def restore(self) -> None:
        self.dark.clear()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            sockets, self._sockets = self._sockets, []
        if self._listener is not None:
            sockets.append(self._listener)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5.0)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(_CHUNK)
            except OSError:
                return
            if not data:
                if not self.dark.is_set():  # a dark link carries no FIN either
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                return
            if self.dark.is_set():
                self.dropped_bytes += len(data)
                continue
            try:
                dst.sendall(data)
            except OSError:
                return

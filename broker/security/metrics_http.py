"""Serving /metrics: plain HTTP on loopback, HTTPS for operators anywhere else.

/metrics names every engine and the traffic between each pair, so it follows
the broker's own rule (docs/security.md): on a loopback address (the default,
``--metrics-host 127.0.0.1``) it is plain HTTP for a local scraper; on any other
address it is HTTPS with the broker's certificate when the broker serves TLS,
and then only an operator of every tenant (``kvbroker://*/operator/NAME``, by
client certificate or bearer token) may read it when the broker has
identities; plain HTTP there needs ``--insecure``.

TLS handshakes run on the connection's own thread with a timeout, so a client
that never finishes one holds up nobody else.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kvbroker.broker.security.config import SecurityConfig, is_loopback, require_safe_listener
from kvbroker.broker.security.http_identity import HttpUnidentified, identify_http, server_ssl_context
from kvbroker.broker.security.identity import ALL_TENANTS, Role, TokenTable

log = logging.getLogger("kvbroker.metrics")

HANDSHAKE_TIMEOUT_S = 5.0
PEER_CERT = "kvbroker.peer_cert"


class _Handler(WSGIRequestHandler):
    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        getpeercert = getattr(self.connection, "getpeercert", None)
        environ[PEER_CERT] = getpeercert() if getpeercert is not None else None
        return environ

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingWSGIServer):
    tls: ssl.SSLContext | None = None

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            if self.tls is not None:
                request.settimeout(HANDSHAKE_TIMEOUT_S)
                request = self.tls.wrap_socket(request, server_side=True)
            self.finish_request(request, client_address)
        except (OSError, ValueError) as err:  # a failed handshake or a dropped client: its problem
            log.debug("metrics connection from %s: %s", client_address, err)
        finally:
            self.shutdown_request(request)


App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _operators_only(app: App, tokens: TokenTable | None) -> App:
    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            who = identify_http(environ.get(PEER_CERT), environ.get("HTTP_AUTHORIZATION", ""), tokens)
        except HttpUnidentified as err:
            start_response("401 Unauthorized", [("Content-Type", "text/plain")])
            return [f"{err}\n".encode()]
        if who.role is not Role.OPERATOR or who.tenant != ALL_TENANTS:
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [f"{who} may not read /metrics: rule '/metrics is for operators of tenant *'\n".encode()]
        return app(environ, start_response)

    return guarded


def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, *, security: SecurityConfig, tokens: TokenTable | None
) -> Any:
    """Start /metrics on a daemon thread (see the module docstring); returns the server
    (.server_port, .shutdown()). OSError if the port cannot be bound; InvalidArgument if the
    address is not allowed."""
    address = f"{host}:{port}"
    tls = security.tls and not is_loopback(address)
    require_safe_listener(security, address, "/metrics (--metrics-host)", tls=tls)
    if not tls and not is_loopback(address):
        log.warning("serving /metrics over plain HTTP on %s (--insecure): it names every engine", address)
    app: App = make_wsgi_app(registry)
    if tls and security.authenticates:
        app = _operators_only(app, tokens)

    class Server(_Server):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = make_server(host.strip("[]"), port, app, Server, handler_class=_Handler)
    if tls:
        httpd.tls = server_ssl_context(security, tokens)  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, name="kvbroker-metrics", daemon=True).start()
    return httpd


class TokensCollector(Collector):
    """The tokens file as last read: tokens granted, lines rejected, reloads that revoked all."""

    def __init__(self, tokens: TokenTable) -> None:
        self._tokens = tokens

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvbroker_tokens", "Bearer tokens in the tokens file", value=len(self._tokens)
        )
        yield GaugeMetricFamily(
            "kvbroker_tokens_file_rejected_lines",
            "Malformed lines of the tokens file as last read (each grants nothing; see the broker's log)",
            value=self._tokens.rejected_lines,
        )
        yield CounterMetricFamily(
            "kvbroker_tokens_file_failed_reloads",
            "Times the tokens file was gone or unreadable (every token revoked until it is back)",
            value=self._tokens.failed_reloads,
        )

"""Who may call the KV-indexer HTTP API, by the broker's security settings (docs/security.md).

broker/server.py builds an IndexerGate and gives it to the indexer's HTTP server
(broker/indexer/http.py), which asks it how to listen and who each request is.
With ``--tls-cert`` the API serves HTTPS with the broker's certificate; with
identities on (``--tls-ca``, ``--tokens-file``) every call needs a client
certificate or ``Authorization: Bearer TOKEN``. Plaintext on a non-loopback
address needs ``--insecure``.
"""

from __future__ import annotations

import ssl
from typing import Any

from kvbroker.broker.errors import Unauthenticated
from kvbroker.broker.security.config import SecurityConfig, require_safe_listener
from kvbroker.broker.security.http_identity import HttpUnidentified, identify_http, server_ssl_context
from kvbroker.broker.security.identity import Identity, TokenTable


class IndexerGate:
    def __init__(self, security: SecurityConfig, tokens: TokenTable | None = None) -> None:
        self.security = security
        # The broker's one tokens table (server.py), else this gate's own.
        self.tokens = tokens
        if tokens is None and security.tokens_file:
            self.tokens = TokenTable(security.tokens_file)

    @property
    def authenticates(self) -> bool:
        return self.security.authenticates

    def check_address(self, address: str) -> None:
        """InvalidArgument if the API may not be served on `address` (the rule of every listener)."""
        require_safe_listener(
            self.security, address, "the indexer API (--indexer-http)", tls=self.security.tls
        )

    def check_feed_bind(self, endpoint: str) -> None:
        """InvalidArgument if a feed may not bind `endpoint`: ``tcp://*`` listens on every interface
        and ZMQ checks no one, so it needs --insecure."""
        if endpoint.startswith("tcp://") and "*" in endpoint:
            require_safe_listener(self.security, endpoint, f"a KV-event feed bound to {endpoint}", tls=False)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context (None: plaintext)."""
        return server_ssl_context(self.security, self.tokens) if self.security.tls else None

    def identify(self, headers: dict[str, str], ssl_object: Any) -> Identity | None:
        """The caller (None: identities are off); Unauthenticated if it shows none the broker accepts."""
        if not self.security.authenticates:
            return None
        cert = ssl_object.getpeercert() if ssl_object is not None else None
        try:
            return identify_http(cert, headers.get("authorization", ""), self.tokens)
        except HttpUnidentified as err:
            raise Unauthenticated(str(err)) from None

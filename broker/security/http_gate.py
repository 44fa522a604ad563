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

from kvbroker.broker.errors import InvalidArgument, Unauthenticated
from kvbroker.broker.security.config import SecurityConfig, is_loopback
from kvbroker.broker.security.identity import SCHEME, Identity, TokenTable, parse_identity


class IndexerGate:
    def __init__(self, security: SecurityConfig) -> None:
        self.security = security
        self.tokens = TokenTable(security.tokens_file) if security.tokens_file else None

    @property
    def authenticates(self) -> bool:
        return self.security.authenticates

    def check_address(self, address: str) -> None:
        """InvalidArgument if the API may not be served on `address` in plaintext."""
        if not self.security.tls and not self.security.insecure and not is_loopback(address):
            raise InvalidArgument(
                f"--indexer-http {address!r} is not a loopback address: serve it with TLS (--tls-cert) "
                "or pass --insecure"
            )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context (None: plaintext)."""
        if not self.security.tls:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.security.tls_cert, self.security.tls_key)
        if self.security.tls_ca:
            context.load_verify_locations(self.security.tls_ca)
            context.verify_mode = ssl.CERT_OPTIONAL if self.tokens is not None else ssl.CERT_REQUIRED
        return context

    def identify(self, headers: dict[str, str], ssl_object: Any) -> Identity | None:
        """The caller (None: identities are off); Unauthenticated if it shows none the broker accepts."""
        if not self.security.authenticates:
            return None
        cert = ssl_object.getpeercert() if ssl_object is not None else None
        for kind, value in (cert or {}).get("subjectAltName", ()):
            if kind == "URI" and value.startswith(SCHEME):
                try:
                    return parse_identity(value)
                except ValueError as err:
                    raise Unauthenticated(f"the client certificate's identity is not valid: {err}") from None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if self.tokens is not None and scheme.lower() == "bearer" and token.strip():
            found = self.tokens.lookup(token.strip())
            if found is None:
                raise Unauthenticated("the bearer token is not in the broker's tokens file")
            return found
        raise Unauthenticated("identify yourself: a client certificate or 'Authorization: Bearer TOKEN'")

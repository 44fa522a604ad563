"""Who is calling over HTTP (the indexer API, /metrics): the same identities as gRPC.

A verified client certificate's ``kvbroker://TENANT/ROLE/NAME`` URI SAN, else
``Authorization: Bearer TOKEN`` looked up in the broker's tokens file. One
function for every HTTP surface, so they cannot disagree on who a caller is.
"""

from __future__ import annotations

import ssl
from typing import Any

from kvbroker.broker.security.config import SecurityConfig
from kvbroker.broker.security.identity import SCHEME, Identity, TokenTable, parse_identity


class HttpUnidentified(Exception):
    """No identity (HTTP 401); the message says what is missing."""


def identify_http(
    peer_cert: dict[str, Any] | None, authorization: str, tokens: TokenTable | None
) -> Identity:
    """The caller's identity from its verified certificate (`peer_cert`, as ssl's getpeercert()
    gives it) or its `authorization` header; HttpUnidentified says what is missing."""
    for kind, value in (peer_cert or {}).get("subjectAltName", ()):
        if kind == "URI" and value.startswith(SCHEME):
            try:
                return parse_identity(value)
            except ValueError as err:
                raise HttpUnidentified(f"the client certificate's identity is not valid: {err}") from None
    scheme, _, token = authorization.partition(" ")
    if tokens is not None and scheme.lower() == "bearer" and token.strip():
        found = tokens.lookup(token.strip())
        if found is None:
            raise HttpUnidentified(
                "the bearer token is not in the broker's tokens file (revoked or mistyped)"
            )
        return found
    raise HttpUnidentified("identify yourself: a client certificate or 'Authorization: Bearer TOKEN'")


def server_ssl_context(security: SecurityConfig, tokens: TokenTable | None) -> ssl.SSLContext:
    """The broker's certificate for an HTTP listener; with --tls-ca, client certificates from that
    CA are verified (required, unless bearer tokens are another way in)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_ca:
        context.load_verify_locations(security.tls_ca)
        context.verify_mode = ssl.CERT_OPTIONAL if tokens is not None else ssl.CERT_REQUIRED
    return context

"""Who is calling: identities from client certificates and bearer tokens.

An identity is ``kvbroker://TENANT/ROLE/NAME``: the tenant it belongs to, its
role (engine, router, operator) and its name (an engine's name is the one
engine id it may register). It comes from the verified client certificate's
URI SAN (mutual TLS), else from the bearer token in the call's
``authorization`` metadata, looked up in the tokens file. The tenant ``*``
(operators only) sees every tenant.

The tokens file is reread when it changes (checked at most once a second), so
tokens rotate without a restart.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from enum import StrEnum

import grpc

from kvbroker.broker.namespaces import ALL_TENANTS

log = logging.getLogger("kvbroker.identity")

SCHEME = "kvbroker://"

AUTHORIZATION = "authorization"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class Role(StrEnum):
    ENGINE = "engine"
    ROUTER = "router"
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    role: Role
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.tenant}/{self.role}/{self.name}"

    def __str__(self) -> str:
        return self.uri

    def owns_tenant(self, tenant: str) -> bool:
        """Whether a namespace tenant (TENANT or TENANT/SALT) is this identity's."""
        return self.tenant == ALL_TENANTS or tenant == self.tenant or tenant.startswith(self.tenant + "/")


@functools.lru_cache(maxsize=4096)
def parse_identity(uri: str) -> Identity:
    """``kvbroker://TENANT/ROLE/NAME`` as an Identity; ValueError says what is wrong."""
    if not uri.startswith(SCHEME):
        raise ValueError(f"{uri[:80]!r} is not a {SCHEME}TENANT/ROLE/NAME identity")
    parts = uri[len(SCHEME) :].split("/")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"{uri[:80]!r}: need {SCHEME}TENANT/ROLE/NAME, three non-empty parts")
    tenant, role, name = parts
    if role not in Role.__members__.values():
        raise ValueError(f"{uri[:80]!r}: role {role[:20]!r} is none of {', '.join(Role)}")
    if tenant == ALL_TENANTS and role != Role.OPERATOR:
        raise ValueError(f"{uri[:80]!r}: only an operator may belong to every tenant ('*')")
    for what, value in (("tenant", tenant), ("name", name)):
        if len(value) > 128 or (value != ALL_TENANTS and not set(value) <= _NAME_CHARS):
            raise ValueError(f"{uri[:80]!r}: the {what} may hold only letters, digits, '.', '_', '-'")
    return Identity(tenant, Role(role), name)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """The tokens file: ``TOKEN kvbroker://TENANT/ROLE/NAME`` a line; ``#`` starts a comment."""

    RECHECK_S = 1.0

    def __init__(self, path: str) -> None:
        self.path = path
        self._by_digest: dict[bytes, Identity] = {}
        self._mtime: float | None = None
        self._checked = 0.0
        self.load()

    def load(self) -> None:
        """(Re)read the file; a file that cannot be read or parsed keeps the previous table."""
        stat = os.stat(self.path)
        table: dict[bytes, Identity] = {}
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                fields = line.split()
                if len(fields) != 2:
                    raise ValueError(f"{self.path}:{number}: need 'TOKEN {SCHEME}TENANT/ROLE/NAME'")
                try:
                    table[_digest(fields[0])] = parse_identity(fields[1])
                except ValueError as err:
                    raise ValueError(f"{self.path}:{number}: {err}") from None
        self._by_digest = table
        self._mtime = stat.st_mtime
        log.info("tokens file %s: %d tokens", self.path, len(table))

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.RECHECK_S:
            return
        self._checked = now
        try:
            if os.stat(self.path).st_mtime != self._mtime:
                self.load()
        except (OSError, ValueError) as err:
            log.warning("tokens file not reloaded, keeping the previous tokens: %s", err)

    def lookup(self, token: str) -> Identity | None:
        self._maybe_reload()
        return self._by_digest.get(_digest(token))


class Unidentified(Exception):
    """No identity: the message says why (for an UNAUTHENTICATED status)."""


class Authenticator:
    """An identity for each call, from its verified certificate or its bearer token."""

    def __init__(self, tokens: TokenTable | None, certificates: bool) -> None:
        self.tokens = tokens
        self.certificates = certificates

    def identify(self, context: grpc.aio.ServicerContext) -> Identity:
        if self.certificates:
            uris = context.auth_context().get("peer_uri", [])
            for raw in uris:
                uri = raw.decode(errors="replace")
                if uri.startswith(SCHEME):
                    try:
                        return parse_identity(uri)
                    except ValueError as err:
                        raise Unidentified(f"the client certificate's identity is not valid: {err}") from None
        token = self._bearer(context)
        if token is not None and self.tokens is not None:
            found = self.tokens.lookup(token)
            if found is None:
                raise Unidentified(
                    "the bearer token is not in the broker's tokens file (revoked or mistyped)"
                )
            return found
        if self.certificates:
            subject = b",".join(context.auth_context().get("x509_subject", [])).decode(errors="replace")
            raise Unidentified(
                f"the client certificate ({subject or 'none'}) has no {SCHEME}TENANT/ROLE/NAME URI SAN"
                + (" and the call has no bearer token" if self.tokens is not None else "")
            )
        raise Unidentified(
            "the broker requires a bearer token: send 'authorization: Bearer TOKEN' "
            "(clients: --token-file / KVBROKER_TOKEN_FILE)"
        )

    @staticmethod
    def _bearer(context: grpc.aio.ServicerContext) -> str | None:
        for key, value in context.invocation_metadata() or ():
            if key == AUTHORIZATION and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer" and token.strip():
                    return token.strip()
        return None

"""Who is calling: identities from client certificates and bearer tokens.

An identity is ``kvbroker://TENANT/ROLE/NAME``: the tenant it belongs to, its
role (engine, router, operator) and its name (an engine's name is the one
engine id it may register). It comes from the verified client certificate's
URI SAN (mutual TLS), else from the bearer token in the call's
``authorization`` metadata, looked up in the tokens file. The tenant ``*``
(operators only) sees every tenant.

The tokens file is reread when it changes (checked at most once a second), so
tokens rotate without a restart; it fails closed (TokenTable).
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
    """The tokens file: ``TOKEN kvbroker://TENANT/ROLE/NAME`` a line; ``#`` starts a comment.

    It fails closed. At start a malformed line refuses the whole file (the broker does not
    start: a person is watching). On a reload a malformed line is rejected alone, logged at
    ERROR and counted (`rejected_lines`); the other lines of the new file are the table, so a
    token removed in the same edit is revoked all the same (refusing the whole reload would keep
    it, and refusing every token would lock every engine out over one typo). A file that is
    gone or cannot be read revokes every token until it is back. Replace the file atomically
    (write a new one, rename it over) so that no reload sees it half written.
    """

    RECHECK_S = 1.0

    def __init__(self, path: str) -> None:
        self.path = path
        self._by_digest: dict[bytes, Identity] = {}
        self._signature: tuple[int, int, int] | None = None
        self._checked = 0.0
        self.rejected_lines = 0  # malformed lines in the file as last read (they grant nothing)
        self.failed_reloads = 0  # reloads that found the file gone or unreadable (every token revoked)
        self.load(strict=True)

    def __len__(self) -> int:
        return len(self._by_digest)

    def load(self, *, strict: bool = False) -> None:
        """(Re)read the file. `strict`: a malformed line raises ValueError (nothing changes);
        otherwise it is rejected alone. OSError when the file cannot be read."""
        stat = os.stat(self.path)
        table: dict[bytes, Identity] = {}
        rejected = []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                fields = line.split()
                try:
                    if len(fields) != 2:
                        raise ValueError(f"need 'TOKEN {SCHEME}TENANT/ROLE/NAME'")
                    table[_digest(fields[0])] = parse_identity(fields[1])
                except ValueError as err:
                    if strict:
                        raise ValueError(f"{self.path}:{number}: {err}") from None
                    rejected.append(f"{self.path}:{number}: {err}")
        for problem in rejected:
            log.error("tokens file: line rejected, it grants nothing: %s", problem)
        self._by_digest = table
        self._signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        self.rejected_lines = len(rejected)
        log.info("tokens file %s: %d tokens, %d lines rejected", self.path, len(table), len(rejected))

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.RECHECK_S:
            return
        self._checked = now
        try:
            stat = os.stat(self.path)
            if (stat.st_mtime_ns, stat.st_size, stat.st_ino) != self._signature:
                self.load()
        except OSError as err:
            if self._signature is not None or self._by_digest:
                self.failed_reloads += 1
                log.error("tokens file cannot be read, EVERY token is revoked until it is back: %s", err)
            self._by_digest = {}
            self._signature = None

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

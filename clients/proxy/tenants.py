"""API keys to tenants: the proxy decides each request's namespace, never the client.

With ``--api-keys-file`` (one ``KEY TENANT`` a line, ``#`` comments), every
request needs ``Authorization: Bearer KEY`` (the OpenAI client's API key);
the key names its tenant. The proxy then sets the request's ``cache_salt``
itself: ``TENANT`` for a request without one, ``TENANT/SALT`` for a client
salt ``SALT``, so a client's salt only subdivides its own tenant (vLLM hashes
the salt into the prompt's blocks, and the engines' adapters put it in the
broker namespace). A client salt that names another tenant (``OTHER`` or
``OTHER/...``) is refused with 403. The file is reread when it changes.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any


class TenantRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: int | None = None
        self._tenants: dict[bytes, str] = {}
        self.load()

    def load(self) -> None:
        stamp = os.stat(self.path).st_mtime_ns
        table: dict[bytes, str] = {}
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                fields = line.split("#", 1)[0].split()
                if not fields:
                    continue
                if len(fields) != 2 or "/" in fields[1]:
                    raise ValueError(f"{self.path}:{number}: need 'KEY TENANT' (a tenant has no '/')")
                table[_digest(fields[0])] = fields[1]
        self._tenants, self._stamp = table, stamp

    def _fresh(self) -> None:
        try:
            if os.stat(self.path).st_mtime_ns != self._stamp:
                self.load()
        except (OSError, ValueError):
            pass  # keep the keys we have

    @property
    def tenants(self) -> set[str]:
        return set(self._tenants.values())

    def tenant_of(self, authorization: str | None) -> str:
        self._fresh()
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise TenantRefused(401, "this proxy needs an API key: send 'Authorization: Bearer KEY'")
        tenant = self._tenants.get(_digest(key.strip()))
        if tenant is None:
            raise TenantRefused(401, "unknown API key")
        return tenant

    def apply(self, authorization: str | None, body: dict[str, Any]) -> str:
        """Set `body`'s cache_salt from the caller's tenant; returns the tenant (raises TenantRefused)."""
        tenant = self.tenant_of(authorization)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise TenantRefused(400, "cache_salt must be a string")
        salt = salt or ""
        if salt == tenant or salt.startswith(tenant + "/"):
            body["cache_salt"] = salt
            return tenant
        first = salt.split("/", 1)[0]
        if salt and first in self.tenants:
            raise TenantRefused(
                403, f"cache_salt {salt[:64]!r} belongs to another tenant; a salt subdivides your own tenant"
            )
        body["cache_salt"] = f"{tenant}/{salt}" if salt else tenant
        return tenant

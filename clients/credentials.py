"""How a client proves itself to the broker: TLS, mutual TLS, bearer tokens.

`ClientSecurity` is one configuration for every client (the Python clients,
engine sessions, the adapter, the proxy, the CLI), in the settings idiom:
each field is a ``--flag`` and a ``KVBROKER_<FIELD>`` variable, and
``ClientSecurity.from_env()`` reads the variables, so a process configured by
its environment needs no code::

    KVBROKER_TLS_CA=ca.pem KVBROKER_TLS_CERT=me.pem KVBROKER_TLS_KEY=me.key kvbroker engines

- ``tls_ca``: the CA that signed the broker's certificate; set, the channel is TLS.
- ``tls_cert`` + ``tls_key``: this client's certificate (mutual TLS); its URI
  SAN ``kvbroker://TENANT/ROLE/NAME`` is the identity the broker sees.
- ``token_file``: a file holding one bearer token, sent as
  ``authorization: Bearer TOKEN`` on every call. It is reread when it changes,
  so a rotated token is used from the next call on. Tokens need TLS.
Certificate files are read when a channel is made; the asyncio client makes a
new channel when they change (`FileStamp`), and the broker rereads its own.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from kvbroker.common import settings
from kvbroker.common.settings import setting

ENV_PREFIX = "KVBROKER_"


class CredentialError(ValueError):
    """The client's security settings cannot be used; the message says which and why."""


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    tls_ca: str = setting("", "PEM file of the CA that signed the broker's certificate (turns TLS on)")
    tls_cert: str = setting("", "PEM file of this client's certificate, for mutual TLS")
    tls_key: str = setting("", "PEM file of the private key of --tls-cert")
    tls_server_name: str = setting(
        "", "name to expect in the broker's certificate, when it differs from the address's host"
    )
    token_file: str = setting("", "file holding this client's bearer token (needs --tls-ca)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientSecurity:
        env = os.environ if environ is None else environ
        values = {row.name: env.get(row.env, row.default) for row in settings.describe(cls, ENV_PREFIX)}
        return cls(**values)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> ClientSecurity:
        """The fields present in `mapping` (e.g. the adapter's extra config), the rest from the environment."""
        values = {f.name: str(mapping[f.name]) for f in dataclasses.fields(cls) if mapping.get(f.name)}
        return dataclasses.replace(cls.from_env(), **values)

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca)

    def validate(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise CredentialError("tls_cert and tls_key go together: set both, or neither")
        if (self.tls_cert or self.token_file) and not self.tls_ca:
            raise CredentialError(
                "tls_cert and token_file need tls_ca (the broker's CA): credentials are never sent in plaintext"
            )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        self.validate()
        try:
            creds = grpc.ssl_channel_credentials(
                _read(self.tls_ca),
                _read(self.tls_key) if self.tls_key else None,
                _read(self.tls_cert) if self.tls_cert else None,
            )
        except OSError as err:
            raise CredentialError(f"cannot read a TLS file: {err}") from None
        if self.token_file:
            token = TokenFile(self.token_file)
            token.read()  # fail now, not on the first call
            creds = grpc.composite_channel_credentials(creds, grpc.metadata_call_credentials(token))
        return creds

    def options(self) -> list[tuple[str, Any]]:
        if self.tls_server_name:
            return [("grpc.ssl_target_name_override", self.tls_server_name)]
        return []


class FileStamp:
    """When a client's certificate files last changed, checked at most once a second."""

    RECHECK_S = 1.0

    def __init__(self, security: ClientSecurity) -> None:
        self.paths = [p for p in (security.tls_ca, security.tls_cert, security.tls_key) if p]
        self._stamp = self._read()
        self._next = time.monotonic() + self.RECHECK_S

    def _read(self) -> tuple[int, ...]:
        try:
            return tuple(os.stat(p).st_mtime_ns for p in self.paths)
        except OSError:
            return ()

    def changed(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.RECHECK_S
        stamp = self._read()
        if not stamp or stamp == self._stamp:
            return False
        self._stamp = stamp
        return True


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class TokenFile(grpc.AuthMetadataPlugin):
    """The bearer token in a file, reread when the file changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: int | None = None
        self._token = ""

    def read(self) -> str:
        with self._lock:
            try:
                stamp = os.stat(self.path).st_mtime_ns
                if stamp != self._stamp:
                    with open(self.path, encoding="utf-8") as f:
                        token = f.read().strip()
                    if not token:
                        raise CredentialError(f"token file {self.path} is empty")
                    self._token, self._stamp = token, stamp
            except OSError as err:
                if not self._token:
                    raise CredentialError(f"cannot read token file: {err}") from None
            return self._token

    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        try:
            callback((("authorization", f"Bearer {self.read()}"),), None)
        except CredentialError as err:
            callback((), err)


def channel_target(address: str) -> str:
    """The gRPC target for `address`: `host:port` as it is; several, comma separated
    (`host1:port1,host2:port2`: replicas of a broker fleet sharing state), one target over
    all of them, resolved to IPv4 addresses now. The channel uses the first that answers and
    moves on only when its connection breaks, which a frozen replica never does: the broker
    clients keep one channel per address instead (`kvbroker.clients.endpoints`). (One DNS name
    with a record per replica works too, as is.)
    """
    parts = [part.strip() for part in address.split(",") if part.strip()]
    if len(parts) < 2:
        return address
    resolved: list[str] = []
    for part in parts:
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"broker address {part!r} in {address!r} is not host:port")
        try:
            infos = socket.getaddrinfo(host.strip("[]"), int(port), socket.AF_INET, socket.SOCK_STREAM)
        except OSError as err:
            raise ValueError(f"cannot resolve broker address {part!r} to an IPv4 address: {err}") from None
        resolved += [f"{info[4][0]}:{port}" for info in infos[:1]]
    return "ipv4:" + ",".join(resolved)


def _authority(address: str, tls: bool = False) -> list[tuple[str, str]]:
    """Several replicas: every connection names (and with TLS verifies) the first host's name, so
    one certificate listing the replicas' names serves them all."""
    if "," not in address:
        return []
    host = address.split(",")[0].strip().rpartition(":")[0].strip("[]")
    options = [("grpc.default_authority", host)]
    return [*options, ("grpc.ssl_target_name_override", host)] if tls else options


def replica_options(address: str, security: ClientSecurity) -> list[tuple[str, str]]:
    """Options for the channel to one of several replicas named in `address`: each names (and
    with TLS verifies) the first host's name, as one channel over all of them would."""
    return _authority(address, tls=security.tls)


def aio_channel(
    address: str, security: ClientSecurity | None, options: Sequence[tuple[str, Any]]
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address`: TLS with `security`'s credentials, else plaintext."""
    security = security if security is not None else ClientSecurity.from_env()
    if not security.tls:
        security.validate()
        return grpc.aio.insecure_channel(channel_target(address), options=[*options, *_authority(address)])
    return grpc.aio.secure_channel(
        channel_target(address),
        security.channel_credentials(),
        options=[*options, *_authority(address, tls=True), *security.options()],
    )


def sync_channel(
    address: str, security: ClientSecurity | None, options: Sequence[tuple[str, Any]]
) -> grpc.Channel:
    """A blocking channel to `address`, as `aio_channel`."""
    security = security if security is not None else ClientSecurity.from_env()
    if not security.tls:
        security.validate()
        return grpc.insecure_channel(channel_target(address), options=[*options, *_authority(address)])
    return grpc.secure_channel(
        channel_target(address),
        security.channel_credentials(),
        options=[*options, *_authority(address, tls=True), *security.options()],
    )

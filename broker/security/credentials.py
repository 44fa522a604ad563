"""The broker's TLS server credentials, reloaded from their files without a restart.

gRPC asks `CertificateFiles.fetch` before each new TLS handshake; when any of
the files changed since the last load it answers with the new certificate,
key and client CA, so replacing the files (a certificate renewal) takes
effect for the next connection. Established connections keep the
certificate they were made with. A file that is half written or does not
parse is logged and the previous certificate stays in use.
"""

from __future__ import annotations

import logging
import os
import time

import grpc

from kvbroker.broker.security.config import SecurityConfig

log = logging.getLogger("kvbroker.credentials")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class CertificateFiles:
    """The certificate, key and (mutual TLS) client CA files, and when they last changed."""

    RECHECK_S = 1.0

    def __init__(self, security: SecurityConfig) -> None:
        self.cert = security.tls_cert
        self.key = security.tls_key
        self.ca = security.tls_ca
        self._stamp = self._mtimes()
        self._checked = time.monotonic()
        self.reloads = 0

    def _paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert, self.key, self.ca) if p)

    def _mtimes(self) -> tuple[float, ...]:
        return tuple(os.stat(p).st_mtime_ns for p in self._paths())

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(_read(self.key), _read(self.cert))], root_certificates=_read(self.ca) if self.ca else None
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate fetcher: a new configuration when the files changed, else None."""
        now = time.monotonic()
        if now - self._checked < self.RECHECK_S:
            return None
        self._checked = now
        try:
            stamp = self._mtimes()
            if stamp == self._stamp:
                return None
            config = self.configuration()
        except (OSError, ValueError) as err:
            log.warning("TLS files not reloaded, keeping the previous certificate: %s", err)
            return None
        self._stamp = stamp
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.cert)
        return config


def server_credentials(security: SecurityConfig) -> tuple[grpc.ServerCredentials, CertificateFiles]:
    """TLS (mutual when the config names a client CA) credentials that follow their files."""
    files = CertificateFiles(security)
    creds = grpc.dynamic_ssl_server_credentials(
        files.configuration(), files.fetch, require_client_authentication=security.mutual
    )
    return creds, files

"""Certificates for tests, benchmarks and the dev compose stack (needs the `cryptography` package).

    ca = CertificateAuthority.create(tmp_path / "pki")
    server = ca.server("broker")                                  # localhost, 127.0.0.1, ::1
    engine = ca.client("prefill-0", "kvbroker://acme/engine/prefill-0")
    # server.cert, server.key, ca.cert: paths of PEM files

Keys are EC P-256, written with mode 0600. Nothing here is for production:
the CA key sits next to what it signs.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(name: str) -> x509.GeneralName:
    if name.startswith("kvbroker://") or "://" in name:
        return x509.UniformResourceIdentifier(name)
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


@dataclass
class CertificateAuthority:
    directory: Path
    cert: Path
    _key: ec.EllipticCurvePrivateKey
    _name: x509.Name

    @classmethod
    def create(cls, directory: Path, name: str = "kvbroker dev CA", days: int = 30) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(key, hashes.SHA256())
        )
        path = _write(directory / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
        _write(directory / "ca.key", _key_pem(key), private=True)
        return cls(directory, path, key, subject)

    def issue(
        self, stem: str, common_name: str, names: tuple[str, ...], server: bool, days: int = 30
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        return Issued(
            _write(self.directory / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM)),
            _write(self.directory / f"{stem}.key", _key_pem(key), private=True),
        )

    def server(self, stem: str = "broker", names: tuple[str, ...] = LOCAL_NAMES) -> Issued:
        """A server certificate for `names` (host names and IP addresses)."""
        return self.issue(stem, names[0], names, server=True)

    def client(self, stem: str, identity: str) -> Issued:
        """A client certificate whose URI SAN is `identity` (kvbroker://TENANT/ROLE/NAME)."""
        return self.issue(stem, stem, (identity,), server=False)

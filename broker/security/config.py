"""SecurityConfig: the broker's transport security, credentials and quotas, with flags and variables.

Separate from BrokerConfig so that `kvbroker serve --help` shows them as their
own group; the same idiom (kvbroker.common.settings): each field is a
``--flag`` and a ``KVBROKER_<FIELD>`` variable. docs/security.md explains them.

- ``tls_cert`` + ``tls_key``: serve TLS. Add ``tls_ca`` for mutual TLS: every
  client then needs a certificate signed by that CA, whose URI SAN
  ``kvbroker://TENANT/ROLE/NAME`` is its identity.
- ``tokens_file``: bearer tokens, one ``TOKEN kvbroker://TENANT/ROLE/NAME`` a
  line; needs TLS (a token on a plaintext connection is a token given away).
- Neither: no identities, every call allowed (as before), and only on a
  loopback address unless ``insecure`` is set.
The broker rereads changed certificate and token files without a restart.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvbroker.broker.errors import InvalidArgument
from kvbroker.common.settings import setting


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    tls_cert: str = setting(
        "", "PEM file of the broker's TLS certificate (chain); with --tls-key turns TLS on"
    )
    tls_key: str = setting("", "PEM file of the private key of --tls-cert")
    tls_ca: str = setting(
        "", "PEM file of the CA that signs client certificates: set, every client needs one (mutual TLS)"
    )
    tokens_file: str = setting(
        "", "file of bearer tokens, one 'TOKEN kvbroker://TENANT/ROLE/NAME' a line (needs TLS)"
    )
    insecure: bool = setting(
        False, "allow plaintext without credentials on a non-loopback address (logs a warning)"
    )
    quota_sessions: int = setting(64, "most live sessions per tenant (0 = no limit)")
    quota_streams: int = setting(16, "most open Watch plus Mirror streams per identity (0 = no limit)")
    quota_leases: int = setting(4_096, "most live leases (held or read) per tenant (0 = no limit)")
    quota_blocks: int = setting(4_000_000, "most indexed blocks per tenant (0 = no limit)")
    quota_rate: float = setting(
        10_000.0, "most calls and session messages per second per identity, sustained (0 = no limit)"
    )
    quota_burst: int = setting(20_000, "calls an identity may make at once above --quota-rate")
    quota_tenant_rate: float = setting(
        50_000.0, "most calls and session messages per second of all of a tenant's identities (0 = no limit)"
    )
    quota_tenant_slots: float = setting(
        0.25,
        "share of the broker's Mirror slots (--max-mirrors) and of its Watch slots (--max-watchers) one "
        "tenant may take, at least one each (0 = no limit)",
    )

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def mutual(self) -> bool:
        return bool(self.tls_ca)

    @property
    def authenticates(self) -> bool:
        """Calls carry identities (mutual TLS or tokens): roles, tenants and quotas apply."""
        return self.mutual or bool(self.tokens_file)

    def validate(self, address: str) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("--tls-cert and --tls-key go together: set both, or neither")
        if self.tls_ca and not self.tls:
            raise InvalidArgument(
                "--tls-ca (mutual TLS) needs --tls-cert and --tls-key: the broker's own TLS"
            )
        if self.tokens_file and not self.tls:
            raise InvalidArgument(
                "--tokens-file needs --tls-cert and --tls-key: bearer tokens on plaintext would be sent "
                "in the clear"
            )
        if not self.tls and not self.insecure and not is_loopback(address):
            raise InvalidArgument(
                f"refusing to serve plaintext without credentials on {address}, which is not a loopback "
                "address: set --tls-cert/--tls-key (and --tls-ca or --tokens-file), or pass --insecure "
                "(KVBROKER_INSECURE=1) on a network you trust"
            )
        for name in ("quota_sessions", "quota_streams", "quota_leases", "quota_blocks", "quota_burst"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0")
        for name in ("quota_rate", "quota_tenant_rate", "quota_tenant_slots"):
            value = getattr(self, name)
            if value < 0 or value != value:
                raise InvalidArgument(f"{name} must be a number >= 0")


def is_loopback(address: str) -> bool:
    """Whether host:port listens only on this machine (127.0.0.0/8, ::1, localhost)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

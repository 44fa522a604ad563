"""A test PKI (the `cryptography` package) and real TLS broker processes: mutual TLS, and TLS with tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from kvbroker.clients.credentials import ClientSecurity
from testkit.certs import CertificateAuthority, Issued
from testkit.processes import BrokerProcess

# Identities the tests act as: the fleet of tenant acme, and another tenant.
IDENTITIES = {
    "p0": "kvbroker://acme/engine/p0",  # acme's engines with live sessions
    "p1": "kvbroker://acme/engine/p1",
    "engine": "kvbroker://acme/engine/e1",
    "router": "kvbroker://acme/router/r1",
    "operator": "kvbroker://acme/operator/o1",
    "root": "kvbroker://*/operator/root",
    "other_engine": "kvbroker://globex/engine/g1",
    "other_router": "kvbroker://globex/router/g2",
    "other_operator": "kvbroker://globex/operator/g3",
    "hijacker": "kvbroker://globex/engine/p0",  # same engine id as acme's p0, other tenant
    "default_router": "kvbroker://default/router/d1",  # a tenant literally named "default"
}


@dataclass
class Pki:
    directory: Path
    ca: CertificateAuthority
    wrong_ca: CertificateAuthority
    server: Issued
    clients: dict[str, Issued] = field(default_factory=dict)
    wrong_client: Issued | None = None
    tokens: dict[str, Path] = field(default_factory=dict)
    tokens_file: Path | None = None

    def mtls(self, who: str | None) -> ClientSecurity:
        """Client security for `who` over mutual TLS (None: the CA only, no certificate)."""
        if who is None:
            return ClientSecurity(tls_ca=str(self.ca.cert))
        if who == "wrong_ca":
            assert self.wrong_client is not None
            return ClientSecurity(
                tls_ca=str(self.ca.cert),
                tls_cert=str(self.wrong_client.cert),
                tls_key=str(self.wrong_client.key),
            )
        issued = self.clients[who]
        return ClientSecurity(tls_ca=str(self.ca.cert), tls_cert=str(issued.cert), tls_key=str(issued.key))

    def token(self, who: str | None) -> ClientSecurity:
        """Client security for `who` with a bearer token over TLS (None: no token)."""
        if who is None:
            return ClientSecurity(tls_ca=str(self.ca.cert))
        return ClientSecurity(tls_ca=str(self.ca.cert), token_file=str(self.tokens[who]))


@pytest.fixture(scope="package")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    base = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority.create(base / "ca")
    wrong = CertificateAuthority.create(base / "wrong", name="someone else's CA")
    pki = Pki(base, ca, wrong, ca.server())
    for who, uri in IDENTITIES.items():
        pki.clients[who] = ca.client(who, uri)
    pki.wrong_client = wrong.client("wrong", IDENTITIES["operator"])
    lines = []
    for i, (who, uri) in enumerate(IDENTITIES.items()):
        secret = f"token-{i}-{who}-0123456789abcdef"
        path = base / "tokens" / f"{who}.token"
        path.parent.mkdir(exist_ok=True)
        path.write_text(secret + "\n")
        pki.tokens[who] = path
        lines.append(f"{secret} {uri}")
    wrong_token = base / "tokens" / "wrong.token"
    wrong_token.write_text("not-a-known-token\n")
    pki.tokens["wrong_token"] = wrong_token
    pki.tokens_file = base / "tokens.txt"
    pki.tokens_file.write_text("# test tokens\n" + "\n".join(lines) + "\n")
    return pki


def tls_args(pki: Pki, *, mutual: bool, tokens: bool) -> list[str]:
    args = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    if mutual:
        args += ["--tls-ca", str(pki.ca.cert)]
    if tokens:
        assert pki.tokens_file is not None
        args += ["--tokens-file", str(pki.tokens_file)]
    return args


@pytest.fixture(scope="module")
def mtls_broker(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    with BrokerProcess(tmp_path_factory.mktemp("mtls"), tls_args(pki, mutual=True, tokens=False)) as proc:
        yield proc


@pytest.fixture(scope="module")
def token_broker(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    with BrokerProcess(tmp_path_factory.mktemp("tokens"), tls_args(pki, mutual=False, tokens=True)) as proc:
        yield proc


def code_of(err: grpc.RpcError) -> grpc.StatusCode:
    code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
    return code

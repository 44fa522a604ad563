"""The broker rereads its certificate, key, client CA and tokens when the files change: no restart."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbroker.clients import errors
from kvbroker.clients.credentials import ClientSecurity
from kvbroker.clients.sync import BrokerClient
from testkit.certs import CertificateAuthority
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for


def _install(src: Path, dst: Path) -> None:
    tmp = dst.with_suffix(".new")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)  # as a certificate manager does: the file changes at once


def _answers(address: str, security: ClientSecurity) -> bool:
    try:
        with BrokerClient(address, security=security, timeout=3) as client:
            client.list_engines()
        return True
    except errors.BrokerError:
        return False


@pytest.mark.timeout(90)
def test_certificates_are_reloaded_for_new_connections(tmp_path: Path) -> None:
    old = CertificateAuthority.create(tmp_path / "old")
    new = CertificateAuthority.create(tmp_path / "new", name="renewed CA")
    live = tmp_path / "live"
    live.mkdir()
    for name, src in (
        ("ca.pem", old.cert),
        ("broker.pem", old.server().cert),
        ("broker.key", old.directory / "broker.key"),
    ):
        shutil.copyfile(src, live / name)
    args = [
        "--tls-cert",
        str(live / "broker.pem"),
        "--tls-key",
        str(live / "broker.key"),
        "--tls-ca",
        str(live / "ca.pem"),
    ]
    old_op = old.client("op", "kvbroker://*/operator/op")
    new_op = new.client("op", "kvbroker://*/operator/op")
    old_client = ClientSecurity(tls_ca=str(old.cert), tls_cert=str(old_op.cert), tls_key=str(old_op.key))
    new_client = ClientSecurity(tls_ca=str(new.cert), tls_cert=str(new_op.cert), tls_key=str(new_op.key))
    with BrokerProcess(tmp_path, args) as proc:
        assert _answers(proc.address, old_client)
        assert not _answers(proc.address, new_client)
        renewed = new.server()
        time.sleep(1.1)  # a different modification time than the first files
        _install(renewed.key, live / "broker.key")
        _install(renewed.cert, live / "broker.pem")
        _install(new.cert, live / "ca.pem")
        assert wait_for(lambda: _answers(proc.address, new_client), 20), proc.log_tail()
        assert not _answers(proc.address, old_client)
        assert "TLS certificate reloaded" in proc.log_tail(200)


@pytest.mark.timeout(90)
def test_tokens_are_reloaded(tmp_path: Path) -> None:
    ca = CertificateAuthority.create(tmp_path / "pki")
    server = ca.server()
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("first-token kvbroker://*/operator/op\n")
    args = ["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tokens-file", str(tokens)]
    mine = tmp_path / "my.token"
    mine.write_text("first-token")
    security = ClientSecurity(tls_ca=str(ca.cert), token_file=str(mine))
    with BrokerProcess(tmp_path, args) as proc:
        assert _answers(proc.address, security)
        time.sleep(1.1)
        _install_text(tokens, "second-token kvbroker://*/operator/op\n")
        assert wait_for(lambda: not _answers(proc.address, security), 10)  # the old token is revoked
        _install_text(mine, "second-token")  # and the client uses the new one
        assert _answers(proc.address, security)


def _install_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class RenewingClient:
    """A TLS broker and a client identity (router r1) whose files can be renewed as operator o1."""

    args: list[str]  # the broker's TLS flags
    security: ClientSecurity
    live: Path  # the client's certificate and key, as the client reads them
    operator: Any

    @classmethod
    def create(cls, tmp_path: Path) -> RenewingClient:
        ca = CertificateAuthority.create(tmp_path / "pki")
        server = ca.server()
        router = ca.client("router", "kvbroker://acme/router/r1")
        live = tmp_path / "live"
        live.mkdir()
        shutil.copyfile(router.cert, live / "me.pem")
        shutil.copyfile(router.key, live / "me.key")
        args = ["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-ca", str(ca.cert)]
        security = ClientSecurity(
            tls_ca=str(ca.cert), tls_cert=str(live / "me.pem"), tls_key=str(live / "me.key")
        )
        return cls(args, security, live, ca.client("operator", "kvbroker://acme/operator/o1"))

    def renew_as_operator(self) -> None:
        time.sleep(1.1)
        _install(self.operator.key, self.live / "me.key")
        _install(self.operator.cert, self.live / "me.pem")
        time.sleep(1.1)  # a client looks at its files at most once a second


@pytest.mark.timeout(60)
async def test_a_client_follows_its_renewed_certificate(tmp_path: Path) -> None:
    from kvbroker.clients.aio import AsyncBrokerClient

    renewing = RenewingClient.create(tmp_path)
    with BrokerProcess(tmp_path, renewing.args) as proc:
        async with AsyncBrokerClient(proc.address, security=renewing.security) as client:
            with pytest.raises(errors.PermissionDenied, match="acme/router/r1"):
                await client.list_leases()
            renewing.renew_as_operator()
            await client.list_leases()  # the same client, now as the operator


@pytest.mark.timeout(60)
def test_the_blocking_client_follows_its_renewed_certificate(tmp_path: Path) -> None:
    renewing = RenewingClient.create(tmp_path)
    with (
        BrokerProcess(tmp_path, renewing.args) as proc,
        BrokerClient(proc.address, security=renewing.security) as client,
    ):
        with pytest.raises(errors.PermissionDenied, match="acme/router/r1"):
            client.list_leases()
        renewing.renew_as_operator()
        client.list_leases()  # the same client, now as the operator

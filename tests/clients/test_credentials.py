"""Every client takes its credentials: the CLI's flags and variables, the library's environment, the proxy's flags."""

from __future__ import annotations

import io
import json

import pytest

from kvbroker.clients.credentials import ClientSecurity, CredentialError
from kvbroker.clients.sync import BrokerClient
from kvbroker.tools.cli import main
from testkit.processes import BrokerProcess
from tests.broker.security.conftest import Pki


def test_cli_flags_and_variables(
    mtls_broker: BrokerProcess, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    op = pki.clients["root"]
    out = io.StringIO()
    argv = ["--broker", mtls_broker.address, "--tls-ca", str(pki.ca.cert)]
    argv += ["--tls-cert", str(op.cert), "--tls-key", str(op.key), "stats", "--json"]
    assert main(argv, out) == 0
    assert "leases_by_state" in json.loads(out.getvalue())
    monkeypatch.setenv("KVBROKER_TLS_CA", str(pki.ca.cert))
    monkeypatch.setenv("KVBROKER_TLS_CERT", str(op.cert))
    monkeypatch.setenv("KVBROKER_TLS_KEY", str(op.key))
    assert main(["--broker", mtls_broker.address, "engines"], io.StringIO()) == 0
    with BrokerClient(mtls_broker.address) as client:  # the library reads the same variables
        client.stats()
    monkeypatch.delenv("KVBROKER_TLS_CERT")
    monkeypatch.delenv("KVBROKER_TLS_KEY")
    assert main(["--broker", mtls_broker.address, "--timeout", "2", "engines"], io.StringIO()) == 3  # no cert


def test_credentials_are_never_sent_in_plaintext(pki: Pki) -> None:
    with pytest.raises(CredentialError, match="tls_ca"):
        ClientSecurity(token_file=str(pki.tokens["operator"])).channel_credentials()
    with pytest.raises(CredentialError, match="tls_ca"):
        BrokerClient("127.0.0.1:1", security=ClientSecurity(tls_cert="c.pem", tls_key="k.pem"))


def test_proxy_takes_broker_credentials_from_flags(pki: Pki) -> None:
    from kvbroker.clients.proxy.config import build_parser, config_from_args

    args = build_parser().parse_args(
        ["--broker", "b:1", "--tls-ca", str(pki.ca.cert), "--token-file", str(pki.tokens["router"])]
    )
    config = config_from_args(args)
    assert config.security == ClientSecurity(tls_ca=str(pki.ca.cert), token_file=str(pki.tokens["router"]))

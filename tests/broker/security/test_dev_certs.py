"""scripts/dev_certs.py writes every file docker-compose.yml names, and a broker serves mutual TLS with them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvbroker.clients.credentials import ClientSecurity
from kvbroker.clients.sync import BrokerClient
from testkit.processes import BrokerProcess

ROOT = Path(__file__).resolve().parents[3]


def test_dev_certificates_cover_the_compose_file_and_work(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "dev_certs.py"), str(certs)], check=True, timeout=60
    )
    compose = (ROOT / "docker-compose.yml").read_text()
    named = set(re.findall(r"/certs/([\w.]+)", compose)) | set(re.findall(r"r\('([\w.]+)'\)", compose))
    assert {
        "broker.pem",
        "broker.key",
        "ca.pem",
        "prefill.pem",
        "decode.pem",
        "proxy.pem",
        "health.pem",
    } <= named
    assert all((certs / name).is_file() for name in named), named - {p.name for p in certs.iterdir()}
    args = ["--tls-cert", str(certs / "broker.pem"), "--tls-key", str(certs / "broker.key")]
    args += ["--tls-ca", str(certs / "ca.pem")]
    with BrokerProcess(tmp_path, args) as proc:
        admin = ClientSecurity(
            tls_ca=str(certs / "ca.pem"), tls_cert=str(certs / "admin.pem"), tls_key=str(certs / "admin.key")
        )
        with BrokerClient(proc.address, security=admin) as client:
            assert client.stats().engines == 0

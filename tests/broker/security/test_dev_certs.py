"""scripts/dev_certs.py writes every file docker-compose.yml names, and a broker serves mutual TLS with them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvbroker.clients.credentials import ClientSecurity
from kvbroker.clients.sync import BrokerClient
from testkit.processes import BrokerProcess

ROOT = Path(__file__).resolve().parents[3]  # tests/broker/security/ -> the repository


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


def test_prometheus_scrapes_the_broker_as_compose_configures_it(tmp_path: Path) -> None:
    """The broker's /metrics off loopback is HTTPS for operators of '*'; deploy/prometheus.yml's
    broker job, with the dev certificates, reads it (and docker-compose.yml sets the host)."""
    import http.client
    import socket
    import ssl

    import pytest

    from testkit.ports import free_port

    yaml = pytest.importorskip("yaml")
    certs = tmp_path / "certs"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "dev_certs.py"), str(certs)], check=True, timeout=60
    )
    broker_env = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["broker"][
        "environment"
    ]
    job = next(
        j
        for j in yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"]
        if j["job_name"] == "broker"
    )
    tls = {
        key: str(certs / Path(value).name) if key != "server_name" else value
        for key, value in job["tls_config"].items()
    }
    assert job["scheme"] == "https"
    port = free_port()
    args = ["--tls-cert", str(certs / "broker.pem"), "--tls-key", str(certs / "broker.key")]
    args += ["--tls-ca", str(certs / "ca.pem"), "--metrics-port", str(port)]
    args += ["--metrics-host", broker_env["KVBROKER_METRICS_HOST"]]
    with BrokerProcess(tmp_path, args) as proc:
        context = ssl.create_default_context(cafile=tls["ca_file"])
        context.load_cert_chain(tls["cert_file"], tls["key_file"])
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        conn = http.client.HTTPSConnection(tls["server_name"], port, context=context, timeout=10)
        conn.sock = context.wrap_socket(raw, server_hostname=tls["server_name"])
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200 and b"kvbroker_engines" in response.read(), proc.log_tail()

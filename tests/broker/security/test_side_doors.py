"""The side doors of a secured broker, on real broker processes: TLS without identities on a
network address, /metrics, the tokens file, the indexer's connection slots and --help."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvbroker.clients import errors
from kvbroker.clients.credentials import ClientSecurity
from kvbroker.clients.sync import BrokerClient
from testkit.ports import free_port
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for
from tests.broker.security.conftest import Pki, tls_args

pytestmark = pytest.mark.timeout(120)


def _answers(address: str, security: ClientSecurity) -> bool:
    try:
        with BrokerClient(address, security=security, timeout=5) as client:
            client.list_engines()
        return True
    except errors.BrokerError:
        return False


# -- TLS without client identities ------------------------------------------------------


def test_tls_without_identities_on_a_network_address_needs_insecure(pki: Pki, tmp_path: Path) -> None:
    tls_only = tls_args(pki, mutual=False, tokens=False)
    proc = BrokerProcess(tmp_path, [*tls_only, "--address", "0.0.0.0:0"], log_name="refused.log")
    with pytest.raises(RuntimeError, match="--tls-ca") as refused:
        proc.start(timeout=20)
    assert "--tokens-file" in str(refused.value) and "--insecure" in str(refused.value)
    args = [*tls_only, "--address", "0.0.0.0:0", "--insecure"]
    with BrokerProcess(tmp_path, args, log_name="insecure.log") as ok:
        assert "TLS without client identities" in ok.log_tail()
    # On loopback it stays allowed, as plaintext is.
    with BrokerProcess(tmp_path, tls_only, log_name="loopback.log") as local:
        assert _answers(local.address, pki.token(None))


# -- /metrics -----------------------------------------------------------------------------


def _listening_on(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def _non_loopback_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only picks the outgoing interface
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_metrics_listen_on_loopback_by_default(tmp_path: Path) -> None:
    port = free_port()
    with BrokerProcess(tmp_path, ["--metrics-port", str(port)]) as proc:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kvbroker_engines" in text, proc.log_tail()
        ip = _non_loopback_ip()
        if ip is not None:
            assert not _listening_on(port, ip), f"/metrics answers on {ip}"


def test_plain_metrics_on_a_network_address_need_insecure(tmp_path: Path) -> None:
    port = free_port()
    args = ["--metrics-port", str(port), "--metrics-host", "0.0.0.0"]
    with pytest.raises(RuntimeError, match="--insecure"):
        BrokerProcess(tmp_path, args, log_name="refused.log").start(timeout=20)
    with BrokerProcess(tmp_path, [*args, "--insecure"], log_name="insecure.log"):
        assert (
            "kvbroker_engines"
            in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        )


def _scrape_https(pki: Pki, port: int, who: str | None) -> int:
    context = ssl.create_default_context(cafile=str(pki.ca.cert))
    if who is not None:
        context.load_cert_chain(str(pki.clients[who].cert), str(pki.clients[who].key))
    conn = http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read().decode(errors="replace")
        assert response.status != 200 or "kvbroker_engines" in body
        return response.status
    except (ssl.SSLError, ConnectionError):
        return 0  # the handshake was refused
    finally:
        conn.close()


def test_metrics_of_an_mtls_broker_on_a_network_address_are_https_for_operators(
    pki: Pki, tmp_path: Path
) -> None:
    port = free_port()
    args = [
        *tls_args(pki, mutual=True, tokens=False),
        "--metrics-port",
        str(port),
        "--metrics-host",
        "0.0.0.0",
    ]
    with BrokerProcess(tmp_path, args) as proc:
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert _scrape_https(pki, port, "root") == 200, proc.log_tail()
        assert _scrape_https(pki, port, "router") == 403  # a tenant's router sees no fleet-wide names
        assert _scrape_https(pki, port, "operator") == 403  # nor a tenant's operator
        assert _scrape_https(pki, port, None) == 0  # no certificate: no handshake


# -- the tokens file fails closed ---------------------------------------------------------


def _install_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.mark.timeout(90)
def test_tokens_file_fails_closed(pki: Pki, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("keep-token kvbroker://*/operator/keep\nrevoke-token kvbroker://*/operator/gone\n")
    metrics = free_port()
    args = [
        *tls_args(pki, mutual=False, tokens=False),
        "--tokens-file",
        str(tokens),
        "--metrics-port",
        str(metrics),
    ]
    keep, gone = tmp_path / "keep.token", tmp_path / "gone.token"
    keep.write_text("keep-token")
    gone.write_text("revoke-token")
    as_keep = ClientSecurity(tls_ca=str(pki.ca.cert), token_file=str(keep))
    as_gone = ClientSecurity(tls_ca=str(pki.ca.cert), token_file=str(gone))
    with BrokerProcess(tmp_path, args) as proc:
        assert _answers(proc.address, as_keep) and _answers(proc.address, as_gone)
        # One edit revokes a token and has a typo in another line: the revocation holds,
        # the typo grants nothing, the good line still works.
        _install_text(tokens, "keep-token kvbroker://*/operator/keep\nbroken-line-without-identity\n")
        assert wait_for(lambda: not _answers(proc.address, as_gone), 10), proc.log_tail()
        assert _answers(proc.address, as_keep)
        assert "line rejected" in proc.log_tail(80)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
        assert "kvbroker_tokens_file_rejected_lines 1.0" in text and "kvbroker_tokens 1.0" in text
        # Deleting the file revokes every token.
        tokens.unlink()
        assert wait_for(lambda: not _answers(proc.address, as_keep), 10), proc.log_tail()
        assert "EVERY token is revoked" in proc.log_tail(80)
        # Back, it counts again.
        _install_text(tokens, "keep-token kvbroker://*/operator/keep\n")
        assert wait_for(lambda: _answers(proc.address, as_keep), 10), proc.log_tail()


# -- the indexer's connection slots -------------------------------------------------------


def _indexer_get(pki: Pki, port: int, token_of: str) -> int:
    context = ssl.create_default_context(cafile=str(pki.ca.cert))
    conn = http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
    try:
        token = Path(pki.tokens[token_of]).read_text().strip()
        conn.request("GET", "/workers", headers={"Authorization": f"Bearer {token}"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


@pytest.mark.timeout(120)
def test_idle_strangers_cannot_keep_an_operator_out_of_the_indexer(pki: Pki, tmp_path: Path) -> None:
    port = free_port()
    args = [*tls_args(pki, mutual=True, tokens=True), "--indexer-http", f"127.0.0.1:{port}"]
    context = ssl.create_default_context(cafile=str(pki.ca.cert))
    idle: list[ssl.SSLSocket] = []
    with BrokerProcess(tmp_path, args) as proc:
        try:
            # 300 strangers finish the TLS handshake (no certificate: tokens are another way in),
            # then say nothing.
            for _ in range(300):
                raw = socket.create_connection(("127.0.0.1", port), timeout=10)
                idle.append(context.wrap_socket(raw, server_hostname="localhost"))
            assert _indexer_get(pki, port, "operator") == 200, proc.log_tail()
        finally:
            for s in idle:
                s.close()


def test_an_idle_handshake_is_closed_fast(pki: Pki, tmp_path: Path) -> None:
    port = free_port()
    args = [*tls_args(pki, mutual=True, tokens=True), "--indexer-http", f"127.0.0.1:{port}"]
    with BrokerProcess(tmp_path, args), socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        started = time.monotonic()
        assert raw.recv(1) == b""  # no ClientHello: the broker hangs up
        assert time.monotonic() - started < 15  # HANDSHAKE_TIMEOUT_S (5 s), not asyncio's 60 s


# -- secrets in --help ----------------------------------------------------------------------


def test_help_does_not_print_the_state_password() -> None:
    env = {**os.environ, "KVBROKER_STATE": "redis://:hunter2-s3cret@redis.example:6379/0"}
    out = subprocess.run(
        [sys.executable, "-m", "kvbroker.broker", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "hunter2-s3cret" not in out.stdout + out.stderr
    assert "redis://***@redis.example:6379/0" in " ".join(out.stdout.split())
    # The lease memory budget and the cap derived from it are there to read.
    assert "--lease-memory-mib" in out.stdout and "leases at the defaults" in " ".join(out.stdout.split())

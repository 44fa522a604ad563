"""OTEL_* variables, honoured the same way by the broker, the engine adapter, the proxy and the launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvbroker.broker import tracing as broker_tracing
from kvbroker.broker.errors import NotFound
from kvbroker.clients.proxy import tracing as proxy_tracing
from kvbroker.common import telemetry
from kvbroker.common.causes import Cause
from kvbroker.engine_adapter import tracing as adapter_tracing
from kvbroker.tools.launch import EngineProcess, vllm_otlp_traces_endpoint

ROOT = Path(__file__).resolve().parents[2]
OTEL_VARIABLES = (
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _service_name(provider: TracerProvider | None) -> str:
    assert provider is not None
    return str(provider.resource.attributes["service.name"])


def _exporters(default: str = "kvbroker") -> list[object]:
    return telemetry._exporters(telemetry.trace_settings(default))


def test_service_name_follows_otel_service_name_in_every_program(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    assert _service_name(broker_tracing.make_tracer_provider(exporter=exporter)) == "kvbroker"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attributes,team=kv")
    assert _service_name(broker_tracing.make_tracer_provider(exporter=exporter)) == "from-attributes"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "broker-eu-1")
    assert _service_name(broker_tracing.make_tracer_provider(exporter=exporter)) == "broker-eu-1"
    for default in (adapter_tracing.SERVICE_NAME, proxy_tracing.SERVICE_NAME):
        assert _service_name(telemetry.tracer_provider(default, exporter=exporter)) == "broker-eu-1"


def test_the_adapter_tracer_carries_the_service_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "vllm-decode")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    adapter_tracing.set_tracer(None)
    try:
        tracer = adapter_tracing.get_tracer()
        assert tracer.resource.attributes["service.name"] == "vllm-decode"  # type: ignore[attr-defined]
    finally:
        adapter_tracing.set_tracer(None)


def test_traces_exporter_none_console_and_otlp(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _exporters() == []  # otlp without an endpoint: nothing is sent anywhere
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert [type(e) for e in _exporters()] == [GrpcExporter]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert broker_tracing.make_tracer_provider() is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert [type(e) for e in _exporters()] == [ConsoleSpanExporter]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,console")
    assert sorted(type(e).__name__ for e in _exporters()) == ["ConsoleSpanExporter", "OTLPSpanExporter"]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(telemetry.TelemetryError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        _exporters()


def test_otlp_protocol_grpc_or_http(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    (exporter,) = _exporters()
    assert isinstance(exporter, HttpExporter)
    assert exporter._endpoint == "http://collector:4318/v1/traces"
    # The broker's own flag is a base endpoint too; a traces endpoint is used as it is.
    (exporter,) = telemetry._exporters(telemetry.trace_settings("kvbroker", "http://flag:4318"))
    assert exporter._endpoint == "http://flag:4318/v1/traces"  # type: ignore[attr-defined]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/custom/traces")
    (exporter,) = _exporters()
    assert exporter._endpoint == "http://collector:4318/custom/traces"  # type: ignore[attr-defined]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(telemetry.TelemetryError, match="use grpc or http/protobuf"):
        _exporters()


def test_http_protobuf_without_its_package_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(telemetry.TelemetryError, match="pip install opentelemetry-exporter-otlp-proto-http"):
        broker_tracing.make_tracer_provider()
    adapter_tracing.set_tracer(None)  # the engine keeps serving, without spans
    try:
        assert adapter_tracing.get_tracer() is not None
    finally:
        adapter_tracing.set_tracer(None)


def test_serve_reports_a_bad_otel_setting_on_stderr() -> None:
    env = dict(
        os.environ, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1", OTEL_EXPORTER_OTLP_PROTOCOL="thrift"
    )
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "kvbroker.tools.cli", "serve", "--address", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "invalid configuration: OTEL_EXPORTER_OTLP_PROTOCOL='thrift'" in result.stderr


def test_status_code_is_an_int_on_session_commands_too() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    carrier = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    with broker_tracing.command_span(tracer, "Renew", carrier):
        pass
    with pytest.raises(NotFound), broker_tracing.command_span(tracer, "Release", carrier):
        raise NotFound("unknown lease 'x'", Cause.UNKNOWN_LEASE)
    ok, failed = exporter.get_finished_spans()
    assert ok.attributes is not None and ok.attributes["rpc.grpc.status_code"] == 0
    assert failed.attributes is not None
    assert failed.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert failed.status.status_code == StatusCode.ERROR


def test_the_launcher_gives_vllm_the_otlp_endpoint(tmp_path: Path) -> None:
    assert vllm_otlp_traces_endpoint({}) == ""
    grpc_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    assert vllm_otlp_traces_endpoint(grpc_env) == "http://collector:4317"
    http_env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    assert vllm_otlp_traces_endpoint(http_env) == "http://c:4318/v1/traces"
    assert vllm_otlp_traces_endpoint({**grpc_env, "OTEL_TRACES_EXPORTER": "none"}) == ""
    command = EngineProcess(tmp_path, env=grpc_env, log_path=tmp_path / "e.log").command()
    assert command[command.index("--otlp-traces-endpoint") + 1] == "http://collector:4317"
    # vLLM's tracing needs its per-request stats (it asserts them): stats stay on.
    assert "--disable-log-stats" not in command
    quiet = EngineProcess(tmp_path, env={}, log_path=tmp_path / "e.log").command()
    assert "--otlp-traces-endpoint" not in quiet and "--disable-log-stats" in quiet


def test_the_compose_engine_entrypoint_passes_the_otlp_endpoint(tmp_path: Path) -> None:
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
        "MODEL": "m",
        "ENGINE_ID": "decode",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4317",
    }
    script = str(ROOT / "deploy" / "engine-entrypoint.sh")
    args = subprocess.run(["sh", script], env=env, capture_output=True, text=True, check=True).stdout
    lines = args.splitlines()
    assert lines[lines.index("--otlp-traces-endpoint") + 1] == "http://otel-collector:4317"
    env["OTEL_TRACES_EXPORTER"] = "none"
    args = subprocess.run(["sh", script], env=env, capture_output=True, text=True, check=True).stdout
    assert "--otlp-traces-endpoint" not in args

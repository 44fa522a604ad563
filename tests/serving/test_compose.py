"""docker-compose.yml and deploy/: valid where docker compose exists, consistent with our flags everywhere."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def _compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _compose_available(), reason="the docker compose plugin is not installed")
def test_docker_compose_config_accepts_the_file() -> None:
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def _load() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(COMPOSE.read_text())


def test_services_are_wired_with_health_checks() -> None:
    services = _load()["services"]
    assert set(services) == {"broker", "prefill", "decode", "proxy", "otel-collector", "jaeger"}
    for name in ("broker", "prefill", "decode", "proxy"):
        assert "test" in services[name]["healthcheck"], name
    assert services["proxy"]["depends_on"]["decode"]["condition"] == "service_healthy"
    assert services["prefill"]["depends_on"]["broker"]["condition"] == "service_healthy"
    for name in ("broker", "prefill", "decode", "proxy"):
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"


def test_files_the_compose_file_names_exist() -> None:
    services = _load()["services"]
    for service in services.values():
        build = service.get("build")
        if build:
            assert (ROOT / build["dockerfile"]).is_file(), build
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).is_file(), volume
    assert (ROOT / "deploy" / "engine-entrypoint.sh").stat().st_mode & 0o111


def test_proxy_environment_uses_real_proxy_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbroker.clients.proxy.config import build_parser, config_from_args

    env = _load()["services"]["proxy"]["environment"]
    for key, value in env.items():
        if key.startswith("KVBROKER_") or key.startswith("OTEL_EXPORTER_OTLP_ENDPOINT"):
            monkeypatch.setenv(key, re.sub(r"\$\{[^}:]+:-([^}]*)\}", r"\1", str(value)))
    config = config_from_args(build_parser().parse_args([]))
    assert config.broker == "broker:50051" and config.port == 8000
    assert [(e.role, e.engine_id, e.url) for e in config.engines] == [
        ("prefill", "prefill", "http://prefill:8000"),
        ("decode", "decode", "http://decode:8000"),
    ]
    assert config.otlp_endpoint == "http://otel-collector:4317"
    help_text = build_parser().format_help()
    for key in env:
        if key.startswith("KVBROKER_PROXY_"):
            assert key in help_text, f"{key} is not a documented proxy variable"


def test_broker_environment_names_broker_flags() -> None:
    from kvbroker.broker.config import BrokerConfig, env_name

    known = {env_name(f) for f in BrokerConfig.__dataclass_fields__}
    for key in _load()["services"]["broker"]["environment"]:
        if key.startswith("KVBROKER_"):
            assert key in known, key


def test_engine_entrypoint_sets_only_known_connector_keys() -> None:
    from kvbroker.engine_adapter.config import AdapterConfig

    script = (ROOT / "deploy" / "engine-entrypoint.sh").read_text()
    extra = script.split('"kv_connector_extra_config":', 1)[1]
    keys = set(re.findall(r'"(\w+)":', extra))
    assert keys and keys <= set(AdapterConfig.__dataclass_fields__), keys - set(
        AdapterConfig.__dataclass_fields__
    )
    assert '"kv_connector": "BrokerConnector"' in script


def test_images_copy_every_folder_of_the_package() -> None:
    """Each source folder pyproject maps into `kvbroker` is copied into both images."""
    import tomllib

    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].values()
    tops = {Path(folder).parts[0] for folder in folders}
    for dockerfile in ("Dockerfile.broker", "Dockerfile.engine"):
        text = (ROOT / "deploy" / dockerfile).read_text()
        for top in tops:
            assert f"COPY {top} ./{top}" in text, f"{dockerfile} does not copy {top}/"

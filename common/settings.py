"""One idiom for every knob: a frozen dataclass whose fields carry their help text.

    @dataclass(frozen=True)
    class ProxyConfig:
        port: int = setting(8000, "listen port")

Every configuration (the broker's flags, the proxy's flags, the adapter's
``kv_connector_extra_config`` keys) is such a dataclass, read through:

- `add_arguments(parser, cls, env_prefix=...)`: one ``--flag`` per field
  (underscores become dashes), whose default comes from the environment
  variable ``<env_prefix><FIELD>`` (or the field's own ``env=``), else the
  field's default. The flag wins over the variable, the variable over the
  default. Help names the variable and the default.
- `from_args(cls, args, **others)`: the dataclass from parsed flags.
- `from_mapping(cls, mapping, what=...)`: the dataclass from a dict (vLLM's
  extra config, JSON), refusing unknown keys and coercing ``"64"``/``"true"``.
- `describe(cls, env_prefix=...)`: (name, env, default, help) rows, for docs
  and tests.

Types: str, int, float and bool fields are flags; a bool that defaults to
True is turned off with ``--no-<flag>``. Fields made with ``flag=False`` (lists
and the like) are left to the caller's own arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class SettingError(ValueError):
    """A value cannot be used; the message names the setting and what it must be."""


def setting(
    default: Any,
    help: str,
    *,
    env: str | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    flag: bool = True,
) -> Any:
    """A dataclass field with its help text (and, optionally, its own environment variable)."""
    metadata = {
        "help": help,
        "env": env,
        "choices": tuple(choices) if choices else None,
        "metavar": metavar,
        "flag": flag,
    }
    return dataclasses.field(default=default, metadata=metadata)


class Row(NamedTuple):
    name: str
    env: str
    default: Any
    help: str


def coerce(value: Any, kind: type, what: str) -> Any:
    """`value` as `kind` (str, int, float or bool); JSON-ish strings ("64", "true") are accepted."""
    if kind not in (str, int, float, bool):
        raise SettingError(f"{what}: settings of type {kind.__name__} are not supported")
    try:
        if kind is bool:
            if not isinstance(value, str):
                return bool(value)
            lowered = value.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError(value)
        if kind is not str and isinstance(value, bool):
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError):
        raise SettingError(f"{what} = {value!r} is not a valid {kind.__name__}") from None


def _fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag", True) and "help" in f.metadata]


def _kind(f: dataclasses.Field[Any]) -> type:
    return type(f.default) if f.default is not dataclasses.MISSING else str


def env_name(f: dataclasses.Field[Any], env_prefix: str) -> str:
    return f.metadata.get("env") or env_prefix + f.name.upper()


def describe(cls: type, env_prefix: str = "") -> list[Row]:
    return [
        Row(
            f.name,
            env_name(f, env_prefix) if env_prefix or f.metadata.get("env") else "",
            f.default,
            f.metadata["help"],
        )
        for f in _fields(cls)
    ]


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    env_prefix: str,
    *,
    error: Any = None,
    repeated: bool = False,
) -> None:
    """One flag per field of `cls`; see the module docstring. `error(msg)` reports a bad variable.

    `repeated=True` adds the same flags again to a subcommand's parser (so they also work after
    the command): there they have no default of their own and leave the first parse's value alone.
    """
    for f in _fields(cls):
        kind = _kind(f)
        env = env_name(f, env_prefix)
        raw = os.environ.get(env)
        default = f.default
        if raw is not None:
            try:
                default = coerce(raw, kind, env)
            except SettingError as exc:
                if error is None:
                    raise
                error(str(exc))
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata['help']} [env {env}; default: %(default)s]"
        if repeated:
            default = argparse.SUPPRESS
            help_text = f.metadata["help"]
        if kind is bool:
            if f.default:
                parser.add_argument(
                    "--no-" + f.name.replace("_", "-"),
                    dest=f.name,
                    action="store_false",
                    default=default,
                    help=f.metadata["help"]
                    if repeated
                    else f"turn off {f.name}: {f.metadata['help']} [env {env}=0; default: on]",
                )
            else:
                parser.add_argument(flag, dest=f.name, action="store_true", default=default, help=help_text)
            continue
        parser.add_argument(
            flag,
            dest=f.name,
            type=kind,
            default=default,
            choices=f.metadata.get("choices"),
            metavar=None if f.metadata.get("choices") else f.metadata.get("metavar") or kind.__name__.upper(),
            help=help_text,
        )


def from_args(cls: type, args: argparse.Namespace, **others: Any) -> Any:
    """`cls` from the flags `add_arguments` made, plus `others` (fields with flag=False)."""
    values = {f.name: getattr(args, f.name) for f in _fields(cls)}
    return cls(**values, **others)


def from_mapping(cls: type, mapping: Mapping[str, Any] | None, what: str) -> Any:
    """`cls` from a dict, e.g. vLLM's kv_connector_extra_config (`what` names it in errors)."""
    given = dict(mapping or {})
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise SettingError(f"unknown {what} key(s) {unknown}; known keys: {sorted(known)}")
    values = {name: coerce(value, _kind(known[name]), f"{what}[{name!r}]") for name, value in given.items()}
    return cls(**values)

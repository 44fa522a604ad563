"""The fleet benchmark's stock engines start once more on new ports when a port was taken."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.fleet import setups


def _ctx(tmp_path: Path) -> setups.Context:
    return setups.Context(model=tmp_path, work=tmp_path, engines=2, start_timeout_s=1.0)


def test_a_taken_port_starts_the_stock_engines_once_more(tmp_path: Path, monkeypatch: Any) -> None:
    tries: list[int] = []
    stock = object()

    def start(ctx: setups.Context) -> object:
        tries.append(1)
        if len(tries) == 1:
            raise setups._PortTaken("vllm-0: a port was taken while the engines started")
        return stock

    monkeypatch.setattr(setups, "_start_stock", start)
    ctx = _ctx(tmp_path)
    assert setups._stock(ctx) is stock and len(tries) == 2
    assert setups._stock(ctx) is stock and len(tries) == 2, "started once, then shared"


def test_a_port_taken_twice_or_another_failure_is_raised(tmp_path: Path, monkeypatch: Any) -> None:
    def taken(ctx: setups.Context) -> object:
        raise setups._PortTaken("vllm-1: a port was taken while the engines started")

    monkeypatch.setattr(setups, "_start_stock", taken)
    with pytest.raises(setups._PortTaken, match="vllm-1"):
        setups._stock(_ctx(tmp_path))

    def broken(ctx: setups.Context) -> object:
        raise setups.EngineStartError("vllm-0 exited with code 1 while starting")

    monkeypatch.setattr(setups, "_start_stock", broken)
    with pytest.raises(setups.EngineStartError):
        setups._stock(_ctx(tmp_path))

"""A real vLLM engine starts from the tiny model, answers greedily and stops cleanly."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from kvbroker.tools.launch import EngineProcess, EngineStartError

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_engine_serves_greedy_completions_deterministically(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    engine = EngineProcess(tiny_model_dir, name="launch-test", log_path=tmp_path / "engine.log")
    with engine:
        assert engine.is_healthy()
        body = {
            "model": str(tiny_model_dir),
            "prompt": "tell me about the cache",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        }
        first = _post(f"{engine.url}/v1/completions", body)
        second = _post(f"{engine.url}/v1/completions", body)
        assert first["usage"]["completion_tokens"] == 12
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        chat = _post(
            f"{engine.url}/v1/chat/completions",
            {
                "model": str(tiny_model_dir),
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert chat["usage"]["completion_tokens"] == 4
        # Pinning (the P/D benchmarks give P and D cores of their own): every thread of the
        # scheduler and worker processes, the API server left free; the engine still answers.
        cpus = sorted(os.sched_getaffinity(0))
        # One process (the engine core runs the model: EngineProcess.one_process_worker), else two.
        assert engine.pin_engine_cpus({cpus[0]}) == (1 if engine.one_process_worker else 2)
        for proc_pid, name, _state in engine._group_processes():
            for tid in os.listdir(f"/proc/{proc_pid}/task"):
                allowed = os.sched_getaffinity(int(tid))
                pinned = name.startswith(("VLLM::Worker", "VLLM::EngineCor"))
                assert allowed == ({cpus[0]} if pinned else set(cpus)), (name, tid)
        assert (
            _post(f"{engine.url}/v1/completions", body)["choices"][0]["text"] == first["choices"][0]["text"]
        )
        pid = engine.pid
    assert pid is not None
    assert engine.proc is not None and engine.proc.poll() is not None
    assert not engine.group_alive()  # engine core and workers are gone too


def test_bad_model_dir_fails_fast_with_log(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    engine = EngineProcess(tmp_path / "missing-model", name="bad", log_path=tmp_path / "bad.log")
    engine.start()
    try:
        with pytest.raises(EngineStartError, match="exited with code"):
            engine.wait_ready(timeout=120)
    finally:
        engine.stop()


def test_log_tail_reads_the_last_lines_or_the_whole_log(tmp_path: Path) -> None:
    engine = EngineProcess(tmp_path, name="logged", log_path=tmp_path / "logged.log")
    assert engine.log_tail() == engine.log_tail(None) == "", "no log yet"
    (tmp_path / "logged.log").write_text("".join(f"line {i}\n" for i in range(100)))
    assert engine.log_tail(2) == "line 98\nline 99"
    assert engine.log_tail().splitlines()[0] == "line 60"
    assert engine.log_tail(None).startswith("line 0\n") and engine.log_tail(None).endswith("line 99\n")


class _Pinned:
    def __init__(self, name: str) -> None:
        self.name = name
        self.cpus: set[int] | None = None

    def pin_engine_cpus(self, cpus: set[int]) -> int:
        self.cpus = cpus
        return 2


def test_pin_apart_gives_each_engine_cores_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the demo and the P/D benchmarks do with their engines (real pinning: the test above)."""
    from kvbroker.tools import launch

    said: list[str] = []
    p, d = _Pinned("prefill-0"), _Pinned("decode-0")
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _pid: {0, 1, 2}, raising=False)
    assert launch.pin_apart([p, d], said.append) == [[0], [1, 2]]  # type: ignore[list-item]
    assert (p.cpus, d.cpus) == ({0}, {1, 2})
    assert said == [
        "prefill-0: scheduler and worker pinned to cores [0] (2 processes)",
        "decode-0: scheduler and worker pinned to cores [1, 2] (2 processes)",
    ]
    lone = _Pinned("x")
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    assert launch.pin_apart([lone, _Pinned("y")]) == [] and lone.cpus is None, "one core: nothing pinned"

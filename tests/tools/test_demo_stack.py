"""The demo stack's supervisor with a real child process: killed, it is started again with a
growing wait, says so, and stops restarting once stopped. (The broker under it, with real engines
riding through: tests/e2e/test_hung_engine_e2e.py.)"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvbroker.tools.demo_stack import Supervisor
from testkit.processes import ChildProcess
from testkit.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


def test_a_killed_child_is_restarted_with_backoff(tmp_path: Path) -> None:
    child = ChildProcess(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "sleeper.log"
    ).start()
    said: list[str] = []
    supervisor = Supervisor(child, min_backoff_s=0.2, max_backoff_s=0.4, report=said.append).start()
    try:
        for n in (1, 2, 3):
            pid = child.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            assert wait_for(lambda n=n: supervisor.restarts == n and child.alive(), timeout=10)
            waited = time.monotonic() - killed
            assert waited >= (0.2 if n == 1 else 0.4) - 0.05
            assert child.pid != pid
        assert said[0] == (
            f"!! the sleeper exited (code -9); starting it again in 0.2 s (engines and proxy stay up and "
            f"reconnect; log: {tmp_path / 'sleeper.log'})"
        )
        assert said[1].startswith("!! the sleeper is running again (pid ") and said[1].endswith("restart 1)")
    finally:
        supervisor.stop()
        child.stop()
    assert not child.alive()
    time.sleep(0.5)
    assert supervisor.restarts == 3  # stopped: no restart after the stack's own stop


def test_the_demo_names_its_log_folder_on_success_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that went well keeps its logs as well: the folder is named at start and at the end."""
    from kvbroker.tools import demo

    seen: dict[str, object] = {}

    class NoStack:
        def stop(self) -> None:
            pass

    def fake_start(workdir: Path, **kw: object) -> NoStack:
        seen.update(kw)
        return NoStack()

    monkeypatch.setattr(demo, "start_stack", fake_start)
    monkeypatch.setattr(demo.signal, "signal", lambda *a: None)
    assert demo.main(["--turns", "0", "--workdir", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert out.count(str(tmp_path / "w")) >= 2, out
    assert seen["threshold"] is None, "the demo runs the adaptive policy unless a threshold is named"
    assert seen["topology"] == "pd", "P/D unless a topology is named"
    assert demo.main(["--turns", "0", "--workdir", str(tmp_path / "w"), "--topology", "dp:3"]) == 0
    assert seen["topology"] == "dp:3"


def test_topologies_are_p_d_or_n_data_parallel_engines() -> None:
    from kvbroker.tools.demo_stack import parse_topology

    assert parse_topology("pd") == ("pd", 2)
    assert parse_topology("dp:4") == ("dp", 4) and parse_topology(" DP ") == ("dp", 2)
    for bad in ("pd:3", "dp:0", "dp:9", "dp:x", "ring"):
        with pytest.raises(ValueError, match="choose one of pd, dp:N"):
            parse_topology(bad)


def test_the_demo_refuses_an_unknown_topology(capsys: pytest.CaptureFixture[str]) -> None:
    from kvbroker.tools import demo

    with pytest.raises(SystemExit):
        demo.main(["--topology", "dp:99"])
    assert "choose one of pd, dp:N" in capsys.readouterr().err


def test_the_demo_prints_its_figures_with_their_workload() -> None:
    from kvbroker.tools.demo import workload_line

    rows = [
        {"prompt_tokens": 500, "answer_tokens": 64},
        {"prompt_tokens": 700, "answer_tokens": 64},
        {"prompt_tokens": 900, "answer_tokens": 64},
    ]
    line = workload_line(rows, 5.0, 2)
    assert "follow-ups of 136, 136 tokens" in line and "1 chat, one request at a time" in line
    assert "1 core" in line and "load average 5.0 on 2 cores (measured under load" in line
    assert "under load" not in workload_line(rows, 1.0, 2)


class _StandInEngine:
    """What start_stack asks of an engine, without vLLM (a real one: tests/e2e/test_serving_e2e.py)."""

    started: list[_StandInEngine] = []

    def __init__(self, model_dir: Path, *, name: str, **_: object) -> None:
        self.name, self.url, self.stopped = name, f"http://127.0.0.1:1/{name}", False

    def start(self) -> _StandInEngine:
        _StandInEngine.started.append(self)
        return self

    def wait_ready(self, **_: object) -> float:
        return 0.0

    def stop(self) -> None:
        self.stopped = True


def _stand_in_parts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvbroker.tools import demo_stack

    _StandInEngine.started = []
    monkeypatch.setattr(demo_stack, "model_folder", lambda model, workdir: tmp_path / "model")
    monkeypatch.setattr(demo_stack, "EngineProcess", _StandInEngine)
    monkeypatch.setattr(demo_stack, "pin_apart", lambda engines, report: None)


def test_a_proxy_port_taken_after_it_was_picked_is_picked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Port 0: the proxy's port is picked after the engines took theirs, and once more if another
    process took it all the same (a CI run lost a whole module's stack to that race)."""
    import socket

    from kvbroker.tools import children, demo_stack

    _stand_in_parts(monkeypatch, tmp_path)
    free_port = children.free_port
    broker_port, metrics_port = free_port(), free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        # The only port start_stack picks itself here is the proxy's: first the taken one.
        picks = iter([taken.getsockname()[1]])
        monkeypatch.setattr(children, "free_port", lambda *a: next(picks, 0) or free_port(*a))
        stack = demo_stack.start_stack(
            tmp_path, proxy_port=0, broker_port=broker_port, broker_metrics_port=metrics_port, threshold=None
        )
        try:
            assert stack.proxy is not None and stack.proxy.alive()
            assert stack.proxy_url != f"http://127.0.0.1:{taken.getsockname()[1]}"
            assert next(picks, None) is None, "the taken port was offered"
        finally:
            stack.stop()


def test_a_stack_that_fails_to_start_stops_what_it_started(tmp_path: Path) -> None:
    """A proxy port the caller named that is taken fails the start (no second try on a port the
    caller chose), and the broker and engines already started are stopped before the error goes on."""
    import socket

    from kvbroker.tools import demo_stack
    from kvbroker.tools.launch import free_port

    broker_port = free_port()
    with pytest.MonkeyPatch.context() as monkeypatch, socket.socket() as taken:
        _stand_in_parts(monkeypatch, tmp_path)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="proxy exited"):
            demo_stack.start_stack(
                tmp_path, proxy_port=taken.getsockname()[1], broker_port=broker_port, threshold=None
            )
    assert [e.name for e in _StandInEngine.started] == ["prefill-0", "decode-0"]
    assert all(e.stopped for e in _StandInEngine.started)
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", broker_port)) != 0, "the broker is still up"

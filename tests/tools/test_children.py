"""The one launcher of child processes (kvbroker.tools.children, re-exported by testkit.processes):
readiness by log line, port and HTTP answer, a clear error with the log's tail when the child dies
first or takes too long (a hung broker aborted with its stacks), stop and kill9 reaching the whole
process group, restart in place, and the proxy's command line. Real child processes throughout
(small Python programs)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from testkit.ports import free_port
from testkit.processes import BrokerProcess, ChildProcess, ProxyProcess, python_env
from testkit.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

SAY_READY = (
    "import time; print('starting', flush=True); time.sleep(0.2); print('ready', flush=True); time.sleep(600)"
)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_ready_by_log_line_then_stopped(tmp_path: Path) -> None:
    child = ChildProcess("sayer", python(SAY_READY), tmp_path / "sayer.log").start()
    try:
        child.wait_line(b"ready\n", timeout=20)
        assert child.alive() and child.returncode is None
    finally:
        child.stop(grace_s=5)
    assert not child.alive()
    assert child.returncode is not None and child.returncode < 0  # SIGTERM


def test_a_child_that_exits_first_raises_with_its_log(tmp_path: Path) -> None:
    child = ChildProcess(
        "dier", python("import sys; print('no config'); sys.exit(3)"), tmp_path / "d.log"
    ).start()
    with pytest.raises(RuntimeError, match=r"dier exited \(3\) before .*\n.*no config"):
        child.wait_line(b"never", timeout=20)


def test_a_child_that_takes_too_long_raises(tmp_path: Path) -> None:
    child = ChildProcess("slow", python("import time; time.sleep(600)"), tmp_path / "s.log").start()
    try:
        with pytest.raises(RuntimeError, match=r"slow: no listener on 127\.0\.0\.1:"):
            child.wait_port(free_port(), timeout=0.5)
    finally:
        child.kill9()
    assert not child.alive()


def test_ready_by_port_and_by_http(tmp_path: Path) -> None:
    port = free_port()
    server = f"import http.server as h; h.HTTPServer(('127.0.0.1', {port}), h.SimpleHTTPRequestHandler).serve_forever()"
    child = ChildProcess("http", python(server), tmp_path / "http.log", cwd=tmp_path).start()
    try:
        child.wait_port(port, timeout=20)
        child.wait_http(f"http://127.0.0.1:{port}/", timeout=20)
    finally:
        child.stop()


def test_stop_reaches_the_group_and_start_again_restarts_in_place(tmp_path: Path) -> None:
    grandchild = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print('ready', flush=True); time.sleep(600)"
    child = ChildProcess("parent", python(grandchild), tmp_path / "p.log").start()
    child.wait_line(b"ready", timeout=20)
    group = child.pid
    child.stop()
    assert wait_for(lambda: not _group_alive(group), 10), "a grandchild outlived stop()"
    child.start()  # the same child again, its log appended
    try:
        child.wait_line(b"ready", timeout=20)
        assert child.pid != group
        assert (tmp_path / "p.log").read_text().count("ready") == 2
    finally:
        child.kill9()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_fresh_log_env_and_python_env(tmp_path: Path) -> None:
    log = tmp_path / "env.log"
    log.write_text("old run\n")
    code = (
        "import os; print(os.environ['KIT_PROBE'], os.environ['PYTHONPATH'].split(os.pathsep)[0], flush=True)"
    )
    child = ChildProcess(
        "env", python(code), log, env=python_env({"KIT_PROBE": "seen"}), fresh_log=True
    ).start()
    child.proc.wait(20)
    text = log.read_text()
    assert "old run" not in text
    assert text.split() == ["seen", str(Path(__file__).resolve().parents[2])]


def test_the_proxy_command_line(tmp_path: Path) -> None:
    proxy = ProxyProcess(
        tmp_path / "proxy.log",
        prefill={"P": "http://127.0.0.1:1"},
        decode={"D": "http://127.0.0.1:2"},
        broker="127.0.0.1:3",
        local_prefill_tokens=0,
        extra_args=["--probe-timeout-s", "1"],
    )
    assert proxy.argv[1:] == [
        "-m", "kvbroker.clients.proxy", "--host", "127.0.0.1", "--port", str(proxy.port),
        "--prefill", "P=http://127.0.0.1:1", "--decode", "D=http://127.0.0.1:2",
        "--broker", "127.0.0.1:3", "--local-prefill-tokens", "0", "--probe-timeout-s", "1",
    ]  # fmt: skip
    assert proxy.url == f"http://127.0.0.1:{proxy.port}"
    # The default leaves --local-prefill-tokens to the proxy.
    assert "--local-prefill-tokens" not in ProxyProcess(tmp_path / "p2.log", engines={"E": "u"}).argv


def test_the_broker_is_ready_when_it_says_it_listens(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path, priority=None) as broker:
        assert broker.alive()
        assert "kvbroker listening on" in (tmp_path / "broker.log").read_text()
    assert not broker.alive()


def test_a_broker_that_hangs_at_start_is_aborted_with_its_stacks(tmp_path: Path) -> None:
    """A broker alive but silent past the timeout: the error carries where it was (faulthandler's
    dump on SIGABRT), and the child is gone after."""
    hang = "import time\ndef stuck_in_start(): time.sleep(600)\nstuck_in_start()"
    broker = BrokerProcess(tmp_path, command=["-c", hang], priority=None, log_level=None)
    with pytest.raises(RuntimeError) as raised:
        broker.start(timeout=1)
    # Both attempts hung: each is in the error with the child's state and its stacks.
    attempts = re.split(r"\n--- attempt \d of 2 ---\n", str(raised.value))[1:]
    assert len(attempts) == 2, raised.value
    for attempt in attempts:
        assert re.search(
            r"(?s)no 'kvbroker listening on' within 1 s.*its state: state [RS].*of CPU.*major page faults"
            r".*its stacks.*stuck_in_start",
            attempt,
        ), attempt
    assert not broker.alive()
    assert broker.abort() == ""  # nothing left to abort


def test_a_broker_silent_at_its_first_start_is_started_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first start hangs (as a starved CI machine once left a broker in its imports for
    60 s), the second says it listens: start() returns the running broker and says what happened."""
    marker = tmp_path / "started-once"
    code = (
        "import pathlib, sys, time\n"
        f"marker = pathlib.Path({str(marker)!r})\n"
        "def stuck_in_start(): time.sleep(600)\n"
        "if not marker.exists():\n"
        "    marker.touch(); stuck_in_start()\n"
        "print('kvbroker listening on here', flush=True); time.sleep(600)\n"
    )
    broker = BrokerProcess(tmp_path, command=["-c", code], priority=None, log_level=None)
    with broker.start(timeout=1):
        assert broker.alive()
    said = capsys.readouterr().err
    assert "up at attempt 2" in said and "stuck_in_start" in said and "its state" in said


def test_a_broker_that_exits_at_start_is_not_started_again(tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    code = f"import pathlib; p = pathlib.Path({str(marker)!r}); p.write_text(p.read_text() + 'x' if p.exists() else 'x')"
    broker = BrokerProcess(tmp_path, command=["-c", code], priority=None, log_level=None)
    with pytest.raises(RuntimeError, match="exited"):
        broker.start(timeout=10)
    assert marker.read_text() == "x"


def test_a_child_that_exited_is_not_aborted(tmp_path: Path) -> None:
    child = ChildProcess("quick", python("print('done')"), tmp_path / "q.log").start()
    child.proc.wait(20)
    assert child.abort() == ""
    assert child.returncode == 0


def test_entering_a_running_child_does_not_start_a_second(tmp_path: Path) -> None:
    """`with child.start():` once started a second child over the first, which then outlived the
    block; a running child is entered as it is and stopped at the block's end."""
    child = ChildProcess("sayer", python(SAY_READY), tmp_path / "sayer.log")
    started = child.start()
    first = child.proc
    try:
        with started:
            assert child.proc is first and child.alive()
    finally:
        for proc in {first, child.proc}:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert first.returncode is not None and first.returncode < 0  # stopped by the block (SIGTERM)

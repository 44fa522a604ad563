"""The kvbroker command against a real in-process broker."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvbroker.clients.engine_session import EngineSession
from kvbroker.common.hashing import wire_chain
from kvbroker.tools import cli
from kvbroker.v1 import broker_pb2 as pb

GPU = pb.TIER_GPU
TOKENS = list(range(1000, 1000 + 32 * 3 + 5))  # three full blocks of 32 and a partial one


async def run_cli(*argv: str) -> tuple[int, str]:
    """Run `kvbroker ARGV` on a thread (the broker serves on this loop meanwhile)."""
    out = io.StringIO()
    code = await asyncio.to_thread(cli.main, list(argv), out)
    return code, out.getvalue()


@pytest.fixture
async def engines(
    broker: Any, engine_info: Callable[..., pb.EngineInfo]
) -> AsyncIterator[dict[str, EngineSession]]:
    opened = {}
    for engine_id in ("p0", "d0"):
        session = EngineSession(broker.address, engine_info(engine_id))
        await session.start(wait_connected_s=5.0)
        opened[engine_id] = session
    yield opened
    for session in opened.values():
        await session.close()


def test_format_table_aligns_columns() -> None:
    table = cli.format_table(["NAME", "BLOCKS"], [["a", 5], ["longer-name", 12345]])
    lines = table.splitlines()
    assert lines[0] == "NAME         BLOCKS"
    assert lines[1] == "a                 5"  # numbers right-aligned
    assert lines[2] == "longer-name   12345"


def test_help_explains_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for command in (
        "serve",
        "engines",
        "leases",
        "stats",
        "revoke",
        "drain",
        "watch",
        "score",
        "KVBROKER_ADDR",
    ):
        assert command in text


def test_serve_help_shows_the_broker_flags(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kvbroker.broker.server")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--session-ttl-ms" in text and "KVBROKER_SESSION_TTL_MS" in text


def test_no_command_prints_usage() -> None:
    out = io.StringIO()
    assert cli.main([], out) == cli.EXIT_USAGE
    assert "usage: kvbroker" in out.getvalue()


def test_unreachable_broker_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--broker", "127.0.0.1:1", "--timeout", "1", "stats"], io.StringIO()) == 3
    assert "cannot reach the broker at 127.0.0.1:1" in capsys.readouterr().err


async def test_engines_table_and_json(broker: Any, engines: dict[str, EngineSession]) -> None:
    engines["p0"].announce_stored((engines["p0"].layout_id, ""), GPU, [1, 2, 3])
    engines["p0"].flush()
    await engines["p0"].applied()
    code, text = await run_cli("--broker", broker.address, "engines")
    assert code == 0
    lines = text.splitlines()
    header = lines[0].split()
    assert header[:7] == ["ENGINE", "STATE", "LAYOUT", "MODEL", "RANKS", "GPU_BLOCKS", "CPU_BLOCKS"]
    rows = {line.split()[0]: line.split() for line in lines[1:3]}
    assert rows["p0"][1] == "serving" and rows["p0"][5] == "3" and rows["d0"][5] == "0"
    assert header[7] == "INDEX" and rows["p0"][7] == "exact" and rows["d0"][7] == "exact"
    assert lines[-1] == "2 engine(s)"
    code, text = await run_cli("--broker", broker.address, "engines", "--json")  # --json after the command
    assert code == 0
    listed = {e["engine_id"]: e for e in json.loads(text)}
    assert sorted(listed) == ["d0", "p0"]
    # Proto3 JSON names, and zero values printed rather than left out.
    assert listed["p0"]["blocks_gpu"] == 3 and listed["d0"]["blocks_gpu"] == 0
    assert listed["d0"]["draining"] is False and listed["d0"]["active_leases_held"] == 0


async def test_leases_show_holder_reader_and_ended_causes(
    broker: Any, engines: dict[str, EngineSession]
) -> None:
    p0, d0 = engines["p0"], engines["d0"]
    lease = await p0.hold((p0.layout_id, "tenant-a"), GPU, [11, 12], [1, 2], 30_000, reader_engine_id="d0")
    await d0.acquire(lease.lease_id)
    code, text = await run_cli("--broker", broker.address, "leases")
    assert code == 0
    (row,) = [line.split() for line in text.splitlines() if line.startswith(lease.lease_id)]
    assert row[1:6] == ["active", "p0", "d0", "GPU", "2"]
    assert "tenant-a" in row
    assert text.splitlines()[-1] == "1 live, 0 ended"

    code, text = await run_cli("--broker", broker.address, "revoke", lease.lease_id, "--reason", "test")
    assert code == 0 and f"revoked lease {lease.lease_id}" in text
    code, text = await run_cli("--broker", broker.address, "leases")
    assert text.splitlines()[-1] == "0 live, 0 ended"
    code, text = await run_cli("--broker", broker.address, "leases", "--all", "--json")
    (ended,) = [x for x in json.loads(text) if x["lease_id"] == lease.lease_id]
    assert ended["state"] == "LEASE_REVOKED" and ended["cause"] == "REVOKE_OPERATOR"
    code, text = await run_cli("--broker", broker.address, "leases", "--all")
    (row,) = [line.split() for line in text.splitlines() if line.startswith(lease.lease_id)]
    assert row[1] == "revoked" and "operator" in row


async def test_revoke_errors_have_exit_codes(
    broker: Any, engines: dict[str, EngineSession], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = await run_cli("--broker", broker.address, "revoke", "no-such-lease")
    assert code == 4
    assert "NOT_FOUND" in capsys.readouterr().err
    p0 = engines["p0"]
    lease = await p0.hold((p0.layout_id, ""), GPU, [5], [5], 30_000)
    assert (await run_cli("--broker", broker.address, "revoke", lease.lease_id))[0] == 0
    code, _ = await run_cli("--broker", broker.address, "revoke", lease.lease_id)
    assert code == 5  # already ended: failed precondition
    assert "FAILED_PRECONDITION" in capsys.readouterr().err


async def test_json_names_every_field_even_on_an_empty_broker(broker: Any) -> None:
    """The proto's snake_case names (as docs/cli.md lists them), zero values included, ints as ints."""
    code, text = await run_cli("--broker", broker.address, "--json", "stats")
    assert code == 0
    stats = json.loads(text)
    expected = {
        "engines",
        "sessions",
        "namespaces",
        "blocks_indexed",
        "leases_by_state",
        "revocations_by_cause",
    }
    assert expected <= set(stats), stats
    assert stats["engines"] == 0 and stats["blocks_indexed"] == 0
    assert stats["leases_by_state"]["active"] == 0 and stats["revocations_by_cause"]["ttl_expired"] == 0
    code, text = await run_cli("--broker", broker.address, "--json", "engines")
    assert code == 0 and json.loads(text) == []


def test_json_keeps_64_bit_integers_whole_and_nested() -> None:
    from kvbroker.tools.cli_render import to_json

    lease = pb.Lease(
        lease_id="x", block_hashes=[2**64 - 1, 5], epoch=3, namespace=pb.Namespace(layout_id="l")
    )
    out = to_json(pb.LeaseResponse(lease=lease))
    assert out["lease"]["block_hashes"] == [2**64 - 1, 5] and out["lease"]["epoch"] == 3
    assert out["lease"]["namespace"]["layout_id"] == "l"
    event = to_json(pb.WatchEvent(kind="k", time_unix=1.5))
    assert event["time_unix"] == 1.5 and "lease" not in event


def test_docs_list_the_json_names_that_come_out() -> None:
    """Every top-level field of each --json answer is named in docs/cli.md, as it is printed."""
    from pathlib import Path

    from kvbroker.tools.cli_render import to_json

    docs = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    messages = (pb.StatsResponse(), pb.EngineInfo(), pb.Lease(), pb.ScoreResponse(), pb.EngineScore())
    for message in (*messages, pb.DrainResponse(), pb.WatchEvent()):
        for name in to_json(message):
            assert f"`{name}`" in docs, f"docs/cli.md does not name {message.DESCRIPTOR.name}.{name}"


async def test_stats_and_drain(broker: Any, engines: dict[str, EngineSession]) -> None:
    code, text = await run_cli("--broker", broker.address, "--json", "stats")
    assert code == 0 and json.loads(text)["engines"] == 2
    code, text = await run_cli("--broker", broker.address, "stats")
    assert code == 0
    assert any(line.split() == ["engines", "2"] for line in text.splitlines())
    code, text = await run_cli("--broker", broker.address, "drain", "d0", "--reason", "upgrade")
    assert code == 0 and "engine d0 is draining" in text
    code, _ = await run_cli("--broker", broker.address, "drain", "nobody")
    assert code == 4


async def test_score_by_tokens_agrees_with_our_hashes(broker: Any, engines: dict[str, EngineSession]) -> None:
    p0 = engines["p0"]
    # p0 announces the hashes we compute; the broker hashes the token ids itself.
    p0.announce_stored((p0.layout_id, ""), GPU, wire_chain(TOKENS, 32)[:2])
    p0.flush()
    await p0.applied()
    tokens = ",".join(map(str, TOKENS))
    code, text = await run_cli(
        "--broker", broker.address, "score", "--layout-id", p0.layout_id, "--tokens", tokens
    )
    assert code == 0, text
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:-1]}
    assert rows["p0"][1:3] == ["2", "0"]
    assert text.splitlines()[-1] == "3 full block(s) of 32 tokens in the prompt"
    code, text = await run_cli(
        "--broker", broker.address, "score", "--layout-id", p0.layout_id, "--tokens", tokens, "--placement"
    )
    assert code == 0, text
    assert text.splitlines()[0].split()[-1] == "COST"
    assert text.splitlines()[-1].startswith("placement: dp_"), text
    hashes = " ".join(hex(h) for h in wire_chain(TOKENS, 32))
    code, text = await run_cli(
        "--broker", broker.address, "--json", "score", "--layout-id", p0.layout_id, "--hashes", hashes
    )
    assert code == 0
    scores = {s["engine_id"]: s for s in json.loads(text)["scores"]}
    assert scores["p0"]["gpu_blocks"] == 2 and scores["d0"]["gpu_blocks"] == 0
    code, _ = await run_cli(
        "--broker", broker.address, "score", "--layout-id", p0.layout_id, "--hashes", "12,zz"
    )
    assert code == 6


async def test_watch_prints_events(broker: Any, engine_info: Callable[..., pb.EngineInfo]) -> None:
    watcher = asyncio.ensure_future(
        run_cli("--broker", broker.address, "watch", "--engines", "--count", "1", "--json")
    )
    await asyncio.sleep(0.2)
    session = EngineSession(broker.address, engine_info("late"))
    await session.start(wait_connected_s=5.0)
    try:
        code, text = await asyncio.wait_for(watcher, 5.0)
    finally:
        await session.close()
    assert code == 0
    event = json.loads(text.splitlines()[0])
    assert event["kind"] == "engine_registered" and event["engine_id"] == "late"


def test_console_script_runs() -> None:
    """The installed `kvbroker` entry point is this module's main."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbroker.tools.cli",
            "--broker",
            "127.0.0.1:1",
            "--timeout",
            "0.5",
            "engines",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3, result.stderr
    assert "cannot reach the broker" in result.stderr


@pytest.mark.parametrize("command", ["stats", "engines"])
async def test_a_reader_that_leaves_ends_the_command_quietly(
    broker: Any, engines: dict[str, EngineSession], command: str
) -> None:
    """`kvbroker stats | head -0`: the pipe's reader is gone before the table is written. The
    command exits as one killed by SIGPIPE would (141), not with Python's BrokenPipeError traceback."""

    def run() -> tuple[int, str]:
        argv = [sys.executable, "-m", "kvbroker.tools.cli", "--broker", broker.address, command]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader leaves before the command has written a byte
        err = proc.stderr.read().decode()
        return proc.wait(60), err

    code, err = await asyncio.to_thread(run)
    assert code == cli.EXIT_BROKEN_PIPE and "Traceback" not in err, err

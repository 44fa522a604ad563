"""Keep the session's exit status when real NIXL agents were created in this process (any test folder);
`store`, a real redis-server of a test's own, for the tests of broker replicas in any folder;
and `tiny_model_dir`, the tiny model, built once per session for every test that starts engines.

nixl 1.5.1 segfaults during interpreter teardown in any process that created
a UCX agent (see engine_adapter.nixl_agent.exit_skipping_nixl_teardown), which
would turn a green run into exit status 139. After every other plugin has
finished (reports written), leave with pytest's own status instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbroker.engine_adapter.nixl_agent import exit_skipping_nixl_teardown, nixl_agents_created
from kvbroker.tools.launch import ONE_PROCESS_ENV
from testkit.redis_server import RedisServer, missing_reason, running_redis

_exit_status: list[int] = []

# The suite's one-rank engines run their model in the engine core's process: 12 s sooner to start
# (docs/adapter.md). Benchmarks and the demo keep vLLM's default, which decodes faster under load.
os.environ.setdefault(ONE_PROCESS_ENV, "1")


# Test files that start vLLM engines (a `vllm` mark anywhere in them), by path from the root.
_ROOT = Path(__file__).resolve().parent.parent
ENGINE_FILES = frozenset(
    str(path.relative_to(_ROOT))
    for path in (_ROOT / "tests").rglob("test_*.py")
    if "mark.vllm" in path.read_text(encoding="utf-8", errors="replace")
)


# Files with the mark that may all the same run beside the engines' worker: they start one engine
# or none (vLLM's --help) and time nothing, so they cost the engine files some CPU, not a verdict.
BESIDE_ENGINES = frozenset(
    {
        "tests/tools/test_documented_commands.py",
        "tests/tools/test_launch.py",
        "tests/broker/indexer/test_kv_events_vllm.py",
    }
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How pytest-xdist shares the tests out (`make test` runs two workers).

    Every file that starts vLLM engines runs on one worker, one file after
    another, exactly as in a plain run: engines never compete with engines for
    the two cores. The rest (brokers, Redis, NIXL, fakes: mostly waiting on
    sockets and timers, and BESIDE_ENGINES) runs beside them on the other
    worker, a whole file at a time so module-scoped fixtures are built once.
    """
    from xdist.scheduler import LoadScopeScheduling

    class EnginesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "engines" if path in ENGINE_FILES - BESIDE_ENGINES else path

    return EnginesTogether(config, log)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if nixl_agents_created() and _exit_status:
        exit_skipping_nixl_teardown(_exit_status[-1])


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server of the test's own (skipped, with the reason, where none can run)."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    with running_redis(tmp_path / "redis") as server:
        yield server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from kvbroker.tools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))

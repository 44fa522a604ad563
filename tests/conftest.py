"""Keep the session's exit status when real NIXL agents were created in this process (any test folder);
`store`, a real redis-server of a test's own, for the tests of broker replicas in any folder;
and `tiny_model_dir`, the tiny model, built once per session for every test that starts engines.

nixl 1.5.1 segfaults during interpreter teardown in any process that created
a UCX agent (see engine_adapter.nixl_agent.exit_skipping_nixl_teardown), which
would turn a green run into exit status 139. After every other plugin has
finished (reports written), leave with pytest's own status instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbroker.engine_adapter.nixl_agent import exit_skipping_nixl_teardown, nixl_agents_created
from testkit.redis_server import RedisServer, missing_reason, running_redis

_exit_status: list[int] = []


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

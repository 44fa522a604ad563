"""The servers' open-files limit: raised from a low soft limit to the hard one (common/open_files.py)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kvbroker.common.open_files import UNLIMITED_CAP
from testkit.processes import LOW_SOFT_OPEN_FILES, ProxyProcess, soft_open_files, with_low_soft_limit

_RUN = """
import resource, sys
from kvbroker.common.open_files import raise_open_files_limit
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
print(*raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
"""


def _in_child(soft: int) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _RUN, str(soft)], capture_output=True, text=True, check=True)
    return [int(v) for v in out.stdout.split()]


def test_a_low_soft_limit_is_raised_to_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 64:
        pytest.skip(f"hard limit {hard}")
    before, after, now, child_hard = _in_child(64)
    assert before == 64 and after == now > 64
    assert now == (child_hard if child_hard != resource.RLIM_INFINITY else UNLIMITED_CAP)


def test_a_soft_limit_already_at_the_hard_one_is_left() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard > 1 << 22:
        pytest.skip("no finite hard limit to start at")
    before, after, now, _ = _in_child(hard)
    assert before == after == now == hard


def test_the_proxy_raises_its_soft_limit(tmp_path: Path) -> None:
    """The proxy holds a descriptor per client and per engine connection: started with a soft limit
    of 256, it runs with the hard one (the broker's case: tests/process/test_hostile_load.py)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= LOW_SOFT_OPEN_FILES:
        pytest.skip(f"hard limit {hard}")
    proxy = ProxyProcess(tmp_path / "proxy.log", engines={"E": "http://127.0.0.1:1"})
    assert proxy.argv[1:3] == ["-m", "kvbroker.clients.proxy"]
    proxy.argv[1:3] = with_low_soft_limit("kvbroker.clients.proxy")
    with proxy:
        soft = soft_open_files(proxy.pid)
    assert soft > LOW_SOFT_OPEN_FILES

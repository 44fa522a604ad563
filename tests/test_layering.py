"""The package's shape: one `kvbroker` namespace, and imports that only run down the layers.

    kvbroker.tools                    cli, demo, launcher, tiny model      -> engine_adapter and below
    kvbroker.engine_adapter           what vLLM loads                     -> clients, common, v1
    kvbroker.broker  kvbroker.clients never each other                    -> common, v1
    kvbroker.common                   layouts, hashing, index, ranking    -> v1
    kvbroker.v1                       the generated API

    testkit (not in the wheel)        test and bench scaffolding: may use anything; no part of
                                      kvbroker imports it

Inside kvbroker.broker, three wings (fleet, security, indexer) import the broker's top level,
never each other; only broker/server.py, which builds the broker, imports a wing.

docs/architecture.md draws the same picture.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
# kvbroker/ is the root package; each layer inside it is a link to its source folder.
PACKAGE_DIRS = {"kvbroker": ROOT / "kvbroker"} | {
    f"kvbroker.{link.name}": link.resolve() for link in (ROOT / "kvbroker").iterdir() if link.is_symlink()
}

# What each layer may import from inside kvbroker (besides itself).
ALLOWED = {
    "kvbroker.v1": set(),
    "kvbroker.common": {"kvbroker.v1"},
    "kvbroker.broker": {"kvbroker.v1", "kvbroker.common"},
    "kvbroker.clients": {"kvbroker.v1", "kvbroker.common"},
    "kvbroker.engine_adapter": {"kvbroker.v1", "kvbroker.common", "kvbroker.clients"},
    "kvbroker.tools": {
        "kvbroker.v1",
        "kvbroker.common",
        "kvbroker.broker",
        "kvbroker.clients",
        "kvbroker.engine_adapter",
    },
}
OLD_TOP_LEVEL = {"broker", "clients", "engine_adapter", "common", "tools"}
# Test scaffolding shared by tests/ and bench/; it runs from the source tree, outside the wheel.
TEST_KIT = "testkit"


def _modules() -> dict[str, Path]:
    """Every module of the wheel, by its dotted name."""
    out: dict[str, Path] = {}
    for package in CONFIG["packages"]:
        folder = _folder_of(package)
        for path in folder.glob("*.py"):
            name = package if path.name == "__init__.py" else f"{package}.{path.stem}"
            out[name] = path
    return out


def _folder_of(package: str) -> Path:
    for name in sorted(PACKAGE_DIRS, key=len, reverse=True):
        if package == name or package.startswith(name + "."):
            rest = package[len(name) :].strip(".")
            return PACKAGE_DIRS[name].joinpath(*rest.split(".")) if rest else PACKAGE_DIRS[name]
    raise AssertionError(f"{package} is not under kvbroker/ or one of its links")


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from kvbroker.common import index` imports kvbroker.common.index
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _layer(module: str) -> str:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return "kvbroker"


def test_every_package_folder_is_in_the_wheel_list() -> None:
    """A subpackage left out of pyproject's list would silently be missing from the wheel."""
    listed = set(CONFIG["packages"])
    for name, folder in PACKAGE_DIRS.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            package = ".".join([name, *rel.parts]) if rel.parts else name
            assert package in listed, f"{init.parent} has an __init__.py but {package} is not in pyproject"


def test_imports_only_run_down_the_layers() -> None:
    wrong = []
    for module, path in _modules().items():
        layer = _layer(module)
        for line, target in _imports(path):
            if target.split(".")[0] in OLD_TOP_LEVEL:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} (use kvbroker.*)")
            if target.split(".")[0] == TEST_KIT:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the test kit {target}")
            if not target.startswith("kvbroker.") or layer == "kvbroker":
                continue
            target_layer = _layer(target)
            if target_layer != layer and target_layer not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {target} ({target_layer})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


WINGS = ("kvbroker.broker.fleet", "kvbroker.broker.security", "kvbroker.broker.indexer")
BUILDER = "kvbroker.broker.server"  # the one module outside a wing that imports the wings


def _wing(module: str) -> str | None:
    return next((w for w in WINGS if module == w or module.startswith(w + ".")), None)


def test_the_broker_wings_import_only_the_top_level_and_only_the_server_imports_them() -> None:
    wrong = []
    for module, path in _modules().items():
        own = _wing(module)
        for line, target in _imports(path):
            wing = _wing(target)
            if wing is None or wing == own or module == BUILDER:
                continue
            who = f"the wing {own}" if own else module
            wrong.append(
                f"{path.relative_to(ROOT)}:{line}: {who} imports {target} (pass it in from server.py)"
            )
    assert not wrong, "imports of the broker's wings:\n" + "\n".join(wrong)


def test_tests_and_bench_use_the_namespace() -> None:
    wrong = []
    for folder in ("tests", "bench", TEST_KIT):
        for path in (ROOT / folder).rglob("*.py"):
            for line, target in _imports(path):
                if target.split(".")[0] in OLD_TOP_LEVEL:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_bench_does_not_import_the_tests() -> None:
    """Benchmarks and tests share their scaffolding through testkit, not tests/."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in (ROOT / "bench").rglob("*.py")
        for line, target in _imports(path)
        if target.split(".")[0] == "tests"
    ]
    assert not wrong, "\n".join(wrong)


def _is_program(path: Path) -> bool:
    """A module run as `python -m ...`: it has a main() or an `if __name__ == "__main__"` block."""
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            return True
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def test_no_bench_program_imports_another() -> None:
    """A benchmark program is imported by no other module of bench/ or testkit: what programs share
    lives in bench/harness/ or in a helper module of their room, not in a program."""
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts): path
        for path in (ROOT / "bench").rglob("*.py")
    }
    programs = {name for name, path in modules.items() if _is_program(path)}
    assert "bench.control_plane.compare" in programs  # the check sees the programs
    importers = list(modules.values()) + list((ROOT / TEST_KIT).rglob("*.py"))
    wrong = []
    for path in importers:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            wrong += [
                f"{path.relative_to(ROOT)}:{node.lineno} imports the program {t}"
                for t in targets
                if t in programs and modules.get(t) != path
            ]
    assert not wrong, "\n".join(wrong)


def test_the_plugin_package_holds_only_what_vllm_loads() -> None:
    """Every module of kvbroker.engine_adapter is reached from the connector vLLM imports."""
    modules = {m: p for m, p in _modules().items() if m.startswith("kvbroker.engine_adapter")}
    seen: set[str] = set()
    todo = ["kvbroker.engine_adapter.connector", "kvbroker.engine_adapter"]
    while todo:
        module = todo.pop()
        if module in seen or module not in modules:
            continue
        seen.add(module)
        todo += [target for _, target in _imports(modules[module])]
    assert set(modules) - seen == set(), "not loaded by vLLM; move it out of the plugin package"


@pytest.mark.slow
def test_the_wheel_holds_only_kvbroker(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("kvbroker-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    outside = [n for n in names if not n.startswith(("kvbroker/", "kvbroker-"))]
    assert outside == []
    expected = {
        f"{m.replace('.', '/')}{'/__init__' if p.name == '__init__.py' else ''}.py"
        for m, p in _modules().items()
    }
    assert expected <= set(names), f"missing from the wheel: {sorted(expected - set(names))[:5]}"
    assert "kvbroker/v1/broker.proto" in names
    untyped = [p for p in CONFIG["packages"] if f"{p.replace('.', '/')}/py.typed" not in names]
    assert untyped == [], f"no py.typed (PEP 561) in {untyped}"
    assert not any(n.startswith(f"{TEST_KIT}/") for n in names)
    assert "LICENSE" in " ".join(n for n in names if n.startswith("kvbroker-")), "the wheel lacks LICENSE"


# "Each module readable in one sitting": about 500 lines. A module that must be
# longer is listed here with the reason.
MAX_LINES = 520
LONGER_WITH_REASON: dict[str, str] = {}


def test_no_module_is_longer_than_one_sitting() -> None:
    paths = [p for m, p in _modules().items() if not m.startswith("kvbroker.v1")]
    paths += list((ROOT / "bench").rglob("*.py")) + list((ROOT / "tests").rglob("*.py"))
    paths += list((ROOT / TEST_KIT).glob("*.py"))
    long = {
        str(p.relative_to(ROOT)): n
        for p in paths
        if (n := len(p.read_text().splitlines())) > MAX_LINES
        and str(p.relative_to(ROOT)) not in LONGER_WITH_REASON
    }
    assert long == {}, f"split these modules along their seams (or state why not): {long}"


def test_the_wheel_never_calls_asyncio_wait_for() -> None:
    """Python 3.11's asyncio.wait_for loses a cancellation that lands as the awaited call finishes:
    a loop around it then outlives its task's cancel (a Mirror stream did, tests/broker/test_mirror.py).
    The wheel uses `async with asyncio.timeout(...)` instead."""
    calls = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "wait_for"
                and isinstance(node.value, ast.Name)
                and node.value.id == "asyncio"
            ):
                calls.append(f"{module}:{node.lineno}")
    assert calls == [], f"use asyncio.timeout, not asyncio.wait_for: {calls}"

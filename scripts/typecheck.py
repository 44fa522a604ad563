"""Run mypy over the `kvbroker` namespace as the wheel lays it out.

Usage: python scripts/typecheck.py [extra mypy arguments]

The source folders (broker/, clients/, common/, engine_adapter/, tools/,
proto/kvbroker/) are mapped to `kvbroker.*` packages by pyproject.toml's
[tool.setuptools.package-dir]. mypy cannot follow setuptools' editable import
hook, so this builds the same tree out of symbolic links under
build/typecheck/ and checks that, plus bench/. Errors name the real files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"


def package_dirs() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in config["package-dir"].items()}


def build_tree() -> None:
    if TREE.exists():
        shutil.rmtree(TREE)
    dirs = package_dirs()
    root = TREE / "kvbroker"
    root.mkdir(parents=True)
    for entry in dirs["kvbroker"].iterdir():  # the root package's own files and subfolders (v1/)
        (root / entry.name).symlink_to(entry)
    for name, folder in dirs.items():
        if name != "kvbroker":
            (TREE / name.replace(".", os.sep)).symlink_to(folder, target_is_directory=True)


def main() -> int:
    build_tree()
    env = dict(os.environ, MYPYPATH=str(TREE))
    cmd = [sys.executable, "-m", "mypy", *sys.argv[1:]]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    # Name the real files, not their links.
    prefix = str(TREE.relative_to(ROOT)) + os.sep
    out = result.stdout.replace(prefix + "kvbroker" + os.sep, "")
    for name, folder in package_dirs().items():
        link = name.removeprefix("kvbroker").strip(".").replace(".", os.sep)
        if link:
            out = out.replace(f"{link}{os.sep}", f"{folder.relative_to(ROOT)}{os.sep}")
    sys.stdout.write(out)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())

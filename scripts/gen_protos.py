"""Generate Python code and type stubs from proto/ (the one codegen command).

Usage: python scripts/gen_protos.py [--check]

Writes proto/kvbroker/v1/*_pb2.py, *_pb2_grpc.py and *.pyi next to the
.proto files. With --check, generates into a temporary folder and exits 1 if
the committed files differ (stale generated code).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency only

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    bindir = Path(sys.executable).parent  # protoc-gen-mypy lives beside python
    os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
    ] + [str(p.relative_to(PROTO_ROOT)) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return [p.relative_to(out_dir) for p in out_dir.rglob("*") if p.is_file()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        files = generate(tmp_dir)
        if args.check:
            stale = [
                str(f)
                for f in files
                if not (PROTO_ROOT / f).exists()
                or not filecmp.cmp(tmp_dir / f, PROTO_ROOT / f, shallow=False)
            ]
            if stale:
                print("generated code is stale; run `make protos`:", *stale, sep="\n  ")
                return 1
            print(f"generated code is current ({len(files)} files)")
            return 0
        for f in files:
            (PROTO_ROOT / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tmp_dir / f, PROTO_ROOT / f)
        for pkg in {(PROTO_ROOT / f).parent for f in files}:
            d = pkg
            while d != PROTO_ROOT:
                (d / "__init__.py").touch()
                d = d.parent
        print(f"wrote {len(files)} files under proto/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# The data path on a GPU in one short run (docs/data_path.md#gpu-check).
#
#   scripts/gpu_check.sh prepare    here, online: download the wheels a GPU machine without
#                                   internet needs into .whl/ (ignored by git), then `size`
#   scripts/gpu_check.sh size       do the tracked files, the other files that travel and .whl/
#                                   fit the 64 MiB a lent machine takes? (exit 1 if not)
#   scripts/gpu_check.sh [ARGS]     on the GPU machine: install .whl/ into a target folder
#                                   (pip --no-index --no-deps --target; unzip without pip), then
#                                   python -m bench.data_path.gpu_check ARGS (JSON into $OUT when set)
#
# Without CUDA the run checks DRAM instead of VRAM (the dry run tests/bench/test_gpu_check.py does).
# Environment: PYTHON (default python3), KVBROKER_WHEELS (default .whl), KVBROKER_SITE (the
# target folder, default $TMPDIR/kvbroker-gpu-site), OUT (where the JSON goes).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=${KVBROKER_WHEELS:-.whl}
SITE=${KVBROKER_SITE:-${TMPDIR:-/tmp}/kvbroker-gpu-site}
LIMIT_MIB=64
# What the GPU machine lacks (it has Python 3.12, torch with CUDA 13 and, we assume, numpy):
# NIXL for CUDA 13 (its `nixl` front package picks nixl_cu13), protobuf for kvbroker.v1 (the
# adapter's regions), and pytest for the CUDA tests. pytest 8.3 is the last without pygments
# (1.2 MiB). numpy (16 MiB) does not fit beside NIXL: the check reports it missing if it is.
CARRIED=(nixl==1.5.1 nixl-cu13==1.5.1 protobuf==7.36.2 pytest==8.3.5 pluggy==1.6.0 iniconfig==2.3.1
    pytest-timeout==2.4.0)

size_check() {
    "$PY" - "$WHEELS" "$LIMIT_MIB" <<'EOF'
import os, subprocess, sys
wheels, limit = sys.argv[1], int(sys.argv[2]) * 2**20
# What travels: tracked files and untracked ones git does not ignore, plus the carried folder.
listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.split(b"\0")
tree = sum(os.lstat(p).st_size for p in {p.decode() for p in listed if p} if os.path.lexists(p))
carry = sum(e.stat().st_size for e in os.scandir(wheels) if e.is_file()) if os.path.isdir(wheels) else 0
total = tree + carry
mib = lambda n: f"{n / 2**20:.2f} MiB"
print(f"carry: working tree {mib(tree)} + {wheels}/ {mib(carry)} = {mib(total)} of {mib(limit)}: "
      + ("fits, " + mib(limit - total) + " to spare" if total <= limit else "DOES NOT FIT"))
sys.exit(0 if total <= limit else 1)
EOF
}

unzip_wheels() {  # a wheel is a zip laid out for site-packages
    "$PY" - "$SITE" "$WHEELS"/*.whl <<'EOF'
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
EOF
}

install_wheels() {
    case "$SITE" in /|"") echo "refusing to install into '$SITE'" >&2; return 1 ;; esac
    rm -rf "$SITE" && mkdir -p "$SITE" || return 1
    if "$PY" -m pip --version >/dev/null 2>&1 && "$PY" -m pip install -q --disable-pip-version-check \
        --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl; then
        return 0
    fi
    echo "pip could not install the wheels: unzipping them instead" >&2
    unzip_wheels
}

case "${1:-}" in
prepare)
    mkdir -p "$WHEELS"
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux2014_x86_64 --dest "$WHEELS" "${CARRIED[@]}" || exit 1
    ls -l "$WHEELS"
    size_check
    exit $?
    ;;
size)
    size_check
    exit $?
    ;;
esac

started=$(date +%s)
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $SITE" >&2
    # Without them the check still runs and its table says what is missing.
    install_wheels || echo "could not install the carried wheels: going on without them" >&2
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed in $(($(date +%s) - started)) s" >&2
else
    echo "no wheels in $WHEELS/: using the packages $PY already has" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# kvbroker/ is a folder of links to the layers; a copy of the tree that dropped them gets them
# back (python -m puts this folder first on sys.path, so they must be here, not elsewhere).
if ! [ -e kvbroker/engine_adapter/block_mover.py ]; then
    echo "kvbroker/ lost its links in this copy: linking the layers again" >&2
    for layer in broker clients common engine_adapter tools; do
        ln -sfn "../$layer" "kvbroker/$layer"
    done
    ln -sfn ../proto/kvbroker/v1 kvbroker/v1
fi
args=("$@")
if [ -n "${OUT:-}" ]; then
    args+=(--out-dir "$OUT")
fi
"$PY" -m bench.data_path.gpu_check ${args[@]+"${args[@]}"}
status=$?
echo "gpu_check: exit status $status after $(($(date +%s) - started)) s in all" >&2
exit $status

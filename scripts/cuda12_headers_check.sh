#!/usr/bin/env bash
# Compiles csrc/ against an older CUDA release's runtime and CCCL headers (default: setup.py's
# MIN_NVCC, the oldest release the build accepts), with the nvcc on this machine.
#
# Why: setup.py accepts nvcc >= MIN_NVCC, but every machine the project builds on (this CPU
# machine, CI, the lent GPUs) has nvcc 13. Without this check a call of an API newer than
# MIN_NVCC (or one CUDA 13 changed) would land unseen and break the build on a CUDA 12 machine.
#
# What it checks, and what not: the CUDA runtime API, the fp16 / bf16 / fp8 types and CUB of
# that release, i.e. every header the sources include (nvidia-cuda-runtime-cu12 and
# nvidia-cuda-cccl-cu12 wheels from PyPI). The compiler stays this machine's nvcc, with its own
# crt/ and fatbinary_section.h (the launch stubs cudafe++ writes must match them); PyPI ships
# no CUDA 12 nvcc front end (nvidia-cuda-nvcc-cu12 holds ptxas and libnvvm only), so nvcc 12's
# own front end and code generation are NOT checked here: scripts/nvcc12_build_check.py does
# that with Debian's CUDA 12.4 nvcc (12.4 is the oldest there; the 12.3 API is checked here).
#
#   bash scripts/cuda12_headers_check.sh [VERSION]      # e.g. 12.3 (default: MIN_NVCC)
#
# Wheels and the header tree are cached under $MOK_CUDA12_CACHE (default .cuda12/, ignored).
# Exit status: 0 compiled; 1 the sources failed to compile against those headers; 2 this
# machine cannot run the check (no nvcc, no wheels); either way it says why.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

VERSION="${1:-$("$PY" - <<'PYEOF'
import re
text = open("setup.py").read()
major, minor = re.search(r"MIN_NVCC = \((\d+), (\d+)\)", text).groups()
print(f"{major}.{minor}")
PYEOF
)}"
# 12.0-12.2's headers do not mix with nvcc 13's own (crt/ wants cudaKernel_t; CCCL's toolkit check
# fails): below 12.3 the mix, not the sources, would fail.
case "$VERSION" in
    12.[3-9]) ;;
    *) echo "[cuda12] VERSION must be a CUDA 12 release from 12.3 to 12.9, not '$VERSION'" >&2; exit 2 ;;
esac
MINOR="${VERSION#12.}"
CACHE="${MOK_CUDA12_CACHE:-$ROOT/.cuda12}"
WHEELS="$CACHE/wheels-$VERSION"
TREE="$CACHE/include-$VERSION"
BUILD="$CACHE/build-$VERSION"

NVCC="$(command -v nvcc || true)"
if [ -z "$NVCC" ]; then
    echo "[cuda12] no nvcc on PATH: the check cannot run here" >&2
    exit 2
fi
# nvcc's own include folder, as nvcc itself names it (nvcc may be a wrapper script on PATH).
NVCC_INCLUDE="$("$NVCC" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 \
    | sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -n 1)"
if [ -z "$NVCC_INCLUDE" ] || [ ! -d "$NVCC_INCLUDE/crt" ]; then
    echo "[cuda12] $NVCC_INCLUDE/crt not found (nvcc's own headers): the check cannot run here" >&2
    exit 2
fi

if [ ! -f "$TREE/.complete" ]; then
    mkdir -p "$WHEELS"
    echo "[cuda12] fetching the CUDA $VERSION runtime and CCCL headers (PyPI wheels, ~4 MB)"
    if ! "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
            -d "$WHEELS" "nvidia-cuda-runtime-cu12==$VERSION.*" "nvidia-cuda-cccl-cu12==$VERSION.*"; then
        echo "[cuda12] could not download the CUDA $VERSION header wheels: the check cannot run here" >&2
        exit 2
    fi
    rm -rf "$TREE"
    # One include tree: the runtime's and CCCL's headers (nvcc12_build_check.add_wheels, the
    # wheels' include/ folders), then (below) nvcc's own.
    "$PY" - "$ROOT/scripts" "$WHEELS" "$TREE" <<'PYEOF'
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from nvcc12_build_check import add_wheels
add_wheels(Path(sys.argv[2]), {"include": Path(sys.argv[3])})
PYEOF
    # The compiler's own headers (what the nvcc component ships: crt/ and fatbinary_section.h,
    # which the stubs cudafe++ writes include) come from the compiler that reads them.
    rm -rf "$TREE/crt"
    cp -r "$NVCC_INCLUDE/crt" "$TREE/crt"
    cp "$NVCC_INCLUDE/fatbinary_section.h" "$TREE/"
    touch "$TREE/.complete"
fi

# The tree must be the one the compiler reads: CUDART_VERSION is the release's (12030 for 12.3).
PROBE="$CACHE/probe-$VERSION.cu"
cat > "$PROBE" <<EOF
#include <cuda_runtime.h>
#include <cub/version.cuh>
static_assert(CUDART_VERSION / 1000 == 12 && CUDART_VERSION % 1000 / 10 == $MINOR,
              "the headers read are not CUDA $VERSION's");
EOF
if ! "$NVCC" -std=c++17 -I"$TREE" -c "$PROBE" -o "$CACHE/probe-$VERSION.o"; then
    echo "[cuda12] the header tree $TREE is not what nvcc reads (probe failed): the check cannot run here" >&2
    exit 2
fi

mkdir -p "$BUILD"
echo "[cuda12] compiling csrc/ against CUDA $VERSION's headers with $("$NVCC" --version | grep -o 'release [0-9.]*')'s compiler"
start=$(date +%s)
# -H: the host pass lists every header it reads, so a header missing from the tree and found in
# nvcc's own folder instead (a CUDA 13-only header) is caught rather than compiled unseen.
LOG="$CACHE/build-$VERSION.log"
if ! make -C csrc -s -B OUT="$BUILD" NVCC="$NVCC" EXTRA="-I$TREE -Xcompiler -H" > "$LOG" 2>&1; then
    # the compiler's messages, without -H's header list and include-guard hints
    grep -E -A3 'error|warning' "$LOG" | grep -v -E '^\.+ |^/[^ ]*$|^Multiple include guards' | tail -n 40 >&2 || true
    echo "[cuda12] FAILED: csrc/ does not compile against CUDA $VERSION's headers: guard the newer API or raise setup.py's MIN_NVCC" >&2
    exit 1
fi
# (collected first: a `grep | head` in the test itself would lose its match to SIGPIPE under
# pipefail once the list outgrows the pipe)
LEAKED="$(grep -F -e "$NVCC_INCLUDE" -e "$(readlink -f "$NVCC_INCLUDE")" "$LOG" | grep '^\.\+ ' || true)"
if [ -n "$LEAKED" ]; then
    printf '%s\n' "$LEAKED" | sort -u | head -n 5 >&2 || true
    echo "[cuda12] FAILED: the headers above are not in CUDA $VERSION's runtime or CCCL (read from nvcc's own folder)" >&2
    exit 1
fi
echo "[cuda12] OK: csrc/ compiles against CUDA $VERSION's runtime and CCCL headers ($(( $(date +%s) - start )) s);" \
     "nvcc 12's own front end: scripts/nvcc12_build_check.py"

#!/usr/bin/env bash
# The Megatron integration's CPU tests (tests/megatron) against another megatron-core release
# than the one scripts/setup.sh installs, without a second venv:
#
#   bash scripts/megatron_release_tests.sh [VERSION] [PYTEST ARGS ...]     (default 0.19.2)
#
# Why: the GPU machine runs megatron-core 0.19.x (Python 3.12), while this machine and CI have
# Python 3.11, where pip stops at 0.16.x (0.17 on require Python >= 3.12). Without this, the
# version-gated code for 0.19 (megatron_mok/megatron/versions.py) is tested only in device
# sessions. How, and what differs from a real 0.19 install (say so wherever a result is quoted):
#   - the release's cp312 wheel is downloaded (`pip download --python-version 3.12`) and
#     unpacked into .megatron_releases/VERSION/site, which goes first on PYTHONPATH. Only its
#     pure-Python code runs here: the one compiled module (the datasets' C++ helpers) is for
#     Python 3.12 and nothing of ours imports it;
#   - triton is installed into that folder (megatron-core 0.19's paged stash imports it at
#     module load; the CPU torch wheel ships none); nothing here runs a triton kernel;
#   - `typing.override` (Python 3.12), which megatron.training 0.19 imports, is added to 3.11's
#     `typing` by a sitecustomize.py in .megatron_releases/VERSION/shim (an identity decorator,
#     as 3.12's is apart from setting `__override__`); on Python >= 3.12 it does nothing.
# Needs the venv of scripts/setup.sh (torch, pytest, the project) and the package registry.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VERSION="${1:-0.19.2}"
shift || true
PY="$ROOT/${MOK_VENV:-.venv}/bin/python"
[ -x "$PY" ] || { echo "no venv at ${MOK_VENV:-.venv}: run scripts/setup.sh first" >&2; exit 2; }
DIR="$ROOT/.megatron_releases/$VERSION"
SITE="$DIR/site"
SHIM="$DIR/shim"

if [ ! -f "$SITE/.complete" ]; then
    echo "[megatron $VERSION] fetching the wheel and triton into $SITE"
    rm -rf "$DIR" && mkdir -p "$DIR/wheels" "$SITE" "$SHIM"
    "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
        --python-version 3.12 -d "$DIR/wheels" "megatron-core==$VERSION"
    "$PY" -m zipfile -e "$DIR"/wheels/megatron_core-"$VERSION"-*.whl "$SITE"
    if ! "$PY" -c "import triton" 2>/dev/null; then
        "$PY" -m pip install --disable-pip-version-check -q --no-deps --target "$SITE" triton
    fi
    rm -rf "$DIR/wheels"
    touch "$SITE/.complete"
fi
cat > "$SHIM/sitecustomize.py" <<'PYEOF'
# scripts/megatron_release_tests.sh: megatron.training 0.19 imports typing.override (3.12).
import typing

if not hasattr(typing, "override"):
    def override(f):
        try:
            f.__override__ = True
        except (AttributeError, TypeError):
            pass
        return f

    typing.override = override
PYEOF

export PYTHONPATH="$SHIM:$SITE${PYTHONPATH:+:$PYTHONPATH}"
FOUND=$("$PY" -c "import megatron.core as m; print(m.__version__)" 2>/dev/null | tail -n 1)
# (megatron's package_info appends the commit of a git checkout around it: "0.19.2+abc1234")
if [ "${FOUND%%+*}" != "$VERSION" ]; then
    echo "[megatron $VERSION] megatron.core imports as '$FOUND', not $VERSION: refusing to run" >&2
    exit 3
fi
echo "[megatron $VERSION] tests/megatron with megatron-core $FOUND from $SITE (python $("$PY" -c 'import sys; print(sys.version.split()[0])'))"
set +e
"$PY" -m pytest -q tests/megatron -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "[megatron $VERSION] pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$rc"

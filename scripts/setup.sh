#!/usr/bin/env bash
# Creates .venv in the repository root (if missing) and installs what megatron_mok, its tests
# and its benchmarks need; then installs the project itself in editable mode, which builds
# the CUDA library when nvcc is found (see setup.py; MOK_SKIP_CUDA_BUILD=1 skips it); then the
# optional C++ host ops when a C++ compiler is found (MOK_SKIP_HOST_OPS_BUILD=1 skips them).
# Safe to run again: it only installs what is missing.
#
# Knobs (environment):
#   PYTHON=python3.11            interpreter for the venv (default: python3)
#   MOK_VENV=.venv               where the venv goes
#   MOK_SYSTEM_SITE_PACKAGES=1   let the venv see the interpreter's packages (e.g. a machine
#                                with a CUDA build of torch and no network)
#   MOK_SKIP_DEPS=1              install no dependencies, only the project (offline machines)
#   MOK_TORCH_SPEC=torch==2.13.0 the torch to install when none is importable
#   MOK_MEGATRON_CORE_SPEC=megatron-core==0.16.1  (CI runs 0.16.x; 0.19.x is also supported)
#   MOK_SETUP_BRIDGE=0           do not install Megatron-Bridge. By default, when the installed
#                                megatron-core is 0.16.x (Bridge 0.3.1's range: it pins
#                                megatron-core<0.17), megatron-bridge==0.3.1 is installed with
#                                --no-deps (its full requirements pull TransformerEngine, ModelOpt,
#                                ...) plus the few packages its config / model-provider paths
#                                import (transformers<5, omegaconf, hydra-core, ...), with torch,
#                                megatron-core and numpy held at their installed versions. Used by
#                                tests/megatron/test_megatron_bridge.py (skipped without it).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${MOK_VENV:-.venv}"
TORCH_SPEC="${MOK_TORCH_SPEC:-torch==2.13.0}"
# The versions the project is developed and tested with.
DEPS=(numpy pytest packaging "${MOK_MEGATRON_CORE_SPEC:-megatron-core==0.16.1}")

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV with $($PYTHON --version 2>&1)"
    if [ "${MOK_SYSTEM_SITE_PACKAGES:-0}" = "1" ]; then
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$ROOT/$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check)
# A CPU wheel of torch may lie on this disk; pip looks there too.
if [ -d /opt/wheels ]; then
    PIP+=(--find-links /opt/wheels)
fi

if [ "${MOK_SKIP_DEPS:-0}" != "1" ]; then
    # setuptools >= 70.1 builds editable wheels without the separate `wheel` package.
    "${PIP[@]}" -q "setuptools>=70.1" wheel
    if "$PY" -c "import torch" 2>/dev/null; then
        echo "[setup] torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
    else
        echo "[setup] installing $TORCH_SPEC"
        "${PIP[@]}" -q "$TORCH_SPEC"
    fi
    # torch is already there, so megatron-core's plain `torch` requirement installs nothing more.
    "${PIP[@]}" -q "${DEPS[@]}"

    # Megatron-Bridge (see MOK_SETUP_BRIDGE above). Its dependencies go in first and
    # megatron-bridge itself last, so a present `megatron.bridge` means the set is complete.
    BRIDGE_STATE="$("$PY" - <<'PYEOF'
import importlib.metadata as md, importlib.util
try:
    core = md.version("megatron-core")
except md.PackageNotFoundError:
    core = ""
if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.bridge") is not None:
    print("installed " + md.version("megatron-bridge"))
elif core.startswith("0.16."):
    print("install")
else:
    print("skip megatron-core " + (core or "missing") + " is outside Megatron-Bridge 0.3.1's range (0.16.x)")
PYEOF
)"
    if [ "${MOK_SETUP_BRIDGE:-1}" = "0" ]; then
        echo "[setup] Megatron-Bridge: skipped (MOK_SETUP_BRIDGE=0)"
    elif [ "${BRIDGE_STATE%% *}" = "installed" ]; then
        echo "[setup] Megatron-Bridge ${BRIDGE_STATE#installed } already installed"
    elif [ "$BRIDGE_STATE" = "install" ]; then
        echo "[setup] installing Megatron-Bridge 0.3.1 (--no-deps) and what its configs import"
        # Hold torch, megatron-core and numpy where they are: pip fails rather than change them.
        BRIDGE_PINS="$(mktemp)"
        "$PY" -c 'import importlib.metadata as md
for d in ("torch", "megatron-core", "numpy"):
    print(f"{d}=={md.version(d)}")' > "$BRIDGE_PINS"
        "${PIP[@]}" -q -c "$BRIDGE_PINS" "transformers<5" "huggingface-hub<1.0" "omegaconf>=2.3" \
            "hydra-core>1.3,<=1.3.2" pyyaml rich tqdm regex six einops
        "${PIP[@]}" -q -c "$BRIDGE_PINS" --no-deps "megatron-bridge==0.3.1"
        rm -f "$BRIDGE_PINS"
    else
        echo "[setup] Megatron-Bridge: skipped (${BRIDGE_STATE#skip })"
    fi
fi

if [ -f setup.py ] || [ -f pyproject.toml ]; then
    echo "[setup] installing megatron_mok (editable; builds the CUDA library if nvcc is found)"
    if [ "${MOK_SKIP_DEPS:-0}" = "1" ]; then
        "${PIP[@]}" --no-build-isolation --no-deps -e .
    else
        "${PIP[@]}" --no-build-isolation -e .
    fi
else
    echo "[setup] no setup.py yet: megatron_mok is used from the checkout (run from the repo root)"
fi

# The optional C++ host ops, against this venv's torch (setup.py cannot: pip builds an editable
# install of a setup.py project in an isolated environment without torch). Optional: a failed
# build leaves the Python path (tests/test_host_ops.py builds them strictly, so CI sees it).
if [ -f megatron_mok/cuda/host_ops.py ] && [ "${MOK_SKIP_HOST_OPS_BUILD:-0}" != "1" ]; then
    "$PY" -m megatron_mok.cuda.host_ops --if-stale \
        || echo "[setup] the C++ host ops did not build: the CUDA backend uses its Python path"
fi

"$PY" - <<'PYEOF'
import torch, megatron_mok
from megatron_mok.cuda import host_ops, library
print(f"[setup] ok: python {__import__('sys').version.split()[0]}, torch {torch.__version__} "
      f"(cuda available: {torch.cuda.is_available()}), megatron_mok {megatron_mok.__version__}, "
      f"CUDA library built: {library.is_available()}, "
      f"C++ host ops built: {host_ops.module_path().exists()}")
PYEOF

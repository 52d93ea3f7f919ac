"""The optional C++ host ops: a static-shape dispatch's, a cached dispatch's and a combine's host
side in one C++ call each, an eager dispatch's in two around its host read of R
(``csrc/host_ops/host_ops.cpp``; benchmarks/NOTES.md items 75-77).

The CUDA library (``library.py``) has a plain C ABI and no torch dependency. These ops are a
small torch extension beside it: they allocate a call's outputs with ``at::empty`` and call
the library's ``mok_dispatch_launch`` / ``mok_dispatch_layout`` / ``mok_combine`` through the
addresses ctypes resolved,
which saves the Python path's tensor and ctypes overhead (~1-2 us an operation). They decide
nothing: the backend passes every argument, and keeps the Python path, which is used when:

- the extension is not built (``scripts/setup.sh`` builds it after installing the package, and
  ``setup.py`` when torch is importable at build time, i.e. without build isolation; both need
  a C++ compiler; ``python -m megatron_mok.cuda.host_ops`` builds it by hand), or was built for
  another torch (its C++ ABI) or another C ABI of the library: then a warning says so once;
- ``MOK_HOST_OPS=0`` is set (read when a backend is created);
- the call is not one of theirs: FP8 pairs read in place (their dispatches, routed or cached),
  the eager alternative schedules (stage-first, fill-first, speculative, side-stream staging).

A build lies in ``megatron_mok/_lib/host_ops/torch-<version>/`` with Python's extension
suffix, so a checkout used by several torch or Python versions keeps one build for each and
never imports another's.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from pathlib import Path
from typing import Optional

MODULE = "_mok_host_ops"
_ROOT = Path(__file__).resolve().parent.parent.parent          # the checkout (csrc/ beside it)
SOURCE = _ROOT / "csrc" / "host_ops" / "host_ops.cpp"
HEADER = _ROOT / "csrc" / "api" / "mok_api.h"       # the C ABI it calls (its version is compiled in)
_lock = threading.Lock()
_state: dict = {}          # "module": the loaded module or None; "why": why not


def build_dir(torch_version: Optional[str] = None) -> Path:
    """Where the build for ``torch_version`` (default: the running torch's) lies."""
    if torch_version is None:
        import torch
        torch_version = torch.__version__
    return Path(__file__).resolve().parent.parent / "_lib" / "host_ops" / f"torch-{torch_version}"


def module_path(torch_version: Optional[str] = None) -> Path:
    return build_dir(torch_version) / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def _pybind11_abi_flags(torch) -> list:
    """The pybind11 ABI flags torch's own extension builder adds on releases that export them
    (``torch._C._PYBIND11_*``; none since torch 2.9, where pybind11 handles its ABI itself)."""
    flags = []
    for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
        value = getattr(torch._C, f"_PYBIND11_{name}", None)
        if value is not None:
            flags.append(f'-DPYBIND11_{name}="{value}"')
    return flags


def build_command(out: Path, compiler: Optional[str] = None) -> list:
    """The compiler command that builds the extension for the running torch and Python into
    ``out``: torch's include and library paths, its C++ ABI flag, ``csrc/api`` for
    ``mok_api.h``, and the torch version the loader checks."""
    import torch
    from torch.utils import cpp_extension

    cxx = compiler or os.environ.get("CXX", "c++")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"],
                str(_ROOT / "csrc" / "api")]
    libs = cpp_extension.library_paths()
    return [cxx, "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
            *(f"-I{p}" for p in includes),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DTORCH_EXTENSION_NAME={MODULE}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            f'-DMOK_TORCH_VERSION="{torch.__version__}"', *_pybind11_abi_flags(torch),
            str(SOURCE), "-o", str(out),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs),
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def up_to_date(path: Path) -> bool:
    """The build at ``path`` is newer than its source and the C ABI header."""
    return path.exists() and all(path.stat().st_mtime >= src.stat().st_mtime for src in (SOURCE, HEADER))


def build(verbose: bool = True, strict: bool = True, force: bool = True) -> Optional[Path]:
    """Builds the extension for the running torch (~30-60 s); returns its path, or None where it
    cannot be built here (no torch headers, no compiler, no source: a source-less install),
    with the reason printed. A compile error raises ``CalledProcessError``, or with
    ``strict=False`` (``setup.py``: an install must not fail for an optional part) is printed
    and gives None; ``tests/test_host_ops.py`` builds with ``strict`` on, so CI catches it.
    ``force=False`` (``--if-stale``: what ``scripts/setup.sh``, run again and again, and
    ``setup.py`` ask) keeps a build that is newer than its source and the C ABI header."""
    def say(msg):
        if verbose:
            print(f"[megatron_mok] {msg}", flush=True)

    if os.environ.get("MOK_SKIP_HOST_OPS_BUILD", "0") == "1":
        say("MOK_SKIP_HOST_OPS_BUILD=1: not building the C++ host ops")
        return None
    if not SOURCE.exists():
        say(f"{SOURCE} not found: the C++ host ops are not built")
        return None
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension  # noqa: F401
    except ImportError as e:
        say(f"torch is not importable ({e}): the C++ host ops are not built")
        return None
    out = module_path()
    if not force and up_to_date(out):
        say(f"the C++ host ops are up to date ({out})")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    cmd = build_command(tmp)
    if not (Path(cmd[0]).exists() or shutil.which(cmd[0])):
        say(f"no C++ compiler ({cmd[0]}): the C++ host ops are not built (the Python path is used)")
        return None
    say("building the C++ host ops: " + " ".join(shlex.quote(c) for c in cmd[:2]) + " ... -o " + str(out))
    try:
        subprocess.run(cmd, check=True)
    except subprocess.CalledProcessError as e:
        if strict:
            raise
        say(f"the C++ host ops failed to build ({e}); the Python path is used")
        return None
    os.replace(tmp, out)   # a reader never sees a half-written module
    return out


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _load(abi_version: int):
    import torch

    path = module_path()
    if not path.exists():
        return None, f"not built for torch {torch.__version__} ({path} is missing)", False
    try:
        module = _import(path)
    except ImportError as e:
        return None, f"{path} does not import ({e})", True
    if module.torch_version != torch.__version__:
        return None, f"{path} was built for torch {module.torch_version}, this is {torch.__version__}", True
    if module.abi_version != abi_version:
        return None, (f"{path} was built for the library's C ABI {module.abi_version}, the loaded "
                      f"library has {abi_version}: rebuild it (python -m megatron_mok.cuda.host_ops)"), True
    return module, None, False


def get(abi_version: int):
    """The loaded extension, or None (then :func:`why_not` says why). ``abi_version``: the loaded
    library's (``mok_abi_version()``). Loaded once per process; a build that exists but cannot
    be used is warned about once (a missing build is the normal case without a compiler and is
    not). ``MOK_HOST_OPS=0``: None."""
    if os.environ.get("MOK_HOST_OPS", "1") == "0":
        return None
    with _lock:
        if "module" not in _state:
            module, why, warn = _load(abi_version)
            _state.update(module=module, why=why)
            if warn:
                warnings.warn(f"megatron_mok: the C++ host ops are not used, the Python path is: {why}",
                              RuntimeWarning, stacklevel=3)
        return _state["module"]


def why_not() -> Optional[str]:
    """Why :func:`get` returned None (None when it was loaded, or not asked yet)."""
    if os.environ.get("MOK_HOST_OPS", "1") == "0":
        return "MOK_HOST_OPS=0"
    return _state.get("why")


def main(argv=None) -> int:
    """``python -m megatron_mok.cuda.host_ops [--if-stale] [--print-command]``: build for the
    running torch (``--if-stale``: only where no build newer than the sources exists;
    ``scripts/setup.sh`` runs that)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--print-command" in argv:
        print(" ".join(shlex.quote(c) for c in build_command(module_path())))
        return 0
    path = build(force="--if-stale" not in argv)
    if path is None:
        return 1
    print(f"[megatron_mok] C++ host ops ready: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

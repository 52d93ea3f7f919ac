"""Builds csrc/ with a real CUDA 12 nvcc, end to end, and loads the library it makes.

Why: setup.py accepts nvcc >= 12.3 (MIN_NVCC), but every machine the project builds on has
nvcc 13. ``cuda12_headers_check.sh`` checks the sources against CUDA 12.3's API headers with
nvcc 13's compiler; this script checks what that one cannot: CUDA 12's own front end (cudafe++,
cicc), its ptxas and its fatbinary/nvlink, i.e. that a CUDA 12 user's ``pip install`` compiles
and links every kernel for sm_90a.

Where the compiler comes from: PyPI ships no CUDA 12 nvcc driver (nvidia-cuda-nvcc-cu12 holds
ptxas, libnvvm and the crt/ headers), so the tools come from Debian's ``nvidia-cuda-toolkit``
package (non-free; trixie carries 12.4, the oldest CUDA 12 nvcc any registry this machine
reaches offers), the headers from PyPI's cu12 wheels of the same release:

  Debian nvidia-cuda-toolkit (87 MB .deb)   nvcc, cudafe++, cicc, ptxas, fatbinary, nvlink, libdevice
  nvidia-cuda-nvcc-cu12 == that release    crt/ and fatbinary_section.h (nvcc's own headers)
  nvidia-cuda-runtime-cu12, -cccl-cu12     the runtime API, fp16/bf16/fp8 types, CUB; libcudart.so.12

What differs from a CUDA 12 toolkit install: the library links the shared cudart (``-cudart
shared``; the static one is only in Debian's 934 MB nvidia-cuda-dev), and ``-lcudadevrt``,
which nvcc adds to every link, resolves to an empty archive (nothing is compiled with -rdc, so
nothing is taken from it; the load check below would fail on a symbol left undefined).

Checks, in order: the package's SHA256 when the tree is assembled (from the suite's Packages index,
fetched over HTTPS; a cached tree is not hashed again);
``nvcc --version`` is the release; csrc/ compiles and links (``make -C csrc``); the library holds
one cubin per source file and architecture; it loads with CUDA 12's libcudart and every C ABI function
``megatron_mok/cuda/bindings.py`` declares resolves (no GPU is needed to load it); with
``--pytest PYTHON``, the CPU tests that drive the real library's host side (argument checks,
workspace layout; ``LIBRARY_TESTS``) pass with this build loaded instead. Then it prints
ptxas's registers / stack / spills per kernel (``--json`` writes them).

  python3 scripts/nvcc12_build_check.py [--json FILE] [--keep DIR] [--toolkit DIR] [--pytest PYTHON]

``--keep DIR`` copies the built library and CUDA 12's libcudart.so.12 there (to run the GPU
suite with it: MOK_CUDA_LIB=DIR/libmok_cuda.so LD_LIBRARY_PATH=DIR). Downloads and the tool tree
are cached under $MOK_CUDA12_CACHE (default .cuda12/, ignored by git); $MOK_DEBIAN_MIRROR names
another Debian mirror, $MOK_CUDA_ARCH other architectures (as setup.py reads it; default 90a). Exit status: 0 built and
loaded; 1 the sources failed (compile, link, cubins or load); 2 this machine cannot run the
check (no registry, no such package); either way it says why.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIRROR = os.environ.get("MOK_DEBIAN_MIRROR", "https://deb.debian.org/debian")
SUITE = "trixie"
PACKAGE = "nvidia-cuda-toolkit"


def _archs() -> list:
    # megatron_mok/cuda/arch.py, loaded from its file (the package imports torch; python3 here
    # need not have it)
    spec = importlib.util.spec_from_file_location("_mok_arch", ROOT / "megatron_mok" / "cuda" / "arch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_archs(os.environ.get("MOK_CUDA_ARCH"))


# Members of the .deb the tool tree needs: path in the package -> path in the tree.
_TOOLS = {
    "usr/lib/nvidia-cuda-toolkit/bin/nvcc": "bin/nvcc",
    "usr/lib/nvidia-cuda-toolkit/bin/crt/link.stub": "bin/crt/link.stub",
    "usr/lib/nvidia-cuda-toolkit/bin/crt/prelink.stub": "bin/crt/prelink.stub",
    "usr/lib/nvidia-cuda-toolkit/bin/cicc": "nvvm/bin/cicc",
    "usr/lib/nvidia-cuda-toolkit/libdevice/libdevice.10.bc": "nvvm/libdevice/libdevice.10.bc",
    **{f"usr/bin/{tool}": f"bin/{tool}"
       for tool in ("cudafe++", "ptxas", "fatbinary", "nvlink", "bin2c", "cuobjdump")},
}
# nvcc reads nvcc.profile next to itself; Debian's points at /usr paths, this one at the tree.
_PROFILE = """\
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib"
"""


class CannotCheck(Exception):
    """This machine cannot run the check (exit 2)."""


class Failed(Exception):
    """The sources failed the check (exit 1)."""


def log(msg: str) -> None:
    print(f"[nvcc12] {msg}", flush=True)


# -- the Debian package ------------------------------------------------------------------------

def parse_packages(text: str, package: str) -> dict:
    """The stanza of ``package`` in a Debian Packages index, as a dict of its fields."""
    for stanza in text.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z0-9-]+): (.*)$", stanza, flags=re.M))
        if fields.get("Package") == package:
            missing = [k for k in ("Version", "Filename", "SHA256") if k not in fields]
            if missing:
                raise CannotCheck(f"the index's {package} entry lacks {', '.join(missing)}")
            return fields
    raise CannotCheck(f"no {package} in the index")


def upstream_release(version: str) -> tuple[str, str]:
    """(full, major.minor) of a Debian version such as ``12.4.131~12.4.1-2``: ('12.4.131', '12.4')."""
    m = re.match(r"(?:\d+:)?((\d+)\.(\d+)\.\d+)", version)
    if not m or m.group(2) != "12":
        raise CannotCheck(f"{PACKAGE} {version} is not a CUDA 12 release")
    return m.group(1), f"{m.group(2)}.{m.group(3)}"


def read_ar(data: bytes) -> dict:
    """Members of an ar archive (a .deb is one): name -> bytes."""
    if not data.startswith(b"!<arch>\n"):
        raise CannotCheck("not an ar archive (.deb)")
    members, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        members[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)  # members are 2-byte aligned
    return members


def extract_tools(deb: bytes, tree: Path) -> None:
    """Writes the members of ``_TOOLS`` from the package's data archive into ``tree``."""
    members = read_ar(deb)
    data_name = next((n for n in members if n.startswith("data.tar")), None)
    if data_name is None or data_name.endswith(".zst"):
        raise CannotCheck(f"the package's data archive is {data_name or 'missing'} (xz/gz/bz2 read here)")
    found = set()
    with tarfile.open(fileobj=io.BytesIO(members[data_name]), mode="r:*") as tar:
        for info in tar:
            name = info.name.removeprefix("./")
            if name in _TOOLS and info.isfile():
                dest = tree / _TOOLS[name]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(tar.extractfile(info).read())
                dest.chmod(0o755)
                found.add(name)
    missing = sorted(set(_TOOLS) - found)
    if missing:
        raise CannotCheck(f"the package lacks {', '.join(missing)}")


def fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            return r.read()
    except OSError as e:
        raise CannotCheck(f"cannot fetch {url}: {e}") from None


def index_entry() -> dict:
    """The package's entry in the suite's Packages index (version, file, checksum)."""
    index_url = f"{MIRROR}/dists/{SUITE}/non-free/binary-amd64/Packages.xz"
    return parse_packages(lzma.decompress(fetch(index_url)).decode(), PACKAGE)


def fetch_package(cache: Path, entry: dict) -> bytes:
    """The .deb ``entry`` names (downloaded once into ``cache``), checked against its SHA256."""
    deb_path = cache / Path(entry["Filename"]).name
    if not deb_path.exists():
        log(f"fetching {PACKAGE} {entry['Version']} from {MIRROR} ({int(entry.get('Size', 0)) >> 20} MB)")
        deb_path.write_bytes(fetch(f"{MIRROR}/{entry['Filename']}"))
    deb = deb_path.read_bytes()
    digest = hashlib.sha256(deb).hexdigest()
    if digest != entry["SHA256"]:
        deb_path.unlink()
        raise CannotCheck(f"{deb_path.name}: SHA256 {digest} is not the index's {entry['SHA256']}")
    return deb


# -- the tool tree -----------------------------------------------------------------------------

def add_wheels(wheels: Path, dests: dict) -> None:
    """The nvidia-*-cu12 wheels' folders into ``dests`` ({"include": Path, "lib": Path}: which
    folders, and where each goes). scripts/cuda12_headers_check.sh calls it for the headers."""
    for path in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                parts = name.split("/")
                # nvidia/<component>/<folder>/<path>
                if (len(parts) > 3 and parts[0] == "nvidia" and parts[2] in dests
                        and not name.endswith("/") and parts[-1] != "__init__.py"):
                    dest = Path(dests[parts[2]]).joinpath(*parts[3:])
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(z.read(name))


def build_tree(cache: Path) -> Path:
    """Downloads (cached) and assembles the CUDA 12 tool tree; returns it."""
    cache.mkdir(parents=True, exist_ok=True)
    entry = index_entry()
    full, release = upstream_release(entry["Version"])
    tree = cache / f"nvcc-{full}"
    if (tree / ".complete").exists():
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    extract_tools(fetch_package(cache, entry), tree)
    wheels = cache / f"wheels-nvcc-{full}"
    wheels.mkdir(exist_ok=True)
    log(f"fetching the CUDA {release} nvcc headers, runtime and CCCL (PyPI wheels)")
    pip = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--platform", "manylinux2014_x86_64", "-d", str(wheels),
           f"nvidia-cuda-nvcc-cu12=={full}", f"nvidia-cuda-runtime-cu12=={release}.*",
           f"nvidia-cuda-cccl-cu12=={release}.*"]
    if subprocess.run(pip).returncode != 0:
        raise CannotCheck(f"could not download the CUDA {release} wheels (nvcc headers {full})")
    add_wheels(wheels, {"include": tree / "include", "lib": tree / "lib"})
    (tree / "bin" / "nvcc.profile").write_text(_PROFILE)
    # nvcc links -lcudadevrt always; without -rdc nothing is taken from it (see the docstring).
    subprocess.run(["ar", "rc", str(tree / "lib" / "libcudadevrt.a")], check=True)
    so = tree / "lib" / "libcudart.so"
    if not so.exists():
        so.symlink_to("libcudart.so.12")
    (tree / ".complete").write_text(entry["Version"] + "\n")
    return tree


# -- the checks --------------------------------------------------------------------------------

def nvcc_release(tree: Path) -> str:
    out = subprocess.run([str(tree / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
    m = re.search(r"release (\d+\.\d+), V([\d.]+)", out.stdout)
    if out.returncode != 0 or not m or not m.group(1).startswith("12."):
        raise CannotCheck(f"{tree}/bin/nvcc is not a CUDA 12 nvcc: {(out.stdout + out.stderr).strip()[-300:]}")
    return m.group(2)


def build_library(tree: Path, out: Path, archs: list) -> str:
    """``make -C csrc`` with the tree's nvcc; returns the compiler's report (ptxas included)."""
    cmd = ["make", "-C", str(ROOT / "csrc"), "-s", "-B", f"ARCH={' '.join(archs)}", f"OUT={out}",
           f"NVCC={tree / 'bin' / 'nvcc'}", "EXTRA=-cudart shared --resource-usage"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    report = r.stdout + r.stderr
    if "unsupported GNU version" in report or "unsupported clang version" in report:
        raise CannotCheck("this machine's host compiler is newer than CUDA 12's nvcc accepts: "
                          + next(l for l in report.splitlines() if "unsupported" in l).strip())
    if r.returncode != 0 or not (out / "libmok_cuda.so").exists():
        errors = [l for l in report.splitlines() if re.search(r"error|undefined", l)]
        raise Failed("csrc/ does not build with CUDA 12's nvcc:\n" + "\n".join(errors[-40:] or report.splitlines()[-40:]))
    return report


def check_cubins(tree: Path, lib: Path, archs: list) -> list:
    """One cubin per csrc source file (the Makefile's SRC) and architecture; returns them."""
    listing = subprocess.run([str(tree / "bin" / "cuobjdump"), "--list-elf", str(lib)],
                             capture_output=True, text=True).stdout
    cubins = re.findall(r"ELF file\s+\d+: (\S+)", listing)
    sources = sorted(p.stem for d in ("api", "layout", "kernels") for p in (ROOT / "csrc" / d).glob("*.cu"))
    missing = [f"{s}.sm_{a}" for s in sources for a in archs if f"{s}.sm_{a}.cubin" not in cubins]
    if not sources or missing:
        raise Failed(f"no cubin {', '.join(missing) or 'for any source'} in {lib} ({cubins})")
    return cubins


_LOAD = """
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("bindings", sys.argv[1])
bindings = importlib.util.module_from_spec(spec); spec.loader.exec_module(bindings)
cudart = ctypes.CDLL("libcudart.so.12")
version = ctypes.c_int()
assert cudart.cudaRuntimeGetVersion(ctypes.byref(version)) == 0
lib = ctypes.CDLL(sys.argv[2])
bindings.declare(lib)
print(version.value, lib.mok_abi_version(), len(bindings._SIGNATURES))
"""


def load_check(tree: Path, lib: Path) -> tuple[int, int, int]:
    """Loads the library (every symbol bound now) beside CUDA 12's libcudart and declares every
    C ABI function; returns (CUDART version, ABI version, functions declared)."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(tree / "lib"))
    r = subprocess.run([sys.executable, "-c", _LOAD, str(ROOT / "megatron_mok" / "cuda" / "bindings.py"),
                        str(lib)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise Failed(f"{lib} built by CUDA 12's nvcc does not load: {r.stderr.strip()[-800:]}")
    runtime, abi, n = (int(x) for x in r.stdout.split())
    return runtime, abi, n


# The CPU tests that drive the real library's host side (its argument checks, the workspace
# layout, the ABI): run once more with the CUDA 12 build loaded in its place.
LIBRARY_TESTS = ("tests/test_cuda_library_abi.py", "tests/test_errors.py", "tests/test_input_checks.py",
                 "tests/test_workspace_allocation.py", "tests/test_gpu_support.py")
_PREFLIGHT = """
import sys
from megatron_mok.cuda import library
assert library.is_available(), library._load_error
assert str(library.library_path()) == sys.argv[1], library.library_path()
"""


def library_tests(python: str, tree: Path, lib: Path) -> str:
    """LIBRARY_TESTS under ``python`` (one with torch and pytest) with ``lib`` as the library
    (MOK_CUDA_LIB) and CUDA 12's libcudart; returns pytest's summary line."""
    env = dict(os.environ, MOK_CUDA_LIB=str(lib), LD_LIBRARY_PATH=str(tree / "lib"))
    pre = subprocess.run([python, "-c", _PREFLIGHT, str(lib)], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    if pre.returncode != 0:  # the tests would skip themselves, and pass, without it
        raise Failed(f"the package does not load {lib} under {python}: {pre.stderr.strip()[-600:]}")
    r = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *LIBRARY_TESTS],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    summary = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    if r.returncode != 0:
        raise Failed(f"the library's CPU tests fail with the CUDA 12 build: {summary}\n"
                     + "\n".join(l for l in r.stdout.splitlines() if l.startswith(("FAILED", "ERROR")))[:3000])
    return summary


def resource_usage(report: str) -> list:
    """ptxas's card per kernel: [{kernel, registers, stack, spill_stores, spill_loads}]."""
    rows, name = [], None
    for line in report.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name, stack, stores, loads = m.group(1), 0, 0, 0
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            stack, stores, loads = (int(x) for x in m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            rows.append(dict(kernel=name, registers=int(m.group(1)), stack=stack,
                             spill_stores=stores, spill_loads=loads))
            name = None
    return rows


def demangle(name: str) -> str:
    """A kernel's name as the source spells it, short (the mangled one where c++filt is absent)."""
    try:
        text = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
    except OSError:
        return name
    text = re.sub(r"mok::\(anonymous namespace\)::", "", text or name)
    return re.sub(r"\(mok::.*", "", text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the outcome and ptxas's card per kernel here")
    ap.add_argument("--keep", help="copy libmok_cuda.so and CUDA 12's libcudart.so.12 here")
    ap.add_argument("--toolkit", help="an assembled tool tree to use instead of downloading one")
    ap.add_argument("--pytest", metavar="PYTHON", help="then run the library's CPU tests "
                    "(LIBRARY_TESTS) under this interpreter with the CUDA 12 build loaded")
    args = ap.parse_args(argv)
    cache = Path(os.environ.get("MOK_CUDA12_CACHE", ROOT / ".cuda12"))
    archs = _archs()
    try:
        tree = Path(args.toolkit) if args.toolkit else build_tree(cache)
        release = nvcc_release(tree)
        out = cache / f"build-nvcc-{release}"
        log(f"building csrc/ with nvcc {release} ({', '.join('sm_' + a for a in archs)})")
        start = time.time()
        report = build_library(tree, out, archs)
        lib = out / "libmok_cuda.so"
        cubins = check_cubins(tree, lib, archs)
        runtime, abi, n = load_check(tree, lib)
        tests = library_tests(args.pytest, tree, lib) if args.pytest else None
    except CannotCheck as e:
        log(f"the check cannot run here: {e}")
        return 2
    except Failed as e:
        log(f"FAILED: {e}")
        return 1
    rows = resource_usage(report)
    for row in rows:
        if row["spill_stores"] or row["spill_loads"]:
            log(f"  {row['registers']} registers, spills {row['spill_stores']}/{row['spill_loads']} B "
                f"(stores/loads): {demangle(row['kernel'])}")
    if args.keep:
        keep = Path(args.keep)
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, keep / lib.name)
        shutil.copy2(tree / "lib" / "libcudart.so.12", keep / "libcudart.so.12")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            nvcc=release, archs=[f"sm_{a}" for a in archs], cudart_version=runtime, abi_version=abi,
            functions_declared=n, cubins=cubins, library_tests=tests,
            seconds=round(time.time() - start, 1), kernels=rows), indent=1) + "\n")
    log(f"OK: csrc/ built by nvcc {release} ({len(cubins)} cubins, {round(time.time() - start)} s); "
        f"the library loads with CUDART {runtime} and its {n} C ABI functions (ABI {abi}) resolve"
        + (f"; its CPU tests with it: {tests}" if tests else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

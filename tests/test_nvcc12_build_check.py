"""scripts/nvcc12_build_check.py decides right (CPU; no network, no real CUDA compiler).

The script itself runs in CI (``.ci/run``) with Debian's real CUDA 12 nvcc. Here its own logic is
checked: reading the Debian index and package (an index without the package, a package whose
checksum is not the index's, a package without one of the tools: the check cannot run, exit 2),
and, with a stand-in tool tree whose nvcc builds a C stub of the library, its verdicts: a clean
build passes, a failed build, a missing cubin or a library that does not load (a C ABI function
missing) fail (exit 1), a compiler that is not CUDA 12's or a host compiler it refuses cannot
check (exit 2).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import lzma
import os
import stat
import subprocess
import sys
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "nvcc12_build_check.py")


def _load_script():
    spec = importlib.util.spec_from_file_location("nvcc12_build_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


check = _load_script()


def _ar(members: dict) -> bytes:
    """An ar archive (the .deb container) of name -> bytes."""
    out = io.BytesIO()
    out.write(b"!<arch>\n")
    for name, data in members.items():
        out.write(f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode())
        out.write(data + (b"\n" if len(data) % 2 else b""))
    return out.getvalue()


def _deb(files: dict, compression: str = "xz") -> bytes:
    """A .deb whose data archive holds path -> bytes (paths as dpkg writes them, './usr/...')."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compression}") as tar:
        for path, data in files.items():
            info = tarfile.TarInfo("./" + path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return _ar({"debian-binary": b"2.0\n", "control.tar.xz": b"x",
                f"data.tar.{compression}": buf.getvalue()})


def _tool_files(skip=()) -> dict:
    # odd and even sizes: the ar reader must skip the 1-byte padding after odd members
    files = {path: f"tool {path} {'x' * (len(path) % 2)}".encode() for path in check._TOOLS
             if path not in skip}
    files["usr/share/doc/nvidia-cuda-toolkit/copyright"] = b"not a tool"
    return files


# -- the Debian index and package ------------------------------------------------------------

INDEX = """\
Package: libnvvm4
Version: 12.4.131~12.4.1-2
Filename: pool/non-free/n/nvidia-cuda-toolkit/libnvvm4_12.4.131~12.4.1-2_amd64.deb
SHA256: 00

Package: nvidia-cuda-toolkit
Version: 12.4.131~12.4.1-2
Filename: pool/non-free/n/nvidia-cuda-toolkit/nvidia-cuda-toolkit_12.4.131~12.4.1-2_amd64.deb
Size: 87240108
SHA256: {sha}
"""


def test_the_index_entry_of_the_package_not_its_neighbours():
    entry = check.parse_packages(INDEX.format(sha="ab" * 32), "nvidia-cuda-toolkit")
    assert entry["Filename"].endswith("nvidia-cuda-toolkit_12.4.131~12.4.1-2_amd64.deb")
    assert entry["SHA256"] == "ab" * 32
    with pytest.raises(check.CannotCheck, match="no nvidia-cuda-dev"):
        check.parse_packages(INDEX, "nvidia-cuda-dev")
    with pytest.raises(check.CannotCheck, match="lacks SHA256"):
        check.parse_packages(INDEX.replace("SHA256: {sha}\n", ""), "nvidia-cuda-toolkit")


def test_upstream_release_of_debian_versions():
    assert check.upstream_release("12.4.131~12.4.1-2") == ("12.4.131", "12.4")
    assert check.upstream_release("1:12.6.85-1") == ("12.6.85", "12.6")
    for version in ("13.0.48~13.0.0-1", "11.8.89~11.8.0-5"):
        with pytest.raises(check.CannotCheck, match="not a CUDA 12 release"):
            check.upstream_release(version)


def test_extracts_every_tool_and_nothing_else(tmp_path):
    check.extract_tools(_deb(_tool_files()), tmp_path)
    for path, dest in check._TOOLS.items():
        written = tmp_path / dest
        assert written.read_bytes() == _tool_files()[path]
        assert written.stat().st_mode & stat.S_IXUSR
    assert not list(tmp_path.rglob("copyright"))


def test_a_package_without_a_tool_or_in_zstd_cannot_check(tmp_path):
    with pytest.raises(check.CannotCheck, match="lacks usr/bin/ptxas"):
        check.extract_tools(_deb(_tool_files(skip={"usr/bin/ptxas"})), tmp_path)
    zst = _ar({"debian-binary": b"2.0\n", "data.tar.zst": b"..."})
    with pytest.raises(check.CannotCheck, match="data.tar.zst"):
        check.extract_tools(zst, tmp_path)
    with pytest.raises(check.CannotCheck, match="not an ar archive"):
        check.extract_tools(b"PK\x03\x04 a zip", tmp_path)


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A file:// Debian mirror holding the index and a package; returns (deb bytes, cache,
    writer of the index's checksum)."""
    deb = _deb(_tool_files())
    root = tmp_path / "mirror"
    entry = check.parse_packages(INDEX.format(sha="0"), "nvidia-cuda-toolkit")
    pool = root / entry["Filename"]
    pool.parent.mkdir(parents=True)
    pool.write_bytes(deb)
    index = root / "dists" / "trixie" / "non-free" / "binary-amd64" / "Packages.xz"
    index.parent.mkdir(parents=True)

    def publish(sha):
        index.write_bytes(lzma.compress(INDEX.format(sha=sha).encode()))

    monkeypatch.setattr(check, "MIRROR", root.as_uri())
    cache = tmp_path / "cache"
    cache.mkdir()
    return deb, cache, publish


def test_fetches_the_package_the_index_names(mirror):
    deb, cache, publish = mirror
    publish(hashlib.sha256(deb).hexdigest())
    entry = check.index_entry()
    got = check.fetch_package(cache, entry)
    assert got == deb and entry["Version"] == "12.4.131~12.4.1-2"


def test_a_package_whose_checksum_is_not_the_indexs_is_refused_and_not_kept(mirror):
    deb, cache, publish = mirror
    publish("0" * 64)
    with pytest.raises(check.CannotCheck, match="SHA256"):
        check.fetch_package(cache, check.index_entry())
    assert not list(cache.glob("*.deb"))


def test_an_unreachable_mirror_cannot_check(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "MIRROR", (tmp_path / "nowhere").as_uri())
    with pytest.raises(check.CannotCheck, match="cannot fetch"):
        check.index_entry()


# -- the verdicts, with a stand-in tool tree -------------------------------------------------

FAKE_NVCC = r"""#!/usr/bin/env bash
# Stand-in CUDA 12 nvcc: --version as the test says; a build compiles $FAKE_STUB (C) into the
# file after -o and writes ptxas-style lines for one kernel.
case " $* " in *" --version "*)
    echo "Cuda compilation tools, release ${FAKE_RELEASE:-12.4}, V${FAKE_RELEASE:-12.4}.131"; exit 0 ;;
esac
[ -z "${FAKE_BUILD_MSG:-}" ] || echo "$FAKE_BUILD_MSG" >&2
[ "${FAKE_BUILD_RC:-0}" = 0 ] || exit "$FAKE_BUILD_RC"
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
echo "ptxas info    : Function properties for _Z6kernelv" >&2
echo "    48 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads" >&2
echo "ptxas info    : Used 64 registers, used 1 barriers" >&2
gcc -shared -fPIC -x c "$FAKE_STUB" -o "$out"
"""

FAKE_CUOBJDUMP = r"""#!/usr/bin/env bash
i=1
for name in $FAKE_CUBINS; do echo "ELF file    $i: $name.sm_90a.cubin"; i=$((i + 1)); done
"""


def _sources():
    return sorted(os.path.splitext(f)[0] for d in ("api", "layout", "kernels")
                  for f in os.listdir(os.path.join(REPO, "csrc", d)) if f.endswith(".cu"))


def _stub_c(skip=()) -> str:
    spec = importlib.util.spec_from_file_location(
        "bindings", os.path.join(REPO, "megatron_mok", "cuda", "bindings.py"))
    bindings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bindings)
    return "\n".join(f"int {name}(void) {{ return {bindings.ABI_VERSION}; }}"
                     for name in bindings._SIGNATURES if name not in skip) + "\n"


@pytest.fixture
def tree(tmp_path):
    if not all(map(lambda t: subprocess.run(["which", t], capture_output=True).returncode == 0,
                   ("gcc", "make"))):
        pytest.skip("gcc and make are needed to build the stand-in library")
    tk = tmp_path / "tk"
    (tk / "bin").mkdir(parents=True)
    (tk / "lib").mkdir()
    for name, text in (("nvcc", FAKE_NVCC), ("cuobjdump", FAKE_CUOBJDUMP)):
        (tk / "bin" / name).write_text(text)
        (tk / "bin" / name).chmod(0o755)
    # CUDA 12's libcudart, as far as the load check asks of it
    cudart = tmp_path / "cudart.c"
    cudart.write_text("int cudaRuntimeGetVersion(int *v) { *v = 12040; return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", str(cudart), "-o", str(tk / "lib" / "libcudart.so.12")],
                   check=True)
    stub = tmp_path / "stub.c"
    stub.write_text(_stub_c())
    env = dict(os.environ, MOK_CUDA12_CACHE=str(tmp_path / "cache"), FAKE_STUB=str(stub),
               FAKE_CUBINS=" ".join(_sources()))
    return tk, stub, env


def _run(tk, env, *args, **more):
    return subprocess.run([sys.executable, SCRIPT, "--toolkit", str(tk), *args],
                          env=dict(env, **more), capture_output=True, text=True, timeout=120)


def test_a_clean_build_that_loads_passes_and_reports_the_card(tree, tmp_path):
    tk, _, env = tree
    out = tmp_path / "r.json"
    r = _run(tk, env, "--json", str(out), "--keep", str(tmp_path / "keep"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: csrc/ built by nvcc 12.4.131" in r.stdout
    result = json.loads(out.read_text())
    assert result["cudart_version"] == 12040 and result["nvcc"] == "12.4.131"
    assert result["kernels"] == [dict(kernel="_Z6kernelv", registers=64, stack=48,
                                      spill_stores=8, spill_loads=12)]
    assert (tmp_path / "keep" / "libmok_cuda.so").exists()
    assert (tmp_path / "keep" / "libcudart.so.12").exists()


def test_a_failed_build_fails(tree):
    tk, _, env = tree
    r = _run(tk, env, FAKE_BUILD_RC="2", FAKE_BUILD_MSG="kernel.cu(3): error: identifier undefined")
    assert r.returncode == 1, r.stdout
    assert "does not build with CUDA 12's nvcc" in r.stdout and "identifier undefined" in r.stdout


def test_a_missing_cubin_fails(tree):
    tk, _, env = tree
    r = _run(tk, env, FAKE_CUBINS=" ".join(_sources()[1:]))
    assert r.returncode == 1, r.stdout
    assert f"no cubin {_sources()[0]}.sm_90a " in r.stdout


def test_a_library_missing_a_c_abi_function_fails(tree):
    tk, stub, env = tree
    stub.write_text(_stub_c(skip={"mok_combine"}))
    r = _run(tk, env)
    assert r.returncode == 1, r.stdout
    assert "does not load" in r.stdout and "mok_combine" in r.stdout


def test_a_compiler_that_is_not_cuda_12s_or_refuses_the_host_compiler_cannot_check(tree):
    tk, _, env = tree
    r = _run(tk, env, FAKE_RELEASE="13.0")
    assert r.returncode == 2 and "not a CUDA 12 nvcc" in r.stdout
    r = _run(tk, env, FAKE_BUILD_RC="1", FAKE_BUILD_MSG=(
        "crt/host_config.h:143:2: error: #error -- unsupported GNU version! gcc versions later "
        "than 13 are not supported!"))
    assert r.returncode == 2 and "host compiler is newer" in r.stdout


FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stand-in interpreter for --pytest: the preflight (-c) and pytest (-m pytest) exit as the test
# says; pytest also fails unless the CUDA 12 build is what MOK_CUDA_LIB names, beside its cudart.
case "$1" in
    -c) exit "${FAKE_PRE_RC:-0}" ;;
    -m) case "$MOK_CUDA_LIB:$LD_LIBRARY_PATH" in
            */build-nvcc-12.4.131/libmok_cuda.so:*/tk/lib*) ;;
            *) echo "1 failed: MOK_CUDA_LIB=$MOK_CUDA_LIB LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; exit 1 ;;
        esac
        [ "${FAKE_PYTEST_RC:-0}" = 0 ] || echo "FAILED tests/test_errors.py::test_x - boom"
        echo "${FAKE_SUMMARY:-157 passed, 3 skipped in 1.00s}"; exit "${FAKE_PYTEST_RC:-0}" ;;
esac
exit 3
"""


@pytest.fixture
def fake_python(tmp_path):
    path = tmp_path / "python"
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return str(path)


def test_the_library_tests_pass_with_the_cuda_12_build_loaded(tree, fake_python):
    tk, _, env = tree
    r = _run(tk, env, "--pytest", fake_python)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "its CPU tests with it: 157 passed, 3 skipped" in r.stdout


def test_failing_library_tests_fail(tree, fake_python):
    tk, _, env = tree
    r = _run(tk, env, "--pytest", fake_python, FAKE_PYTEST_RC="1", FAKE_SUMMARY="1 failed, 156 passed")
    assert r.returncode == 1, r.stdout
    assert "CPU tests fail with the CUDA 12 build: 1 failed, 156 passed" in r.stdout
    assert "FAILED tests/test_errors.py::test_x" in r.stdout


def test_library_tests_that_would_only_skip_fail(tree, fake_python):
    # the package cannot load the build (the tests would skip themselves and pass): a failure
    tk, _, env = tree
    r = _run(tk, env, "--pytest", fake_python, FAKE_PRE_RC="1")
    assert r.returncode == 1, r.stdout
    assert "the package does not load" in r.stdout

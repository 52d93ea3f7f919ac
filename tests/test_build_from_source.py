"""setup.py's CUDA build from a source tree and from an sdist (CPU; a stand-in nvcc).

setup.py builds ``megatron_mok/_lib/libmok_cuda.so`` into its own tree, so every build here runs
in a scratch copy, with a stand-in nvcc under ``CUDA_HOME`` that records its arguments and
writes an empty library. Checked: ``MOK_CUDA_ARCH`` lists reach nvcc as one ``-gencode`` each,
a bad entry is refused before nvcc runs, and an sdist carries every source the build compiles
(MANIFEST.in), so that a wheel built from it (``python -m build``, ``pip wheel <sdist>``)
compiles the same files as a checkout does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_NVCC = r"""#!/usr/bin/env bash
case " $* " in *" --version "*) echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0 ;; esac
echo "$*" > "$FAKE_NVCC_ARGS"
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
: > "$out"
"""
# What the copy leaves out: not part of a build, or large.
_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", ".whl", ".cuda12", ".carry", "_lib", "__pycache__", "*.egg-info", ".mutants*",
    ".megatron_releases", "build", "dist", "benchmarks", "docs", "examples", "scripts", ".pytest_cache")


@pytest.fixture
def scratch(tmp_path):
    """(a copy of the tree, the build's environment, the file the stand-in nvcc writes its
    arguments to)."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    dst = tmp_path / "tree"
    shutil.copytree(REPO, dst, ignore=_NOT_COPIED)
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text(FAKE_NVCC)
    (cuda / "bin" / "nvcc").chmod(0o755)
    env = dict(os.environ, CUDA_HOME=str(cuda), MOK_SKIP_HOST_OPS_BUILD="1",
               FAKE_NVCC_ARGS=str(tmp_path / "nvcc_args"))
    env.pop("MOK_CUDA_ARCH", None)
    env.pop("MOK_SKIP_CUDA_BUILD", None)
    return dst, env, tmp_path / "nvcc_args"


def _setup(tree, env, *args, **more):
    return subprocess.run([sys.executable, "setup.py", "-q", *args], cwd=tree, env=dict(env, **more),
                          capture_output=True, text=True, timeout=300)


def _compiled(args_file):
    """The .cu files of the stand-in nvcc's command line, relative to csrc/."""
    return sorted(a for a in args_file.read_text().split() if a.endswith(".cu"))


def _sources(tree):
    return sorted(os.path.relpath(os.path.join(d, f), os.path.join(tree, "csrc"))
                  for sub in ("api", "layout", "kernels")
                  for d, _, files in os.walk(os.path.join(tree, "csrc", sub)) for f in files
                  if f.endswith(".cu"))


def test_setup_builds_every_architecture_of_the_list(scratch):
    dst, env, args = scratch
    r = _setup(dst, env, "build_py", "-d", str(dst / "out"), MOK_CUDA_ARCH="90a,100a")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.findall(r"-gencode=\S+", args.read_text()) == [
        "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_100a,code=sm_100a"]
    assert (dst / "megatron_mok" / "_lib" / "libmok_cuda.so").exists()


def test_setup_refuses_a_bad_architecture_before_compiling(scratch):
    dst, env, args = scratch
    r = _setup(dst, env, "build_py", "-d", str(dst / "out"), MOK_CUDA_ARCH="sm_90a")
    assert r.returncode != 0
    assert "MOK_CUDA_ARCH: 'sm_90a' is not an architecture" in r.stderr
    assert not args.exists()


def test_a_build_from_the_sdist_compiles_what_a_checkout_compiles(scratch, tmp_path):
    dst, env, args = scratch
    (dst / "megatron_mok" / "_lib").mkdir()
    (dst / "megatron_mok" / "_lib" / "libmok_cuda.so").write_bytes(b"a build of this tree")
    r = _setup(dst, env, "sdist", "-d", str(tmp_path / "dist"), MOK_SKIP_CUDA_BUILD="1")
    assert r.returncode == 0, r.stdout + r.stderr
    [sdist] = list((tmp_path / "dist").glob("megatron_mok-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        tar.extractall(tmp_path / "unpacked")
    # every file of csrc/ and patches/ (sources, headers, the Makefile, the host ops, patches)
    wanted = {os.path.relpath(os.path.join(d, f), dst) for top in ("csrc", "patches")
              for d, _, files in os.walk(dst / top) for f in files}
    assert wanted and not wanted - names, sorted(wanted - names)
    assert not [n for n in names if "_lib/" in n], "a library built in the tree went into the sdist"
    # and a build from it compiles the checkout's sources
    [unpacked] = list((tmp_path / "unpacked").iterdir())
    r = _setup(unpacked, env, "build_py", "-d", str(unpacked / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _compiled(args) == _sources(dst) and len(_sources(dst)) >= 7
    assert (unpacked / "megatron_mok" / "_lib" / "libmok_cuda.so").exists()


def test_the_wheel_is_tagged_for_this_interpreter_and_platform(scratch, tmp_path):
    # it carries libmok_cuda.so and host ops built for one CPython: a py3-none-any tag would let
    # pip's wheel cache hand it to any Python on any machine
    dst, env, _ = scratch
    r = _setup(dst, env, "bdist_wheel", "-d", str(tmp_path / "wheels"))
    if "invalid command 'bdist_wheel'" in r.stderr:
        pytest.skip("this setuptools has no bdist_wheel (and the wheel package is absent)")
    assert r.returncode == 0, r.stdout + r.stderr
    [wheel] = list((tmp_path / "wheels").glob("*.whl"))
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheel.name.endswith(f"-{py}-{py}-{platform}.whl"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        assert "megatron_mok/_lib/libmok_cuda.so" in z.namelist()

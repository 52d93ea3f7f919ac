"""scripts/cuda12_headers_check.sh decides right (CPU; no network, no real compiler).

The script itself runs in CI (``.ci/run``) with the real nvcc and PyPI's CUDA 12 header wheels.
Here a stand-in nvcc and a prepared header tree (so nothing is downloaded) check its own logic:
which release it checks by default (setup.py's ``MIN_NVCC``), that a failed compile is a failure
(exit 1), that a header read from nvcc's own folder instead of the CUDA 12 tree is a failure
too (the mix would otherwise hide a CUDA 13-only header), and that a machine which cannot run
the check says so (exit 2) instead of passing.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "cuda12_headers_check.sh")

FAKE_NVCC = r"""#!/usr/bin/env bash
# Stand-in nvcc: --dryrun names its include folder; the probe (-c) and the library build
# (everything else) exit as the test says, the build first writing a line of -H output.
case " $* " in
    *" --dryrun "*) echo "#\$ INCLUDES=\"-I$FAKE_NVCC_INCLUDE\"  " >&2; exit 0 ;;
    *" --version "*) echo "Cuda compilation tools, release 13.0, V13.0.48"; exit 0 ;;
    *" -c "*) exit "${FAKE_PROBE_RC:-0}" ;;
esac
if [ -n "${FAKE_H_LINE:-}" ]; then
    for _ in $(seq "${FAKE_H_REPEAT:-1}"); do echo "$FAKE_H_LINE"; done >&2
fi
exit "${FAKE_BUILD_RC:-0}"
"""


def _min_nvcc() -> str:
    text = open(os.path.join(REPO, "setup.py")).read()
    major, minor = re.search(r"MIN_NVCC = \((\d+), (\d+)\)", text).groups()
    return f"{major}.{minor}"


@pytest.fixture
def fake(tmp_path):
    """A stand-in nvcc on PATH, its include folder (with crt/), and a cache whose header trees
    are marked complete, so the script downloads nothing."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    nvcc = bindir / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    include = tmp_path / "nvcc_include"
    (include / "crt").mkdir(parents=True)
    (include / "fatbinary_section.h").write_text("")
    cache = tmp_path / "cache"
    for minor in range(3, 10):
        tree = cache / f"include-12.{minor}"
        tree.mkdir(parents=True)
        (tree / ".complete").write_text("")
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", PYTHON=sys.executable,
               MOK_CUDA12_CACHE=str(cache), FAKE_NVCC_INCLUDE=str(include))
    return env, include


def _run(env, *args, **more):
    return subprocess.run(["bash", SCRIPT, *args], env=dict(env, **more), capture_output=True,
                          text=True, timeout=120)


def test_default_release_is_setup_pys_min_nvcc_and_a_clean_build_passes(fake):
    env, _ = fake
    r = _run(env)
    assert r.returncode == 0, r.stderr
    assert f"OK: csrc/ compiles against CUDA {_min_nvcc()}'s runtime and CCCL headers" in r.stdout


def test_a_failed_compile_fails(fake):
    env, _ = fake
    r = _run(env, "12.8", FAKE_BUILD_RC="1")
    assert r.returncode == 1
    assert "FAILED: csrc/ does not compile against CUDA 12.8's headers" in r.stderr


def test_a_header_read_from_nvccs_own_folder_fails(fake):
    env, include = fake
    r = _run(env, "12.3", FAKE_H_LINE=f".. {include}/cuda/std/newer_header.h")
    assert r.returncode == 1
    assert "newer_header.h" in r.stderr and "read from nvcc's own folder" in r.stderr
    # as many such lines as a real build lists (more than a pipe holds) still fail it
    many = _run(env, "12.3", FAKE_H_LINE=f".. {include}/cuda/std/newer_header.h", FAKE_H_REPEAT="5000")
    assert many.returncode == 1 and "read from nvcc's own folder" in many.stderr
    # the same -H line for a header of the CUDA 12 tree passes
    tree_line = f".. {env['MOK_CUDA12_CACHE']}/include-12.3/cuda/std/header.h"
    assert _run(env, "12.3", FAKE_H_LINE=tree_line).returncode == 0


def test_a_tree_the_compiler_does_not_read_cannot_check(fake):
    env, _ = fake
    r = _run(env, "12.3", FAKE_PROBE_RC="1")
    assert r.returncode == 2
    assert "is not what nvcc reads" in r.stderr


@pytest.mark.parametrize("version", ["13.0", "12.2", "12", "x"])
def test_releases_the_header_mix_cannot_check_are_refused(fake, version):
    env, _ = fake
    r = _run(env, version)
    assert r.returncode == 2
    assert "must be a CUDA 12 release from 12.3 to 12.9" in r.stderr


def test_no_nvcc_cannot_check(fake, tmp_path):
    env, _ = fake
    # PATH without the stand-in and without any nvcc: only the folders of bash and the basics
    bare = ":".join(p for p in ("/usr/bin", "/bin") if os.path.isdir(p))
    if any(os.path.exists(os.path.join(p, "nvcc")) for p in bare.split(":")):
        pytest.skip("nvcc lies in /usr/bin or /bin on this machine")
    r = _run(env, "12.3", PATH=bare)
    assert r.returncode == 2
    assert "no nvcc on PATH" in r.stderr

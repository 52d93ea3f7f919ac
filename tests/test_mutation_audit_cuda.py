"""CPU checks of scripts/mutation_audit_cuda.py: its mutant list still applies to csrc/ (so it
cannot rot silently when a kernel changes), and it reads pytest's verdicts right. The mutants
themselves run on a GPU (the script's ``run``)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("mutation_audit_cuda", ROOT / "scripts" / "mutation_audit_cuda.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_every_mutant_applies_once_to_csrc_and_changes_it():
    tool = _tool()
    assert tool.check(tool.MUTANTS) == []
    assert len(tool.MUTANTS) >= 12


def test_every_mutant_names_test_files_that_exist():
    tool = _tool()
    for m in tool.MUTANTS:
        files = [t for t in m.tests if t.startswith("tests/")]
        assert files, m.name
        for f in files:
            assert (ROOT / f).is_file(), (m.name, f)


def test_a_snippet_that_is_gone_or_repeated_is_reported():
    tool = _tool()
    gone = tool.Mutant("gone", "layout/dispatch_fill.cu", (("no such code anywhere", "x"),), ("tests/x.py",), "t")
    repeated = tool.Mutant("rep", "layout/dispatch_fill.cu", (("__syncthreads();", "x"),), ("tests/x.py",), "t")
    problems = tool.check([gone, repeated])
    assert any("gone" in p and "0 times" in p for p in problems)
    assert any("rep" in p and "times" in p for p in problems)
    with pytest.raises(ValueError):
        tool._apply("a a", tool.Mutant("m", "f", (("a", "b"),), ("tests/x.py",), "t"))


def test_pytest_summary_counts():
    tool = _tool()
    out = "....\n=========== 2 failed, 104 passed, 3 skipped, 550 deselected in 33.14s ===========\n"
    assert tool._counts(out) == {"failed": 2, "passed": 104, "skipped": 3, "deselected": 550}
    assert tool._counts("....\n108 passed, 562 deselected in 30.76s\n") == {"passed": 108, "deselected": 562}
    assert tool._counts("F\n1 failed, 3 passed in 2.0s (0:00:02)\n") == {"failed": 1, "passed": 3}
    assert tool._counts("no summary here") == {}


def test_unknown_mutant_names_are_refused():
    tool = _tool()
    with pytest.raises(SystemExit):
        tool._select("not_a_mutant")
    assert [m.name for m in tool._select("wait_never_times_out")] == ["wait_never_times_out"]


def test_verdicts_of_a_mutant_run():
    tool = _tool()

    def rec(rc=0, timed_out=False, failed=(), **counts):
        return {"rc": rc, "timed_out": timed_out, "failed": list(failed), "counts": counts}

    v = tool.pytest_verdict
    assert v(rec(1, failed=["t.py::a"], failed_=1), 10, 60) == ("killed", "t.py::a")
    # s26-4: the loopback timeout test failed, then the process hung at exit (kernels spinning)
    assert v(rec(None, True, ["t.py::hang"]), 1, 165) == ("killed", "t.py::hang (then hung at exit)")
    assert v(rec(None, True), 1, 165)[0] == "killed"
    assert v(rec(-11), 1, 60) == ("killed", "pytest rc -11 (no test named: a crash?)")
    assert v(rec(0, passed=10), 10, 60) == ("survived", "")
    assert v(rec(0, passed=3, skipped=7), 10, 60)[0] == "invalid"

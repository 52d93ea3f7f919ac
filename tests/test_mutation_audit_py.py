"""The mutation audit's list (scripts/mutation_audit_py.py) has not rotted: every mutant's
original snippet still occurs exactly once in its file, so each mutant still changes the line
it was written for. Cheap invariants only: running the mutants takes ~6 minutes on 2 cores
(``python scripts/mutation_audit_py.py``), not part of the test suite."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import mutation_audit_py as audit  # noqa: E402


def test_every_snippet_occurs_exactly_once_at_head():
    assert audit.snippet_problems() == []


@pytest.mark.parametrize("m", audit.MUTANTS, ids=lambda m: m.name)
def test_mutant_is_well_formed(m):
    with open(os.path.join(audit.ROOT, m.path)) as f:
        text = f.read()
    assert text.count(m.original) == 1, f"{m.name}: snippet not exactly once in {m.path}"
    mutated = text.replace(m.original, m.replacement)
    assert mutated != text
    compile(mutated, m.path, "exec")            # a mutant is a semantic change, not a syntax error
    assert m.tests and all(os.path.isfile(os.path.join(audit.ROOT, t.split("::")[0])) for t in m.tests)
    assert not m.equivalent or m.reason.strip(), f"{m.name}: equivalent needs a reason"


def test_the_checks_see_rot():
    bad = [audit.Mutant("gone", audit.REF, "this text is not in the file", "x", (audit.CONTRACT,)),
           audit.Mutant("twice", audit.REF, "torch", "np", (audit.CONTRACT,)),
           audit.Mutant("noop", audit.LP, "if small > 0", "if small > 0", (audit.LPT,)),
           audit.Mutant("why", audit.LP, "if small > 0", "if small >= 0", (audit.LPT,), True, ""),
           audit.Mutant("target", audit.LP, "if small > 0", "if small >= 0", ("tests/nope.py",))]
    problems = "\n".join(audit.snippet_problems(mutants=bad))
    for needle in ("gone: the original snippet occurs 0 times",
                   "twice: the original snippet occurs", "noop: the replacement is the original",
                   "why: equivalent without a reason", "target: test target tests/nope.py"):
        assert needle in problems, problems


def test_first_failure_is_parsed():
    out = "....F\n=== short test summary info ===\nFAILED tests/test_x.py::test_y[1-2] - AssertionError: no\n"
    assert audit._first_failure(out) == "tests/test_x.py::test_y[1-2]"

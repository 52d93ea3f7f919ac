"""The first 2-GPU calls' scripts ask only for what exists (CPU; no GPU, nothing runs).

scripts/device_runs/x2_suite.sh and x2_tests.sh were written for a 2-GPU machine that has not
been lent since they were written (scripts/device_runs/README.md). A flag renamed in a benchmark
since then, or a pytest selection that no longer matches a test, would cost a whole device call
on that machine. Here every ``python3 SCRIPT ARGS`` command of x2_suite.sh (all of its A/B
variants) goes through its script's own argument parser (and the script's own checks after it,
where the script has a ``parse_args(argv)`` function), and every pytest selection of the two
scripts must select tests.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, "scripts", "device_runs")


def _joined_lines(path: str):
    """The script's lines with backslash continuations joined."""
    return open(path).read().replace("\\\n", " ").splitlines()


def _substitute(text: str, subs: dict, where: str) -> str:
    """``text`` with the shell variables ``subs`` names replaced (longest first, so a short name
    never cuts into a longer one); any variable left is this test's gap, not the script's."""
    for k in sorted(subs, key=len, reverse=True):
        text = text.replace(k, subs[k])
    assert "$" not in text, f"{where}: a variable this test does not know: {text}"
    return text


def _suite_commands():
    """``(name, argv)`` of every ``step NAME LIMIT python3 ...`` of x2_suite.sh (argv: the
    script or ``-m module``, then its arguments), its shell variables replaced by values they
    take there."""
    subs = {
        "$R": "/tmp/r", "$C": "0123abc", "$i": "1", "${v}": "0", "$v": "0", "${mode}": "dropless",
        "$disp": "alltoall,flex,mok",
    }
    out = []
    for line in _joined_lines(os.path.join(RUNS, "x2_suite.sh")):
        m = re.search(r"\bstep (\S+) \d+ python3 (.*)$", line)
        if not m:
            continue
        name, cmd = m.groups()
        variants = [cmd]
        if '${extra[@]+"${extra[@]}"}' in cmd:      # AB=6: with and without drop-and-pad
            variants = [cmd.replace('${extra[@]+"${extra[@]}"}', x) for x in ("", "--drop-and-pad 1.0")]
        for cmd in variants:
            argv = shlex.split(_substitute(cmd, subs, f"x2_suite.sh step {name}"))
            for j, a in enumerate(argv):             # "...; fi", "...; done": the command ends
                if a.endswith(";"):
                    argv = argv[:j] + [a[:-1]]
                    break
            if argv[:2] == ["-m", "torch.distributed.run"]:
                assert argv[2:4] == ["--nproc-per-node", "2"], argv
                argv = argv[4:]
            out.append((name, argv))
    return out


SUITE_COMMANDS = _suite_commands()

# Parses each command in one process: a script with a ``parse_args(argv)`` function is imported
# and that function called (its checks after argparse run too); any other script or module runs
# as __main__ with argparse's parse_args made to stop right after parsing.
_DRIVER = textwrap.dedent("""
    import argparse, contextlib, io, json, os, runpy, sys
    class Parsed(Exception):
        pass
    orig = argparse.ArgumentParser.parse_args
    def parse_only(self, args=None, namespace=None):
        orig(self, args, namespace)
        raise Parsed()
    results = []
    for name, argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                if argv[0] == "-m":
                    sys.argv = [argv[1]] + argv[2:]
                    argparse.ArgumentParser.parse_args = parse_only
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                else:
                    path = os.path.join(os.getcwd(), argv[0])
                    sys.path.insert(0, os.path.dirname(path))
                    sys.argv = argv
                    mod = runpy.run_path(path, run_name="parse_only_check")
                    if callable(mod.get("parse_args")):
                        argparse.ArgumentParser.parse_args = orig
                        mod["parse_args"](argv[1:])
                        raise Parsed()
                    argparse.ArgumentParser.parse_args = parse_only
                    runpy.run_path(path, run_name="__main__")
            results.append([name, "no argument parser reached"])
        except Parsed:
            results.append([name, "ok"])
        except SystemExit as e:
            results.append([name, f"exit {e.code}: {err.getvalue().strip()[-500:]}"])
        except Exception as e:
            results.append([name, f"{type(e).__name__}: {e}"[:500]])
        finally:
            argparse.ArgumentParser.parse_args = orig
    print("RESULTS " + json.dumps(results))
""")


def _parse_all(commands):
    r = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(commands)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULTS ")]
    assert line, f"the parse driver failed: {r.stderr[-3000:]}"
    return json.loads(line[0][len("RESULTS "):])


def test_the_suite_script_has_commands_for_every_ab_variant():
    names = {name for name, _ in SUITE_COMMANDS}
    # the suite, main job, small batches, and the A/Bs' own python steps (AB=3..9)
    for expected in ("suite", "main_job", "small_batch", "host_ab_launch", "layer_$i", "align",
                     "layer_graphs_$i", "layer_etp_$i", "expert_tp_tests"):
        assert expected in names, (expected, sorted(names))


def test_every_python_command_of_x2_suite_parses():
    commands = [[n, a] for n, a in SUITE_COMMANDS if a[:2] != ["-m", "pytest"]]
    results = _parse_all(commands)
    assert len(results) == len(commands)
    bad = [(n, r) for n, r in results if r != "ok"]
    assert not bad, bad


def _script_args(path, script, subs):
    """The arguments a shell script passes to ``script`` (up to a redirection or the line's
    end), continuations joined and ``subs`` applied."""
    line = [x for x in _joined_lines(path) if re.search(re.escape(script) + r'"? +--', x)][0]
    rest = line.split(script, 1)[1].lstrip('"').split(">")[0]
    return [script] + shlex.split(_substitute(rest, subs, f"{path}: {script}"))


def test_the_other_scripts_python_commands_parse():
    # what the first 2-GPU calls run through bash: the stage A/Bs (x2_suite.sh AB=1, 2) and
    # run_gpu_ab.sh's bench stage
    commands = [
        ["ab_libraries", _script_args(os.path.join(REPO, "scripts", "ab_libraries.sh"),
                                      "scripts/profile_stages.py",
                                      {'"$t"': "128", '"$OUT/$name"': "/tmp/x"})],
        ["run_gpu_ab bench", _script_args(os.path.join(REPO, "examples", "run_gpu_ab.sh"),
                                          "benchmarks/bench_layer.py",
                                          {'"$OUT_DIR/bench"': "/tmp/x"})],
        # the next one-GPU call's eager bench (session 46: the CUDA 12.4 build against nvcc 13's)
        ["s46 bench12", _script_args(os.path.join(REPO, "scripts", "device_runs", "s46_1gpu.sh"),
                                     "benchmarks/bench_dispatch_combine.py",
                                     {"$R/eager_${v}_$i": "/tmp/x", "$C": "abc1234"})],
    ]
    assert [a[1:3] for _, a in commands] == [["--tokens", "128"], ["--out-dir", "/tmp/x"],
                                             ["--nproc", "1"]], commands
    results = _parse_all(commands)
    assert [r for _, r in results] == ["ok", "ok", "ok"], results


def test_a_wrong_flag_fails_the_check():
    # the check itself: a flag the script does not take, and a value its own checks refuse
    results = _parse_all([
        ["typo", ["benchmarks/bench_layer.py", "--dispatchrs", "mok"]],
        ["bad value", ["benchmarks/bench_layer.py", "--dispatchers", "mok:overlapped"]],
        ["module typo", ["-m", "megatron_mok.bench", "--jsn", "x.json"]],
        ["fine", ["-m", "megatron_mok.bench", "--json", "x.json"]],
    ])
    verdicts = dict(results)
    assert verdicts["typo"].startswith("exit 2") and "--dispatchrs" in verdicts["typo"], verdicts
    assert verdicts["bad value"].startswith("exit 2"), verdicts
    assert verdicts["module typo"].startswith("exit 2"), verdicts
    assert verdicts["fine"] == "ok", verdicts


def _collect(args):
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
                       + args, cwd=REPO, capture_output=True, text=True, timeout=600)
    return [x for x in r.stdout.splitlines() if "::" in x]


@pytest.mark.parametrize("select,world", [("not alternative_schedules", 2),
                                          ("alternative_schedules_match_reference", 2),
                                          ("alternative_schedules_wrap_the_ring", 2),
                                          ("not alternative_schedules", 4)])
def test_x2_tests_selections_select_tests(select, world, tmp_path):
    # x2_tests.sh's SELECT values (core, schedules, rings) and its WORLD filter, as it runs them
    text = open(os.path.join(RUNS, "x2_tests.sh")).read()
    assert f'K="{select}"' in text, "x2_tests.sh's selections changed: update this test"
    ids = _world_ids(select, world, tmp_path)
    assert len(ids) >= 10, (select, world, len(ids))


def _world_ids(select: str, world: int, out_dir) -> set:
    """common.sh's ``world_ids SELECT WORLD``, run as the device scripts run it."""
    r = subprocess.run(["bash", "-c", f'OUT="$1"; C=test; . scripts/device_runs/common.sh >/dev/null 2>&1; '
                                      f'world_ids "$2" {world}', "world_ids", str(out_dir), select],
                       cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})
    return {x for x in r.stdout.splitlines() if "::" in x}


def test_x2_suite_expert_tp_selection_selects_the_two_gpu_tests():
    line = [x for x in _joined_lines(os.path.join(RUNS, "x2_suite.sh")) if "expert_tp_tests" in x
            and "pytest" in x][0]
    k = re.search(r'-k "([^"]+)"', line).group(1)
    ids = _collect(["tests/megatron/test_megatron_dispatcher.py", "-k", k])
    assert len(ids) >= 1, k
    assert all("expert_tensor_parallel_gpu" in i for i in ids), ids


def test_step3_selects_the_gpu_tests_of_tests_megatron():
    # step 3 of the first 2-GPU call: PYTEST_ADDOPTS='-m "gpu or multigpu"' over tests/megatron
    ids = _collect(["-m", "gpu or multigpu", "tests/megatron"])
    assert len(ids) >= 25, len(ids)
    assert any("test_example_ep_overlap_gpu" in i for i in ids)


def test_world_ids_leave_no_multigpu_test_out(tmp_path):
    """common.sh's ``world_ids`` (x2_tests.sh's selection) run as the device scripts run it:
    every multi-GPU test of tests/ (not tests/megatron: step 3 of the plan) is selected at some
    world size, and a test without a world-size parameter (a 2-rank test) at world size 2. Until
    session 40 it kept only ids ending in a world size, so the parameterless 2-rank tests (the
    device check, the layout twin) were never selected."""
    every = set(_collect(["-m", "multigpu", "tests", "--ignore=tests/megatron"]))
    assert len(every) > 100
    chosen = {world: _world_ids("", world, tmp_path) for world in (2, 3, 4)}   # the sizes in use
    assert set().union(*chosen.values()) == every, sorted(every - set().union(*chosen.values()))[:5]
    plain = {i for i in every if not i.endswith("]")}
    assert plain and plain <= chosen[2] and not plain & chosen[4]


def _run_parts(out_dir, parts: str, kill_in: str = ""):
    """common.sh's ``run_parts`` as a device script runs it (a ``part`` function writing one log
    per part into ``$R``); part ``kill_in`` kills the whole shell (a device call past its limit).
    Its working folder goes under ``out_dir``'s sibling ``tmp`` (``TMPDIR``), not /tmp."""
    tmp = os.path.join(os.path.dirname(str(out_dir)), "tmp")
    os.makedirs(tmp, exist_ok=True)
    script = ('OUT="$1"; C=test; . scripts/device_runs/common.sh >/dev/null 2>&1; '
              'part() { echo "$1 ran" > "$R/$1.log"; [ "$1" = "$KILL_IN" ] && kill -9 $$; true; }; '
              'run_parts "$2" 0')
    return subprocess.run(["bash", "-c", script, "run_parts", str(out_dir), parts], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": tmp, "KILL_IN": kill_in})


def _archive(out_dir) -> dict:
    import tarfile
    with tarfile.open(os.path.join(out_dir, "r.tgz")) as t:
        return {m.name: t.extractfile(m).read().decode() for m in t.getmembers() if m.isfile()}


def test_run_parts_leaves_one_archive_of_every_part(tmp_path):
    """A device call brings back at most 8 files of $OUT: ``run_parts`` keeps its folder outside
    $OUT and leaves there only ``r.tgz`` with every part's files (s43-3 lost most of its parts)."""
    out = tmp_path / "out"
    out.mkdir()
    r = _run_parts(out, "a b c")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["r.tgz"]
    assert os.listdir(tmp_path / "tmp") == [], "its working folder was left behind"
    files = _archive(out)
    assert {"r/a.log", "r/b.log", "r/c.log", "r/gpu.txt"} <= set(files), files
    assert files["r/b.log"] == "b ran\n"


def test_run_parts_archive_keeps_the_parts_finished_before_a_kill(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = _run_parts(out, "a b c", kill_in="b")
    assert r.returncode != 0
    assert sorted(os.listdir(out)) == ["r.tgz"], os.listdir(out)
    files = _archive(out)
    assert "r/a.log" in files and "r/c.log" not in files, files

"""scripts/repeat_loopback.py (a rare-stall hunter): it repeats a worker, counts slow runs and
failures, varies the seed when asked, and exits 1 on a failure. On CPU loopback ranks."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "scripts", "repeat_loopback.py")

WORKERS = '''
import time

def records(rank, world_size, seed, path):
    with open(path, "a") as f:
        f.write(f"{rank} {world_size} {seed}\\n")
    return rank

def slow_on_rank1(rank, world_size, seconds):
    if rank == 1:
        time.sleep(seconds)
    return rank

def fails_on_even_seeds(rank, world_size, seed):
    if rank == 0 and seed % 2 == 0:
        raise ValueError(f"even seed {seed}")
    return rank
'''


def _run(tmp_path, *args):
    workers = tmp_path / "workers.py"
    workers.write_text(WORKERS)
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, SCRIPT, *[a.replace("W:", f"{workers}:") for a in args],
                        "--device", "cpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    return p, (json.loads(out.read_text()) if out.exists() else None)


def test_fixed_arguments_every_rank_every_run(tmp_path):
    calls = tmp_path / "calls.txt"
    p, summary = _run(tmp_path, "W:records", "--world", "3", "--runs", "4",
                      "--args", json.dumps([7, str(calls)]))
    assert p.returncode == 0, p.stderr[-2000:]
    lines = calls.read_text().split("\n")[:-1]
    assert sorted(lines) == sorted([f"{r} 3 7" for r in range(3)] * 4)
    assert summary["runs"] == 4 and summary["failures"] == [] and len(summary["durations_s"]) == 4


def test_fresh_seeds_replace_the_first_argument(tmp_path):
    calls = tmp_path / "calls.txt"
    p, summary = _run(tmp_path, "W:records", "--world", "2", "--runs", "5", "--fresh-seeds",
                      "--args", json.dumps([7, str(calls)]))
    assert p.returncode == 0, p.stderr[-2000:]
    seeds = [int(line.split()[2]) for line in calls.read_text().split("\n")[:-1]]
    assert len(seeds) == 10 and 7 not in seeds and len(set(seeds)) == 5   # both ranks, same seed


def test_slow_runs_are_reported(tmp_path):
    p, summary = _run(tmp_path, "W:slow_on_rank1", "--runs", "2", "--slow-s", "0.3",
                      "--args", "[0.5]")
    assert p.returncode == 0, p.stderr[-2000:]
    assert [s["run"] for s in summary["slow"]] == [1, 2] and summary["max_s"] >= 0.5
    assert "2 slower than 0.3 s, 0 failed" in p.stdout


def test_failures_are_reported_and_exit_1(tmp_path):
    p, summary = _run(tmp_path, "W:fails_on_even_seeds", "--runs", "6", "--fresh-seeds",
                      "--args", "[1]")
    assert p.returncode == 1, p.stdout[-2000:]
    assert summary["failures"] and all(f["args"][0] % 2 == 0 for f in summary["failures"])
    assert all("even seed" in f["error"] for f in summary["failures"])
    assert f"{len(summary['failures'])} failed" in p.stdout


def test_a_run_past_its_timeout_is_a_failure(tmp_path):
    p, summary = _run(tmp_path, "W:slow_on_rank1", "--runs", "1", "--timeout-s", "0.5",
                      "--args", "[3]")
    assert p.returncode == 1
    assert "did not finish within" in summary["failures"][0]["error"]


def test_bad_worker_names_are_refused(tmp_path):
    p, _ = _run(tmp_path, "W:no_such_function", "--runs", "1")
    assert p.returncode != 0 and "has no function no_such_function" in p.stderr

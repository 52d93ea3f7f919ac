"""Run one loopback worker many times, to catch a rare stall (developer tool, one GPU).

    python scripts/repeat_loopback.py tests/test_cuda_backend.py:_rows_overflow --world 3 \
        --args '[78]' [--fresh-seeds] [--seconds 60] [--runs N] [--slow-s 2] [--timeout-s 150] \
        [--device cuda] [--out FILE.json]

Calls ``loopback.run(fn, world, *args)`` (``fn(rank, world_size, *args)``, a test file's
worker) again and again until ``--seconds`` or ``--runs`` is reached, each run under
``--timeout-s``. ``--fresh-seeds`` replaces the first argument by a new seed per run. Prints
every run slower than ``--slow-s`` and every failure (with loopback's report: which rank's host
stayed where), a progress line every 10 runs, and writes the durations to ``--out``.
Set ``MOK_LOOPBACK_STALL_LOG`` to also get each 5+ s host stall in a file the moment it is
seen. Exit status 1 when a run failed or ran past its timeout.

Why: s43-3 saw ``test_loopback_rows_per_expert_overflow[3]`` (0.03-0.04 s in every other run)
stall for ~90 s until its selection's time limit killed it (benchmarks/NOTES.md, item 77).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time

# Loopback ranks on a GPU need these before CUDA starts (megatron_mok/loopback.py).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(_ROOT, "tests"))
sys.path.insert(1, _ROOT)


def load_worker(spec: str):
    """``path/to/file.py:function`` -> the function (its file imported as a module, with the
    tests folder on the path, as pytest's conftest puts it)."""
    path, sep, name = spec.partition(":")
    if not sep or not name:
        raise SystemExit(f"worker {spec!r}: expected FILE.py:FUNCTION")
    mod_name = os.path.splitext(os.path.basename(path))[0]
    loaded = importlib.util.spec_from_file_location(mod_name, path)
    if loaded is None:
        raise SystemExit(f"worker {spec!r}: cannot import {path}")
    mod = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(mod)
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise SystemExit(f"worker {spec!r}: {path} has no function {name}")
    return fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("worker", help="FILE.py:FUNCTION, called as FUNCTION(rank, world_size, *args)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--args", default="[]", help="JSON list of the worker's extra arguments")
    ap.add_argument("--fresh-seeds", action="store_true", help="a new first argument per run")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--runs", type=int, default=0, help="stop after this many runs (0: --seconds)")
    ap.add_argument("--slow-s", type=float, default=2.0)
    ap.add_argument("--timeout-s", type=float, default=150.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    args = json.loads(a.args)
    if not isinstance(args, list) or (a.fresh_seeds and not args):
        raise SystemExit("--args must be a JSON list (with the seed first for --fresh-seeds)")

    import harness  # noqa: F401  (the tests' environment: no NVLink multicast, before torch)
    from megatron_mok import loopback

    fn = load_worker(a.worker)
    rng = random.Random(1234)
    runs, slow, failures = [], [], []
    end = time.monotonic() + a.seconds
    while (len(runs) < a.runs) if a.runs else (time.monotonic() < end):
        call = [rng.randrange(1 << 30)] + args[1:] if a.fresh_seeds else args
        t0 = time.monotonic()
        try:
            loopback.run(fn, a.world, *call, device=a.device, timeout_s=a.timeout_s)
            error = None
        except loopback.LoopbackError as e:
            error = str(e)
        took = time.monotonic() - t0
        runs.append(took)
        if error is not None:
            failures.append({"run": len(runs), "args": call, "s": took, "error": error[-4000:]})
            print(f"run {len(runs)} args {call}: FAILED after {took:.1f} s\n{error[-4000:]}", flush=True)
        elif took > a.slow_s:
            slow.append({"run": len(runs), "args": call, "s": took})
            print(f"run {len(runs)} args {call}: slow, {took:.2f} s", flush=True)
        if len(runs) % 10 == 0:
            print(f"[{len(runs)} runs] median {statistics.median(runs):.3f} s, max {max(runs):.2f} s, "
                  f"{len(slow)} slow, {len(failures)} failed", flush=True)
    summary = {"worker": a.worker, "world": a.world, "args": args, "fresh_seeds": a.fresh_seeds,
               "runs": len(runs), "median_s": statistics.median(runs) if runs else None,
               "max_s": max(runs) if runs else None, "slow_s": a.slow_s, "slow": slow,
               "failures": failures, "durations_s": [round(t, 4) for t in runs]}
    print(f"repeat_loopback: {a.worker} at W = {a.world}: {len(runs)} runs, "
          f"{len(slow)} slower than {a.slow_s} s, {len(failures)} failed"
          + (f", median {summary['median_s']:.3f} s, max {summary['max_s']:.2f} s" if runs else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

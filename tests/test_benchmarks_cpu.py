"""The benchmark's CPU smoke mode (GitHub issue 5): it must run in CI, quickly, and its
correctness gate must hold -- the Megatron ``alltoall`` baseline against the oracle, MoK
(reference backend) against the oracle, the contract-order combine and the baseline.

Runs ``benchmarks/bench_dispatch_combine.py --cpu`` in a subprocess (it spawns its own two
gloo ranks) and reads the JSON it writes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks", "bench_dispatch_combine.py")
STEM = "bench_dispatch_combine"
SMOKE_TIMEOUT_S = 170   # usually ~15 s; generous for loaded CI machines

ENV_FIELDS = ("date", "commit", "command", "torch_version", "gpu_model", "gpu_count", "world_size")
OPS = ("dispatch", "combine", "dispatch_bwd", "combine_bwd")


@contextlib.contextmanager
def _benchmarks_importable():
    """``benchmarks/`` on ``sys.path`` for an import, removed after by value (the benchmark
    modules put their own entries first, so popping index 0 would remove one of theirs)."""
    path = os.path.join(REPO, "benchmarks")
    sys.path.insert(0, path)
    try:
        yield
    finally:
        sys.path.remove(path)


def _have_mok() -> bool:
    sys.path.insert(0, REPO)
    try:
        return importlib.util.find_spec("megatron_mok") is not None
    finally:
        sys.path.remove(REPO)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_smoke")
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""          # the CPU path, also on a GPU machine
    proc = subprocess.run([sys.executable, BENCH, "--cpu", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"smoke run failed (rc={proc.returncode}):\n{log[-6000:]}"
    path = out / f"{STEM}.json"
    assert path.exists(), f"no JSON written:\n{log[-4000:]}"
    with open(path) as f:
        doc = json.load(f)
    return doc, out, log


def test_smoke_json_fields(smoke):
    doc, out, log = smoke
    assert doc["schema"].startswith("mok-bench-dispatch-combine/")
    assert doc["mode"] == "cpu smoke"
    assert doc["timing_claims"] is False
    assert doc["complete"] is True
    for k in ENV_FIELDS:
        assert k in doc["env"], k
    assert doc["env"]["world_size"] == 2
    assert doc["config"]["iters"] >= 1
    for k in ("peer_bandwidth", "systems", "shapes", "results", "sm_sweep", "checks", "skipped"):
        assert k in doc, k
    assert set(doc["systems"]) == {"mok", "mok_fp8", "alltoall", "deepep", "symm_a2a"}
    # unavailable systems carry a reason
    for name in ("deepep", "symm_a2a"):
        assert doc["systems"][name]["available"] is False and doc["systems"][name]["reason"]
    shape_names = {s["name"] for s in doc["shapes"]}
    assert {"cpu_uniform", "cpu_unrouted", "cpu_skew"} <= shape_names
    for s in doc["shapes"]:
        nb = s["nvlink_bytes"]
        assert nb["dedup"]["total"] <= nb["copies"]["total"]      # dedup never moves more
        assert len(s["rows_per_rank"]) == 2
    assert (out / f"{STEM}.md").exists()
    md = (out / f"{STEM}.md").read_text()
    assert "CPU SMOKE" in md and "| shape | system |" in md
    assert "SUMMARY" in log


def _ok_records(doc, system):
    """``system``'s result records: one per shape, every one ok."""
    recs = [r for r in doc["results"] if r["system"] == system]
    assert len(recs) == len(doc["shapes"])
    for r in recs:
        assert r["status"] == "ok", r.get("error")
    return recs


def test_smoke_alltoall_ran_and_was_checked(smoke):
    doc, _, _ = smoke
    for r in _ok_records(doc, "alltoall"):
        for op in OPS:
            assert op in r["ops"] and r["ops"][op]["median_us"] > 0, (r["shape"], op)
    names = {c["check"] for c in doc["checks"] if c["system"] == "alltoall"}
    assert "dispatch tokens == oracle rows (bitwise)" in names
    assert "combine ~= float64 oracle" in names
    assert "combine bwd == oracle rows of grad_y (bitwise)" in names


@pytest.mark.skipif(not _have_mok(), reason="megatron_mok package not present")
def test_smoke_mok_fp8_ran_and_was_checked(smoke):
    doc, _, _ = smoke
    for r in _ok_records(doc, "mok_fp8"):
        assert r["ops"]["dispatch"]["median_us"] > 0 and r["ops"]["dispatch_cached"]["median_us"] > 0
        assert "unavailable" in r["ops"]["combine"]          # combine stays bf16: the mok row
        assert "packed FP8 rows" in r["bytes_kind"]
        # The backward carries the prob gradients only, beside the full-combine way (NOTES #56).
        assert r["ops"]["dispatch_bwd"]["median_us"] > 0 and r["dispatch_bwd_full_combine_us"] > 0
        assert r["dispatch_bwd_prob_grads_us"] > 0
    for s in doc["shapes"]:       # FP8 rows: fewer bytes than bf16 ones (16-byte padding aside)
        fp8_row, bf16_row = s["nvlink_bytes_fp8"]["row_bytes"], s["nvlink_bytes"]["row_bytes"]
        assert fp8_row <= bf16_row and (s["hidden"] < 64 or fp8_row < bf16_row), s["name"]
    checks = [c for c in doc["checks"] if c["system"] == "mok_fp8"]
    names = {c["check"] for c in checks}
    for expected in ("fp8 rows == quantized oracle rows (bytes)", "dispatch probs == oracle (bitwise)",
                     "cached fp8 dispatch == fp8 dispatch (bytes)",
                     "dequantized rows ~= bf16 rows (E4M3 tolerance)",
                     "dispatch bwd grad_topk_weights == oracle (bitwise)"):
        assert expected in names, expected
    assert all(c["passed"] for c in checks)


@pytest.mark.skipif(not _have_mok(), reason="megatron_mok package not present")
def test_smoke_mok_ran_and_was_checked(smoke):
    doc, _, _ = smoke
    assert doc["systems"]["mok"]["available"], doc["systems"]["mok"]
    for r in _ok_records(doc, "mok"):
        assert r["backend"] == "reference"
    names = {c["check"] for c in doc["checks"] if c["system"] == "mok"}
    for expected in ("dispatch tokens == oracle rows (bitwise)",
                     "dispatch tokens == alltoall rows (bitwise)",
                     "combine == contract-order oracle (bitwise)",
                     "combine ~= alltoall combine (bf16 tol)",
                     "dispatch bwd grad_x == contract-order oracle (bitwise)",
                     "combine bwd == oracle rows of grad_y (bitwise)"):
        assert expected in names, expected


def test_smoke_all_checks_passed(smoke):
    doc, _, log = smoke
    failed = [c for c in doc["checks"] if not c["passed"]]
    assert not failed, f"failed checks: {failed}\n{log[-3000:]}"
    assert doc["checks_passed"] is True
    assert not doc["checks_failed"]
    assert len(doc["checks"]) >= 20
    assert not [r for r in doc["results"] if r["status"] != "ok"]


def test_plot_results_renders_markdown(smoke, tmp_path):
    """plot_results turns the JSON into the table (PNG only where matplotlib exists)."""
    doc, out, _ = smoke
    with _benchmarks_importable():
        import plot_results
    paths = plot_results.render(doc, str(tmp_path), "again")
    md = open(paths["markdown"]).read()
    assert "| shape | system |" in md
    text = plot_results.summary_text(doc)
    assert "SUMMARY" in text and "alltoall" in text


def test_symm_a2a_phase_skips_shapes_torch_cannot_run(monkeypatch, tmp_path):
    """torch's all_to_all_vdev_2d takes at most 16 experts per rank: shapes with more are
    skipped with that reason and no NVSHMEM child process is started for them (one such
    child hung past its cap on a GPU machine, run s4-4)."""
    with _benchmarks_importable():
        import bench_dispatch_combine as bdc

    def no_child(*a, **k):
        raise AssertionError("a symm_a2a child process was started for shapes it cannot run")

    monkeypatch.setattr(bdc.subprocess, "Popen", no_child)
    bench = bdc.Bench.__new__(bdc.Bench)
    bench.args = type("Args", (), {"shape_names": ["dsv3", "t128", "skew"]})()
    bench.world = 2
    bench.systems = {"symm_a2a": {"requested": True, "available": True}}
    bench.skipped = []
    bench.log = lambda *a, **k: None
    bench.run_symm_phase(str(tmp_path))
    assert bench.systems["symm_a2a"]["available"] is False
    assert "16" in bench.systems["symm_a2a"]["reason"]
    assert sorted(s["what"] for s in bench.skipped) == ["dsv3/symm_a2a", "skew/symm_a2a", "t128/symm_a2a"]
    assert all("128 experts per rank" in s["reason"] for s in bench.skipped)


def test_small_batch_report_keeps_host_return_times(tmp_path, capsys):
    """bench_small_batch.py (GPU-only to run) writes, per case, the slowest rank's host-inclusive
    and until-return times; its report prints both tables. Checked on made-up per-rank figures."""
    import argparse
    import time

    with _benchmarks_importable():
        import bench_small_batch as sb

    ops = ["eager_dispatch", "static_dispatch", "graph_dispatch", "eager_combine", "static_combine",
           "graph_combine"]
    host = ["eager_dispatch", "static_dispatch", "eager_combine", "static_combine"]
    per_rank = [{**{f"{k}_us": 10.0 + r for k in ops}, **{f"{k}_return_us": 4.0 + 2 * r for k in host},
                 "rows": 5} for r in range(2)]
    case = sb._case(2, 128, per_rank, time.time(), "fp8")
    assert case["slowest_rank"]["static_dispatch_return_us"] == 6.0
    assert case["slowest_rank"]["graph_dispatch_us"] == 11.0
    sb._write(argparse.Namespace(out=str(tmp_path)), {"note": "test"}, [case])
    doc = json.load(open(tmp_path / "small_batch.json"))
    assert doc["cases"][0]["slowest_rank"]["eager_combine_return_us"] == 6.0
    out = capsys.readouterr().out
    assert "Until the call returned" in out and "| 2 | 128 | fp8 | 6.0 | 6.0 | 6.0 | 6.0 |" in out
    assert "| 2 | 128 | fp8 | 11.0 | 11.0 | 11.0 | 11.0 | 11.0 | 11.0 |" in out


def test_runs_without_timing_claims_say_so_in_every_rendering(smoke, tmp_path):
    """The CPU smoke and the shared-GPU dry run (``--shared-gpu``: ranks time-slicing one GPU)
    carry ``timing_claims`` false, and the table, the summary and the plot's title say what
    the run was; a timed GPU run's do not."""
    doc, _, _ = smoke
    with _benchmarks_importable():
        import plot_results
    shared = dict(doc, mode="gpu shared (dry run)", timing_claims=False)
    timed = dict(doc, mode="gpu", timing_claims=True)
    assert plot_results.no_claims_label(doc) == "CPU SMOKE"
    assert plot_results.no_claims_label(shared) == "SHARED-GPU DRY RUN"
    assert plot_results.no_claims_label(timed) == ""
    assert plot_results.no_claims_label(dict(doc, mode="gpu", timing_claims=False)) == "NO TIMING CLAIMS"
    md = plot_results.markdown(shared).splitlines()[0]
    assert md == "# Dispatch / combine benchmark — SHARED-GPU DRY RUN (no timing claims)"
    assert plot_results.markdown(timed).splitlines()[0] == "# Dispatch / combine benchmark"
    assert "SHARED-GPU DRY RUN: correctness only" in plot_results.summary_text(shared)
    assert "correctness only" not in plot_results.summary_text(timed)


def test_shared_gpu_option_maps_ranks_onto_the_gpus_there_are(monkeypatch):
    """``--shared-gpu`` puts rank r on ``cuda:(r % GPUs)``; without it rank r is ``cuda:r``."""
    with _benchmarks_importable():
        import bench_dispatch_combine as bdc
    monkeypatch.setattr(bdc.torch.cuda, "device_count", lambda: 1)
    assert [bdc.C.gpu_of(r, True) for r in range(3)] == [0, 0, 0]
    assert [bdc.C.gpu_of(r, False) for r in range(3)] == [0, 1, 2]
    monkeypatch.setattr(bdc.torch.cuda, "device_count", lambda: 2)
    assert [bdc.C.gpu_of(r, True) for r in range(4)] == [0, 1, 0, 1]
    assert bdc.parse_args(["--shared-gpu"]).shared_gpu is True
    assert bdc.parse_args([]).shared_gpu is False


def _run_suite_in_process(tmp_path, monkeypatch, corrupt):
    """The suite's worker in this process (world size 1, gloo, CPU shapes, mok and alltoall)
    with ``corrupt(mok module)`` applied first; returns its JSON."""
    with _benchmarks_importable():
        import bench_dispatch_combine as bdc
    import megatron_mok
    import torch.distributed as dist
    corrupt(monkeypatch, megatron_mok)
    s = __import__("socket").socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    args = bdc.parse_args(["--cpu", "--systems", "mok,alltoall", "--out", str(tmp_path), "--sm-sweep", ""])
    threads = bdc.torch.get_num_threads()   # the worker sets 1 (ranks sharing a CPU)
    try:
        bdc.worker(0, 1, 0, args, cpu=True)
    finally:
        bdc.torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(tmp_path / f"{STEM}.json") as f:
        return json.load(f)


def _failed(doc, system):
    return {c["check"] for c in doc["checks"] if c["system"] == system and not c["passed"]}


@pytest.mark.skipif(not _have_mok(), reason="megatron_mok package not present")
def test_suite_gate_passes_an_honest_mok(tmp_path, monkeypatch):
    """The control for the two tests below: the same in-process run, nothing corrupted."""
    doc = _run_suite_in_process(tmp_path, monkeypatch, lambda mp, mok: None)
    assert doc["checks_passed"] is True and len(doc["checks"]) >= 10
    assert any(s["what"].endswith("mok cuda == reference check") for s in doc["skipped"])


@pytest.mark.skipif(not _have_mok(), reason="megatron_mok package not present")
def test_suite_gate_fails_a_dispatch_that_flips_one_bit(tmp_path, monkeypatch):
    """Can the suite's correctness gate fail? A mok dispatch whose first received row has its
    lowest bit flipped (forward only) must fail the bitwise row checks, and the JSON must say
    the run did not pass."""
    def corrupt(mp, mok):
        real = mok.Buffer.dispatch

        def dispatch(self, x, *a, **k):
            res = real(self, x, *a, **k)
            if res.tokens.shape[0] and not res.tokens.requires_grad:
                res.tokens.view(torch.int16)[0, 0] ^= 1
            return res
        mp.setattr(mok.Buffer, "dispatch", dispatch)

    import torch
    doc = _run_suite_in_process(tmp_path, monkeypatch, corrupt)
    failed = _failed(doc, "mok")
    assert "dispatch tokens == oracle rows (bitwise)" in failed
    assert "dispatch tokens == alltoall rows (bitwise)" in failed
    assert doc["checks_passed"] is False and doc["checks_failed"]
    assert not _failed(doc, "alltoall")


@pytest.mark.skipif(not _have_mok(), reason="megatron_mok package not present")
def test_suite_gate_fails_a_combine_off_by_one_ulp(tmp_path, monkeypatch):
    """A mok combine one bf16 ulp off in one element: the bitwise contract check fails even
    though the tolerance check against alltoall still passes (that is why both exist)."""
    def corrupt(mp, mok):
        real = mok.Buffer.combine

        def combine(self, expert_out, handle):
            y = real(self, expert_out, handle)
            if y.numel() and not y.requires_grad:
                y.view(torch.int16).view(-1)[0] += 1
            return y
        mp.setattr(mok.Buffer, "combine", combine)

    import torch
    doc = _run_suite_in_process(tmp_path, monkeypatch, corrupt)
    failed = _failed(doc, "mok")
    assert "combine == contract-order oracle (bitwise)" in failed
    assert "combine ~= alltoall combine (bf16 tol)" not in failed
    assert doc["checks_passed"] is False


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn"])
def test_bitwise_equal_compares_bits_not_values(dtype):
    """The suite's bitwise checks: -0.0 is not +0.0, a NaN equals itself, one flipped bit or
    another dtype or shape is a difference; every float width (FP8 rows among them)."""
    import torch
    with _benchmarks_importable():
        import common as C
    dt = getattr(torch, dtype)
    a = torch.tensor([1.0, 0.0, 2.0, 0.5]).to(dt)
    assert C.bitwise_equal(a, a.clone())
    assert not C.bitwise_equal(a, torch.tensor([1.0, -0.0, 2.0, 0.5]).to(dt))
    flipped = a.clone()
    it = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    flipped.view(it)[2] ^= 1
    assert not C.bitwise_equal(a, flipped)
    if dtype != "float8_e4m3fn":        # (E4M3 has a NaN, but no arithmetic on CPU to make one)
        nan = torch.tensor([float("nan"), 1.0]).to(dt)
        assert C.bitwise_equal(nan, nan.clone())
    assert not C.bitwise_equal(a, a.reshape(2, 2))
    assert not C.bitwise_equal(a, a.to(torch.float32 if dtype != "float32" else torch.float64))
    assert C.bitwise_equal(a[:0], a[:0].clone())


def test_shared_gpu_mode_is_refused_where_every_rank_has_a_gpu():
    """``--shared-gpu`` labels its run as ranks time-slicing shared GPUs; with a GPU per rank
    that would be false, so it is refused (and without a GPU it cannot run)."""
    with _benchmarks_importable():
        import bench_dispatch_combine as bdc
    assert bdc.C.shared_gpu_problem(2, 1) is None
    assert bdc.C.shared_gpu_problem(4, 2) is None
    assert "each rank its own" in bdc.C.shared_gpu_problem(2, 2)
    assert "each rank its own" in bdc.C.shared_gpu_problem(2, 8)
    assert "needs a CUDA GPU" in bdc.C.shared_gpu_problem(2, 0)

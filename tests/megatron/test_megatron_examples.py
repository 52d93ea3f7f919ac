"""The example training script and the layer benchmark, at toy sizes on CPU (gloo).

The GPU versions (60 steps, bf16, 2 GPUs) are ``examples/run_gpu_ab.sh``."""

from __future__ import annotations

import json
import math

import pytest

from harness import run_distributed

import mok_megatron_workers as W

pytestmark = pytest.mark.megatron


def test_example_trains_same_losses_with_alltoall_and_mok(tmp_path):
    runs = {}
    for d in ("alltoall", "mok"):
        out = tmp_path / f"{d}.json"
        losses = run_distributed(W.example_train, 2, d, str(out))
        assert losses[0] == losses[1]                    # every rank reports the global mean
        summary = json.loads(out.read_text())
        assert summary["dispatcher"] == d and summary["world_size"] == 2
        assert summary["losses"] == losses[0] and len(losses[0]) == 5
        assert summary["tokens_per_s_per_gpu"] > 0 and summary["median_step_time_s"] > 0
        assert all(math.isfinite(v) for v in summary["losses"])
        # starts near ln(vocab): an untrained model on the mock task
        assert abs(summary["losses"][0] - math.log(128)) < 0.5
        runs[d] = summary
    assert runs["mok"]["mok_backend"] == "reference"
    # fp32 on CPU: the two dispatchers give the same loss curve to float32 rounding
    for a, m in zip(runs["alltoall"]["losses"], runs["mok"]["losses"]):
        assert abs(a - m) <= 1e-4 * max(1.0, abs(a)), (runs["alltoall"]["losses"],
                                                       runs["mok"]["losses"])


def test_bench_layer_tiny_writes_report(tmp_path):
    paths = run_distributed(W.bench_layer_tiny, 2, str(tmp_path))
    report = json.loads(open(paths[0]).read())
    assert set(report["results"]) == {"alltoall", "mok"}
    assert report["skipped"].get("flex")
    for r in report["results"].values():
        assert r["median_ms_slowest_rank"] >= r["median_ms_this_rank0"] > 0
        assert r["iters"] == 20
    assert report["gpu_count"] == 0 and report["world_size"] == 2
    assert report["command"] and report["date"]
    assert "commit" in report

"""The example training script and the layer benchmark, at toy sizes on CPU (gloo).

The GPU versions (60 steps, bf16, 2 GPUs) are ``examples/run_gpu_ab.sh``."""

from __future__ import annotations

import json
import math
import os

import pytest

from harness import run_distributed

import mok_megatron_workers as W

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("extra", [(), ("--moe-shared-expert-intermediate-size", "32"),
                                   ("--moe-expert-capacity-factor", "1.0",
                                    "--moe-pad-expert-input-to-capacity"),
                                   ("--num-microbatches", "3"),
                                   ("--expert-tensor-parallel-size", "2")],
                         ids=["routed", "shared_expert", "drop_and_pad", "microbatches",
                              "expert_tp"])
def test_example_trains_same_losses_with_alltoall_and_mok(tmp_path, extra):
    runs = {}
    for d in ("alltoall", "mok"):
        out = tmp_path / f"{d}.json"
        losses = run_distributed(W.example_train, 2, d, str(out), extra)
        assert losses[0] == losses[1]                    # every rank reports the global mean
        summary = json.loads(out.read_text())
        assert summary["dispatcher"] == d and summary["world_size"] == 2
        etp = 2 if "--expert-tensor-parallel-size" in extra else 1
        assert (summary["expert_model_parallel_size"], summary["expert_tensor_parallel_size"]) \
            == (2 // etp, etp)
        # 2 layers x (fc1 64x32 + fc2 32x64) when the shared expert is on
        shared = "--moe-shared-expert-intermediate-size" in extra
        assert summary["shared_expert_parameters_this_rank"] == (8192 if shared else 0)
        assert summary["args"]["moe_pad_expert_input_to_capacity"] == \
            ("--moe-pad-expert-input-to-capacity" in extra)
        assert summary["losses"] == losses[0] and len(losses[0]) == 5
        assert summary["tokens_per_s_per_gpu"] > 0 and summary["median_step_time_s"] > 0
        # 3 micro-batches: Megatron's schedule, 3x the tokens of a step
        micro = 3 if "--num-microbatches" in extra else 1
        assert summary["schedule"] == ("micro_batch_loop_cpu" if micro > 1 else "direct")
        assert summary["tokens_per_step_per_gpu"] == 2 * 32 * micro
        assert all(math.isfinite(v) for v in summary["losses"])
        # starts near ln(vocab): an untrained model on the mock task
        assert abs(summary["losses"][0] - math.log(128)) < 0.5
        runs[d] = summary
    assert runs["mok"]["mok_backend"] == "reference"
    # fp32 on CPU: the two dispatchers give the same loss curve to float32 rounding
    for a, m in zip(runs["alltoall"]["losses"], runs["mok"]["losses"]):
        assert abs(a - m) <= 1e-4 * max(1.0, abs(a)), (runs["alltoall"]["losses"],
                                                       runs["mok"]["losses"])


def test_example_micro_batches_are_the_mean_of_their_losses():
    # a 3-micro-batch step reports the mean of 3 different batches' losses, the first being
    # the one-micro-batch step's batch (the same weights: no optimizer step in between)
    for direct, mean3, each in run_distributed(W.example_micro_batch_losses, 2, "mok"):
        assert abs(mean3 - sum(each) / 3) < 1e-6 and each[0] == direct and len(set(each)) == 3


def test_example_argument_errors():
    train = W._load("examples/train_gpt_moe.py", "mok_example_train_args")
    for bad in (["--overlap-moe-expert-parallel-comm"],                        # needs bf16
                ["--overlap-moe-expert-parallel-comm", "--bf16", "--moe-shared-expert-overlap",
                 "--moe-shared-expert-intermediate-size", "32"],             # Megatron refuses both
                ["--num-microbatches", "0"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)
    assert train.parse_args(["--overlap-moe-expert-parallel-comm", "--bf16"]).num_microbatches == 1
    # on CPU ranks (gloo) the overlap is refused with the reason, not run
    msgs = run_distributed(W.example_train_refused, 2, ("--overlap-moe-expert-parallel-comm", "--bf16"))
    assert all("needs CUDA" in m for m in msgs), msgs
    # expert TP that does not divide the world
    msgs = run_distributed(W.example_train_refused, 2, ("--expert-tensor-parallel-size", "3"))
    assert all("does not divide the world size 2" in m for m in msgs), msgs


@pytest.mark.multigpu
def test_example_ep_overlap_gpu(tmp_path):
    # Megatron's 1F1B EP overlap in the example (bf16, EP = 2, 3 micro-batches, CUDA backend):
    # the first step's loss is bitwise the unoverlapped run's (the forward does the same
    # math; later steps follow gradients summed in another order), alltoall close to mok
    runs = {}
    for name, d, over in (("mok", "mok", False), ("mok_overlap", "mok", True),
                          ("alltoall_overlap", "alltoall", True)):
        extra = ("--bf16", "--num-microbatches", "3", "--device", "cuda") + \
            (("--overlap-moe-expert-parallel-comm",) if over else ())
        out = tmp_path / f"{name}.json"
        run_distributed(W.example_train, 2, d, str(out), extra, backend="nccl", fresh=True)
        runs[name] = json.loads(out.read_text())
    assert runs["mok_overlap"]["schedule"] == "1f1b_ep_overlap"
    assert runs["mok"]["schedule"] == "forward_backward_no_pipelining"
    assert runs["mok_overlap"]["mok_backend"] == "cuda"
    assert runs["mok_overlap"]["losses"][0] == runs["mok"]["losses"][0]
    for a, m in zip(runs["alltoall_overlap"]["losses"], runs["mok_overlap"]["losses"]):
        assert abs(a - m) <= 2e-2 * max(1.0, abs(a)), (runs["alltoall_overlap"]["losses"],
                                                       runs["mok_overlap"]["losses"])


@pytest.mark.parametrize("extra", [(), ("--drop-and-pad", "1.0"), ("--etp", "2")],
                         ids=("dropless", "drop_and_pad", "expert_tp"))
def test_bench_layer_tiny_writes_report(tmp_path, extra):
    paths = run_distributed(W.bench_layer_tiny, 2, str(tmp_path), extra)
    report = json.loads(open(paths[0]).read())
    dp = "--drop-and-pad" in extra
    assert report["shape"]["drop_and_pad_capacity_factor"] == (1.0 if dp else None)
    etp = 2 if "--etp" in extra else 1
    shape = report["shape"]
    assert (shape["expert_parallel"], shape["expert_tensor_parallel"]) == (2 // etp, etp)
    assert set(report["results"]) == {"alltoall", "mok", "mok:sms=8"}
    assert report["skipped"].get("flex")
    for r in report["results"].values():
        assert r["median_ms_slowest_rank"] >= r["median_ms_this_rank0"] > 0
        assert r["iters"] == 20
    assert report["gpu_count"] == 0 and report["world_size"] == 2
    assert report["shape"]["schedule"] == "interleaved"
    assert report["command"] and report["date"]
    assert "commit" in report


CPU_RUN_PROBE = """
import torch
from megatron.core import utils as mutils
from megatron.core.tensor_parallel import random as mrandom
from megatron_mok.megatron import harness

buf, tracker = mutils.GlobalMemoryBuffer(), mrandom.CudaRNGStatesTracker()
harness.enable_cpu_megatron(on_cpu=True)
t = buf.get_tensor((3, 4), torch.float32, "probe")
assert t.device.type == "cpu" and t.shape == (3, 4), t
with tracker.fork():                       # a no-op on CPU runs, even with a GPU visible
    pass
harness.enable_cpu_megatron(on_cpu=False)  # a GPU run next: Megatron's own code again
try:
    t = buf.get_tensor((3, 4), torch.float32, "probe_gpu")   # a new name: a new allocation
    print("gpu_run_buffer", t.device.type)
except (AssertionError, RuntimeError) as e:   # no CUDA on this machine: Megatron's own call
    print("gpu_run_buffer raised", type(e).__name__)
"""


def test_cpu_run_scratch_follows_the_run_not_the_visible_gpu():
    # Run s14-5: the example's gloo test on a GPU host put Megatron's attention scratch on
    # cuda:0. enable_cpu_megatron(on_cpu=True) must give CPU scratch wherever it runs, and
    # on_cpu=False must hand the allocation back to Megatron (CUDA, or its error without one).
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CPU_RUN_PROBE], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    import torch
    want = "gpu_run_buffer cuda" if torch.cuda.is_available() else "gpu_run_buffer raised"
    assert want in out.stdout, out.stdout + out.stderr[-2000:]


def test_bench_layer_interleaves_dispatchers():
    """One iteration of each layer in turn, the first rotating; warm-ups not timed."""
    import torch

    bench = W._load("benchmarks/bench_layer.py", "mok_bench_layer_sched")
    order = []

    class Probe(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def forward(self, x):
            order.append(self.name)
            return x * 2.0, None

    layers = {n: Probe(n) for n in ("a", "b", "c")}
    x, gy = torch.randn(4, 1, 3), torch.randn(4, 1, 3)
    times = bench.bench_interleaved(layers, x, gy, iters=4, warmup=2, device=torch.device("cpu"))
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b",
                     "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t > 0 for v in times.values() for t in v)


def test_bench_layer_dispatcher_variants():
    bench = W._load("benchmarks/bench_layer.py", "mok_bench_layer_variants")
    v = bench.dispatcher_variant
    assert v("alltoall") == ("alltoall", set())
    assert v("mok:overlap:high") == ("mok", {"overlap", "high"})
    assert v("mok:sms=24") == ("mok", {"sms=24"}) and bench.variant_num_sms({"sms=24"}) == 24
    assert bench.variant_num_sms({"overlap"}) is None
    assert v("alltoall:graphs") == ("alltoall", {"graphs"})
    assert v("mok:graphs:sms=64") == ("mok", {"graphs", "sms=64"})
    assert v("flex:hybridep:sms=20") == ("flex", {"hybridep", "sms=20"})
    assert bench.flex_backend({"hybridep", "sms=20"}) == "hybridep"
    assert bench.flex_backend({"ncclep"}) == "ncclep" and bench.flex_backend({"overlap"}) == "deepep"
    for bad in ("alltoall:high", "alltoall:sms=8", "mok:hybridep", "flex:high", "flex:hybridep:ncclep",
                "flex:sms=0", "mok:sms=0", "mok:sms=x", "mok:sms=", "mok:fast"):
        assert v(bad) is None, bad
    # what this CPU machine lacks, said as the reason a variant is skipped
    import importlib.util
    if importlib.util.find_spec("deep_ep") is None:
        assert bench.flex_unavailable("deepep") == "deep_ep is not importable"
        assert bench.flex_unavailable("hybridep") == "deep_ep is not importable"
    from megatron_mok.megatron import versions
    if versions.installed_version_tuple()[:2] < (0, 19):
        assert "0.19" in bench.flex_unavailable("ncclep")
    elif importlib.util.find_spec("transformer_engine") is None:
        assert "transformer_engine" in bench.flex_unavailable("ncclep")

    class Cfg:                               # a release without moe_flex_dispatcher_num_sms
        moe_deepep_num_sms = moe_hybridep_num_sms = None
    c = Cfg()
    bench.set_flex_num_sms(c, "hybridep", 12)
    assert c.moe_hybridep_num_sms == 12 and c.moe_deepep_num_sms is None
    c.moe_flex_dispatcher_num_sms = None     # 0.19+
    bench.set_flex_num_sms(c, "deepep", 16)
    assert c.moe_flex_dispatcher_num_sms == 16 and c.moe_deepep_num_sms is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--dispatchers", "mok,mok:sms=-1"])
    with pytest.raises(SystemExit):              # the first round records the graphs
        bench.parse_args(["--dispatchers", "mok,mok:graphs", "--warmup", "1"])
    with pytest.raises(SystemExit):              # graphs are created once per process
        bench.parse_args(["--dispatchers", "mok:graphs,alltoall:graphs", "--sequential"])
    bench.parse_args(["--dispatchers", "mok,mok:graphs"])


def test_ab_dispatchers_runs_each_dispatcher_and_writes_the_table(tmp_path):
    # examples/ab_dispatchers.py end to end on CPU: torchrun per dispatcher (2 gloo ranks),
    # the example with 2 micro-batches, the summary with one row per dispatcher
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # CPU ranks anywhere
    p = subprocess.run(
        [sys.executable, os.path.join(repo, "examples", "ab_dispatchers.py"), "--nproc-per-node",
         "2", "--dispatchers", "alltoall,mok", "--out", str(tmp_path), "--timeout", "240", "--",
         "--train-iters", "2", "--seq-length", "16", "--micro-batch-size", "2", "--hidden-size",
         "32", "--ffn-hidden-size", "32", "--num-experts", "4", "--vocab-size", "64",
         "--num-microbatches", "2", "--timing-warmup", "0", "--quiet"],
        capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "ab_summary.json").read_text())
    assert summary["failures"] == {}
    rows = {r["dispatcher"]: r for r in summary["rows"]}
    assert set(rows) == {"alltoall", "mok"}
    assert all(r["steps"] == 2 and r["median_step_ms"] > 0 for r in rows.values())
    # on CPU ranks the example steps its micro-batches in its own loop (no CUDA for Megatron's)
    assert {r["schedule"] for r in rows.values()} == {"micro_batch_loop_cpu"}
    assert rows["mok"]["mok_backend"] == "reference"
    assert rows["mok"]["max_abs_loss_diff_vs_alltoall"] < 1e-4
    assert "dispatcher" in p.stdout and "mok" in p.stdout

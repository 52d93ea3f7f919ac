"""Small batches: how much of a 128/512-token dispatch or combine is host work.

The performance issue's small-batch targets (128 tokens/rank: dispatch 25 us, combine 20 us)
are per-call latencies, which host work can dominate: Python, the eager dispatch's one host
read of the row count, kernel launches. This script separates host from device time:

- ``eager``: a dispatch / combine call as a training step sees it, host-inclusive
  (``perf_counter`` around the call and a synchronisation of the stream);
- ``static``: the same in static-shape mode (``max_recv_tokens``: no host read);
- ``..._return``: for eager and static calls, the time until the call returned (its host work:
  checks, allocations, launches, the eager host read), beside the host-inclusive figure; a
  call whose return time is close to its host-inclusive time is host-bound;
- ``graph``: the static calls captured in a CUDA graph each and replayed, timed with CUDA
  events: device time only (the kernel chain and the gaps between its kernels); with 2
  loopback ranks one thread replays both ranks' graphs back to back, so the two start
  together. Each replay's stream is first held busy by a sleep kernel, queued for every
  rank before any start event, so the events do not also count the host's graph launch and
  stream switch (on an idle GPU they did: ~18 us more than device time at W=1 / 128 tokens
  in run s14-1; NOTES (KK)).

Two ways to run it:

- one process: world size 1, and a loopback world of 2 ranks (threads on the one GPU,
  ``megatron_mok.loopback``: the two-rank protocol, with flags and pulls through L2/HBM
  instead of NVLink). These bound what is host overhead; they are NOT the 2-GPU figures;
- under torchrun, one process per GPU (the figures the targets are about): every rank times
  its own calls; graph replays are timed like the benchmark suite times every op (a device
  barrier, then CUDA events around the replay, per call the slowest rank, the median), with a
  sleep kernel between the barrier and the start event (the launch off the clock, as above).

    python benchmarks/bench_small_batch.py --out benchmarks/results [--tokens 128,512] [--worlds 1,2] [--fp8 | --fp8-ab]
    torchrun --nproc-per-node 2 benchmarks/bench_small_batch.py --out DIR [--tokens 128,512]

Writes ``small_batch.json`` (date, commit, GPU, command, medians per case) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# Loopback ranks share one CUDA context: every kernel must be loaded before any rank spins.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")   # loopback: a work queue per stream
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))

import common  # noqa: E402  (sets the no-multicast environment before torch loads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_mok as mok  # noqa: E402
from megatron_mok import loopback  # noqa: E402

H, E, K = 7168, 256, 8


def _median_us(samples):
    return round(statistics.median(samples) * 1e6, 1)


class _ProcessGroup:
    """The two calls ``_rank`` makes of a loopback group, for real ranks (one per process)."""

    distributed = True

    def __init__(self, device, shared=False):
        self.device, self.shared = device, shared

    def barrier(self):
        if self.shared:   # gloo: no device ids
            dist.barrier()
        else:
            dist.barrier(device_ids=[self.device.index])

    def exchange(self, obj):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out


def _rank(rank, world, tokens, iters, warmup, sms, grp=None, fp8=False):
    grp = grp if grp is not None else loopback.current()
    dev = torch.device("cuda", torch.cuda.current_device())
    shape = common.Shape(f"t{tokens}", tokens, H, experts=E, topk=K, seed=1237 + tokens)
    idx, w = common.make_routing(shape, rank, world, dev)
    x = common.make_x(shape, rank, dev)
    if fp8:   # the FP8 dispatch (megatron_mok/fp8.py): 1x128 blocks, float32 scales
        from megatron_mok import fp8 as fp8_mod
        x = fp8_mod.quantize(x, 128)
    stream = torch.cuda.current_stream(dev)

    def host_time(fn):
        """Median host-inclusive time of ``fn`` (until the stream is idle) and median time until
        ``fn`` returned (its host work: checks, allocations, launches, and any host wait)."""
        for _ in range(warmup):
            fn()
        stream.synchronize()
        out, ret = [], []
        for _ in range(iters):
            grp.barrier()                       # ranks start each call together
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            stream.synchronize()
            out.append(time.perf_counter() - t0)
            ret.append(t1 - t0)
        return _median_us(out), _median_us(ret)

    def graph_time(g):
        if getattr(grp, "distributed", False):
            # Real ranks: each replays its own graph after a device barrier and a sleep kernel
            # (common.time_op, busy_cycles): the replay's launch is off the clock, as below.
            t = common.time_op(g.replay, None, dev, iters, warmup, busy_cycles=common.BUSY_CYCLES)
            return round(t["median_us"], 1)
        # Rank 0 replays every rank's graph back to back from its one thread, so the ranks'
        # kernels start a graph launch (~microseconds) apart; threads woken by a barrier start
        # tens of microseconds apart, and a rank waiting for a late peer would count that.
        graphs = grp.exchange((g, stream))
        result = None
        if rank == 0:
            def replay_all(marks=None):
                if marks:   # every stream busy first: the launches below are then off the clock
                    for _, st in graphs:
                        with torch.cuda.stream(st):
                            torch.cuda._sleep(common.BUSY_CYCLES)
                for r, (gr, st) in enumerate(graphs):
                    with torch.cuda.stream(st):
                        if marks:
                            marks[0][r].record(st)
                        gr.replay()
                        if marks:
                            marks[1][r].record(st)
            for _ in range(warmup):
                replay_all()
            for _, st in graphs:
                st.synchronize()
            samples = [[] for _ in graphs]
            for _ in range(iters):
                marks = [[torch.cuda.Event(enable_timing=True) for _ in graphs] for _ in range(2)]
                replay_all(marks)
                for r in range(len(graphs)):
                    marks[1][r].synchronize()
                    samples[r].append(marks[0][r].elapsed_time(marks[1][r]) * 1e-3)
            result = [_median_us(x) for x in samples]
        return grp.exchange(result)[0][rank]

    kw = dict(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=tokens, backend="cuda",
              num_sms=sms)
    eager = mok.Buffer(None, **kw)
    res = eager.dispatch(x, idx, w)
    rows = res.src_rank.shape[0]
    # Combine always takes rows in the Buffer's dtype (an FP8 dispatch's rows are FP8).
    expert_out = (lambda n: torch.zeros(n, H, dtype=torch.bfloat16, device=dev)) if fp8 else None
    eo = expert_out(rows) if fp8 else res.tokens
    cap = max(grp.exchange(rows)) + 8   # what a user would size: max rows + slack
    r = {"rows": rows, "max_recv_tokens": cap}
    r["eager_dispatch_us"], r["eager_dispatch_return_us"] = host_time(lambda: eager.dispatch(x, idx, w))
    r["eager_combine_us"], r["eager_combine_return_us"] = host_time(lambda: eager.combine(eo, res.handle))

    static = mok.Buffer(None, max_recv_tokens=cap, **kw)
    sres = static.dispatch(x, idx, w)
    seo = expert_out(cap) if fp8 else sres.tokens
    r["static_dispatch_us"], r["static_dispatch_return_us"] = host_time(lambda: static.dispatch(x, idx, w))
    r["static_combine_us"], r["static_combine_return_us"] = host_time(lambda: static.combine(seo, sres.handle))

    # One capture at a time (loopback.py): torch synchronises the device around a capture.
    gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    stream.synchronize()
    for turn in range(world):
        if turn == rank:
            with torch.cuda.graph(gd):
                gres = static.dispatch(x, idx, w)
            with torch.cuda.graph(gc):
                static.combine(seo if fp8 else gres.tokens, gres.handle)
        grp.barrier()
    gd.replay()
    stream.synchronize()
    r["graph_dispatch_us"] = graph_time(gd)
    r["graph_combine_us"] = graph_time(gc)
    static.check_errors()
    for b in (eager, static):
        b.destroy()
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=common.DEFAULT_OUT)
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--sms", type=int, default=None,
                    help="Buffer num_sms (default: the Buffer's own, 24 for large calls and 64 for "
                         "calls of at most 1024 tokens per rank; a value given applies to every call)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--shared-gpu", action="store_true",
                    help="under torchrun: the ranks share the GPUs there are (rank r on cuda:(r %% GPUs), "
                         "gloo, peers mapped with CUDA IPC): a dry run of the multi-process path where "
                         "one GPU is lent; the driver time-slices the ranks, so its times are no claims")
    ap.add_argument("--fp8", action="store_true",
                    help="dispatch FP8 pairs (megatron_mok/fp8.py: 1x128 float32 scales); combine "
                         "takes bf16 rows as always")
    ap.add_argument("--fp8-ab", action="store_true",
                    help="single-process runs only: every case twice with bf16 tokens and twice with FP8 "
                         "pairs, alternating (bf16, FP8, bf16, FP8), so both payloads are timed in "
                         "one process and machine state (separate runs moved by more than their "
                         "difference, NOTES item 18)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_small_batch.py needs a CUDA GPU (it times the CUDA backend)")
    if a.shared_gpu and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        sys.exit("--shared-gpu is for runs under torchrun (processes); without it the ranks are "
                 "already loopback threads on one GPU")
    problem = (common.shared_gpu_problem(int(os.environ["WORLD_SIZE"]), torch.cuda.device_count())
               if a.shared_gpu else None)
    if problem:
        sys.exit(problem)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if a.fp8_ab:
            sys.exit("--fp8-ab is for single-process runs (world size 1 and loopback ranks)")
        return _main_distributed(a)
    cases = []
    payloads = (False, True, False, True) if a.fp8_ab else (a.fp8,)
    for W in (int(v) for v in a.worlds.split(",")):
        for T in (int(v) for v in a.tokens.split(",")):
            for fp8 in payloads:
                t0 = time.time()
                per_rank = loopback.run(_rank, W, T, a.iters, a.warmup, a.sms, fp8=fp8, timeout_s=600)
                cases.append(_case(W, T, per_rank, t0, "fp8" if fp8 else "bf16"))
    _write(a, _info(a, 1, "loopback", "one GPU: world size 1 and loopback ranks (threads), "
                    "not the 2-GPU targets"), cases)


def _case(world, tokens, per_rank, t0, payload=None):
    """One (world, tokens) case: every rank's medians and, per figure, the slowest rank's;
    prints a progress line. ``payload``: "bf16" or "fp8" (the dispatched rows)."""
    keys = [k for k in per_rank[0] if k.endswith("_us")]
    case = {"world_size": world, "tokens": tokens, "payload": payload, "per_rank": per_rank,
            "slowest_rank": {k: max(r[k] for r in per_rank) for k in keys}}
    print(f"[{time.time() - t0:5.1f} s] W={world} T={tokens} {payload or ''}: " +
          ", ".join(f"{k[:-3]} {v}" for k, v in case["slowest_rank"].items()), flush=True)
    return case


def _info(a, world, backend, note):
    info = common.env_info(sys.argv, a.commit, world, backend)
    info.update(iters=a.iters, warmup=a.warmup, num_sms=a.sms, hidden=H, experts=E, topk=K, note=note,
                fp8_dispatch=a.fp8)
    return info


def _main_distributed(a):
    """One rank per process and GPU (torchrun): the small-batch figures on real NVLink."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cuda", common.gpu_of(local, a.shared_gpu))
    torch.cuda.set_device(dev)
    if a.shared_gpu:   # NCCL refuses two ranks on one GPU
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=dev)
    grp = _ProcessGroup(dev, shared=a.shared_gpu)
    cases = []
    for T in (int(v) for v in a.tokens.split(",")):
        t0 = time.time()
        per_rank = grp.exchange(_rank(rank, world, T, a.iters, a.warmup, a.sms, grp, fp8=a.fp8))
        if rank == 0:  # every rank has the same per_rank; one prints and writes
            cases.append(_case(world, T, per_rank, t0, "fp8" if a.fp8 else "bf16"))
    if rank == 0:
        note = (f"SHARED-GPU DRY RUN, NO TIMING CLAIMS: {world} processes time-slicing "
                f"{torch.cuda.device_count()} GPU(s) (torchrun, gloo, CUDA IPC)" if a.shared_gpu else
                f"{world} processes, one GPU each (torchrun)")
        _write(a, _info(a, world, "gloo" if a.shared_gpu else "nccl", note + "; graph times: device "
                        "barrier, CUDA events, per call the slowest rank, median"), cases)
    grp.barrier()
    dist.destroy_process_group()


def _write(a, info, cases):
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "small_batch.json")
    common.write_json(path, {"schema": "mok-bench-small-batch/1", "env": info, "cases": cases})
    cols = ["eager_dispatch", "static_dispatch", "graph_dispatch", "eager_combine",
            "static_combine", "graph_combine"]
    print("\n| W | tokens | payload | " + " | ".join(c.replace("_", " ") + " (us)" for c in cols) + " |")
    print("|" + " --- |" * (len(cols) + 3))
    for c in cases:
        print(f"| {c['world_size']} | {c['tokens']} | {c.get('payload') or '-'} | " +
              " | ".join(str(c["slowest_rank"][k + "_us"]) for k in cols) + " |")
    ret = ["eager_dispatch", "static_dispatch", "eager_combine", "static_combine"]
    print("\nUntil the call returned (host work):\n\n| W | tokens | payload | " +
          " | ".join(c.replace("_", " ") + " (us)" for c in ret) + " |")
    print("|" + " --- |" * (len(ret) + 3))
    for c in cases:
        print(f"| {c['world_size']} | {c['tokens']} | {c.get('payload') or '-'} | " +
              " | ".join(str(c["slowest_rank"][k + "_return_us"]) for k in ret) + " |")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

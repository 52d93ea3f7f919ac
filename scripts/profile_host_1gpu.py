"""Where an eager dispatch's HOST time goes, on ONE GPU (world size 1).

    python scripts/profile_host_1gpu.py [--tokens 128] [--calls 200]

Prints the wall time per call of a plain loop of eager dispatches, then Python's cProfile of
``--calls`` eager dispatch + combine calls (by own time, then cumulative). At small batches
an eager call is host-bound (benchmarks/NOTES.md (X)): this shows which Python lines and
torch ops the host spends it on. Runs s11-3 and s11-4 used this code (then outside the
repository, as host_cprofile.py, with --tokens 128 --calls 200 fixed).
"""

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (no-multicast environment first)
import torch  # noqa: E402

import megatron_mok as mok  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--sms", type=int, default=24)
    a = ap.parse_args()
    T, dev = a.tokens, torch.device("cuda", 0)
    shape = common.Shape(f"t{T}", T, 7168, seed=1237 + T)
    idx, w = common.make_routing(shape, 0, 1, dev)
    x = common.make_x(shape, 0, dev)
    buf = mok.Buffer(None, num_experts=256, hidden=7168, topk=8, max_tokens_per_rank=T,
                     backend="cuda", num_sms=a.sms)
    for _ in range(20):
        r = buf.dispatch(x, idx, w)
        buf.combine(r.tokens, r.handle)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.calls):
        buf.dispatch(x, idx, w)
    torch.cuda.synchronize()
    print(f"dispatch: {(time.perf_counter() - t0) / a.calls * 1e6:.1f} us/call wall (eager, W=1)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        r = buf.dispatch(x, idx, w)
        buf.combine(r.tokens, r.handle)
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    buf.destroy()


if __name__ == "__main__":
    main()

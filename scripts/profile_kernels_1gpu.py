"""Per-kernel device times of one static-shape dispatch + combine on ONE GPU (world size 1),
from the torch profiler: which kernel of the chain costs what at small batches.

    python scripts/profile_kernels_1gpu.py [--tokens 128,512] [--sms 24] [--iters 20]
    python scripts/profile_kernels_1gpu.py --fp8 [--tokens 4096] [--host]

Prints, per token count, each kernel's median duration (us) over ``iters`` calls. ``--fp8``:
instead, the kernels of cached and eager dispatches of bf16 tokens and of FP8 pairs
(megatron_mok/fp8.py: the pack, then the transfer of packed rows), the FP8 dispatch's backward
(the prob gradients only) beside a full combine of zero rows carrying the same gradients, and
with ``--host`` the host ops of the FP8 eager dispatch.
"""

import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (no-multicast environment first)
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import megatron_mok as mok  # noqa: E402


def _profiled(buf, x, idx, w, iters, activity):
    """``iters`` dispatch + combine calls of ``buf`` under the torch profiler (after 5 warm-up
    calls); returns the profile."""
    def call():
        res = buf.dispatch(x, idx, w)
        buf.combine(res.tokens, res.handle)
    return _profile_calls(call, iters, activity)


def _kernel_table(prof, iters, title):
    per = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    print(f"{title} (median us over {iters} calls)")
    for name, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {statistics.median(v):8.1f}  x{len(v) // iters:<3d} {name}")


def _profile_calls(call, iters, activity):
    """``iters`` calls of ``call()`` under the torch profiler, after 5 warm-up calls, each call
    waited for: with programmatic dependent launch (the default on a GPU of its own, NOTES #48)
    a kernel queued right behind another is resident while that one runs and waits on the
    device, so back-to-back calls of one kernel (a cached dispatch, a combine) would each show
    about twice their duration (s23-3: 678 us for a 339 us transfer)."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[activity]) as prof:
        for _ in range(iters):
            call()
            torch.cuda.synchronize()
    return prof


def fp8_main(a, dev):
    """Kernels of bf16 and FP8 dispatches, cached and eager (world size 1)."""
    from megatron_mok import fp8
    for T in (int(v) for v in a.tokens.split(",")):
        shape = common.Shape(f"t{T}", T, 7168, seed=1237 + T)
        idx, w = common.make_routing(shape, 0, 1, dev)
        x = common.make_x(shape, 0, dev)
        pair = fp8.quantize(x, 128)
        buf = mok.Buffer(None, num_experts=256, hidden=7168, topk=8, max_tokens_per_rank=T, backend="cuda",
                         num_sms=a.sms)
        h16, h8 = buf.dispatch(x, idx, w).handle, buf.dispatch(pair, idx, w).handle
        # The FP8 dispatch's backward (prob gradients only) against a full combine of zero rows
        # that carries the same gradients (session 22's backward; NOTES #56).
        backend = buf._backend_for(x)
        gp = torch.rand(h8.num_out_rows, device=dev)
        zeros = torch.zeros(h8.num_out_rows, buf.hidden, dtype=buf.dtype, device=dev)
        for title, call in (("bf16 cached", lambda: buf.dispatch(x, handle=h16)),
                            ("fp8 cached", lambda: buf.dispatch(pair, handle=h8)),
                            ("bf16 eager", lambda: buf.dispatch(x, idx, w)),
                            ("fp8 eager", lambda: buf.dispatch(pair, idx, w)),
                            ("fp8 bwd prob grads only", lambda: backend.combine_prob_grads(h8, gp)),
                            ("fp8 bwd as a full zero-rows combine", lambda: backend.combine(zeros, h8, grad_probs=gp))):
            _kernel_table(_profile_calls(call, a.iters, ProfilerActivity.CUDA), a.iters, f"T={T} {title}")
        if a.host:
            hp = _profile_calls(lambda: buf.dispatch(pair, idx, w), a.iters, ProfilerActivity.CPU)
            print(f"T={T} fp8 eager dispatch host ops (totals over {a.iters} calls)")
            print(hp.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        buf.destroy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--host", action="store_true",
                    help="also print the host (CPU) ops of an eager dispatch+combine by self time")
    ap.add_argument("--fp8", action="store_true", help="bf16 vs FP8 dispatches (module docstring)")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    if a.fp8:
        return fp8_main(a, dev)
    for T in (int(v) for v in a.tokens.split(",")):
        shape = common.Shape(f"t{T}", T, 7168, seed=1237 + T)
        idx, w = common.make_routing(shape, 0, 1, dev)
        x = common.make_x(shape, 0, dev)
        kw = dict(num_experts=256, hidden=7168, topk=8, max_tokens_per_rank=T, backend="cuda", num_sms=a.sms)
        rows = mok.Buffer(None, **kw).dispatch(x, idx, w).tokens.shape[0]
        buf = mok.Buffer(None, max_recv_tokens=rows + 8, **kw)
        _kernel_table(_profiled(buf, x, idx, w, a.iters, ProfilerActivity.CUDA), a.iters, f"T={T} rows={rows}")
        if a.host:
            # Where the eager path's host time goes (the part a CUDA graph removes).
            hp = _profiled(mok.Buffer(None, **kw), x, idx, w, a.iters, ProfilerActivity.CPU)
            print(f"T={T} eager host ops (totals over {a.iters} dispatch+combine calls)")
            print(hp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()

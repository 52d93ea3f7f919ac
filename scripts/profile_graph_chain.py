"""Device time of small static-shape calls at world size 1, and the gaps between their kernels,
for several settings in the same process (A/B without a second process or library).

    python scripts/profile_graph_chain.py --out DIR [--tokens 128,512] [--settings "MOK_PDL=1;MOK_PDL=0"]
                                          [--calls 10] [--rounds 3] [--iters 50] [--sms N]

Each setting (``;``-separated, each a ``,``-separated list of ``VAR=value``; empty = defaults) is
applied to the environment while its Buffer is created (the backend reads its switches then),
so every setting's Buffer lives side by side. Per token count and setting, and per round
(settings alternate round by round, so drift hits all alike):

- ``chain_us``: one CUDA graph of ``--calls`` consecutive dispatch + combine calls, replayed
  ``--iters`` times; the median replay over ``calls``: the device time of one call pair in a
  steady chain (the graph's own launch spread over the calls);
- ``dispatch_us`` / ``combine_us``: a graph of ONE call each, replayed (as
  ``bench_small_batch.py --worlds 1``): what a single call costs, graph launch included;
- ``gaps``: from a torch-profiler trace of one replay of the chain graph, the median idle time
  between the end of each kernel and the start of the next, per (kernel, next kernel) pair.
  Negative values mean the next kernel started before the last one ended (an overlapped
  launch: programmatic dependent launch); its ``start_to_start`` is given too.

World size 1 only: one GPU, no NVLink. Writes ``graph_chain.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
sys.path.insert(1, _ROOT)

import common  # noqa: E402  (the no-multicast environment before torch loads)
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import megatron_mok as mok  # noqa: E402

H, E, K = 7168, 256, 8


parse_settings = common.parse_settings
label = common.settings_label


def kernel_gaps(kernels):
    """``kernels``: (name, start_us, end_us) of one stream, any order. Returns, per
    "name -> next name" boundary, the medians of the idle gap (next start - end) and of
    start-to-start, with the count."""
    ks = sorted(kernels, key=lambda k: k[1])
    per = collections.defaultdict(lambda: ([], []))
    for a, b in zip(ks, ks[1:]):
        gaps, starts = per[f"{a[0]} -> {b[0]}"]
        gaps.append(b[1] - a[2])
        starts.append(b[1] - a[1])
    return {k: {"gap_us": round(statistics.median(g), 2), "start_to_start_us": round(statistics.median(s), 2),
                "count": len(g)} for k, (g, s) in sorted(per.items())}


def _short(name: str) -> str:
    """A kernel's name without namespaces, templates and arguments: ``mok::(anon)::fill_kernel(...)``
    -> ``fill_kernel``."""
    base = name.replace("(anonymous namespace)", "").split("(")[0].split("<")[0]
    return base.rsplit("::", 1)[-1].split()[-1] if base.strip() else name[:40]


def _timed_replays(g, iters, stream):
    samples = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        g.replay()
        b.record(stream)
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3)
    return statistics.median(samples)


def measure(buf, x, idx, w, calls, iters, stream):
    """(chain_us per call pair, dispatch_us, combine_us, gaps) of one static Buffer."""
    res = buf.dispatch(x, idx, w)                     # warm: lazy allocations, module loading
    buf.combine(res.tokens, res.handle)
    torch.cuda.synchronize()
    chain, gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(chain):
        for _ in range(calls):
            r = buf.dispatch(x, idx, w)
            buf.combine(r.tokens, r.handle)
    with torch.cuda.graph(gd):
        r1 = buf.dispatch(x, idx, w)
    with torch.cuda.graph(gc):
        buf.combine(r1.tokens, r1.handle)
    for g in (chain, gd, gc):                         # warm-up replays
        for _ in range(5):
            g.replay()
    torch.cuda.synchronize()
    out = {"chain_us": round(_timed_replays(chain, iters, stream) / calls, 2),
           "dispatch_us": round(_timed_replays(gd, iters, stream), 2),
           "combine_us": round(_timed_replays(gc, iters, stream), 2)}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        chain.replay()
        torch.cuda.synchronize()
    kernels = [(_short(e.name), e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    out["kernels_traced"] = len(kernels)
    out["gaps"] = kernel_gaps(kernels)
    buf.check_errors()
    return out


def make_buffer(env, T, rows, sms):
    with common.with_env(env):
        return mok.Buffer(None, num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T, backend="cuda",
                          num_sms=sms, max_recv_tokens=rows + 8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--settings", default="MOK_PDL=1;MOK_PDL=0")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sms", type=int, default=None, help="Buffer num_sms (default: the Buffer's own)")
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_graph_chain.py needs a CUDA GPU")
    settings = parse_settings(a.settings)
    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(dev)
    cases = []
    for T in (int(v) for v in a.tokens.split(",")):
        shape = common.Shape(f"t{T}", T, H, experts=E, topk=K, seed=1237 + T)
        idx, w = common.make_routing(shape, 0, 1, dev)
        x = common.make_x(shape, 0, dev)
        probe = mok.Buffer(None, num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T, backend="cuda")
        rows = probe.dispatch(x, idx, w).tokens.shape[0]
        probe.destroy()
        bufs = [make_buffer(env, T, rows, a.sms) for env in settings]
        for rnd in range(a.rounds):
            for env, buf in zip(settings, bufs):
                t0 = time.time()
                m = measure(buf, x, idx, w, a.calls, a.iters, stream)
                cases.append({"tokens": T, "rows": rows, "setting": label(env), "round": rnd, **m})
                print(f"[{time.time() - t0:4.1f} s] T={T} {label(env):<28} round {rnd}: chain {m['chain_us']} us/pair, "
                      f"dispatch {m['dispatch_us']}, combine {m['combine_us']} us ({m['kernels_traced']} kernels traced)",
                      flush=True)
        for buf in bufs:
            buf.destroy()
    summary = {}
    for c in cases:
        s = summary.setdefault(f"T={c['tokens']} {c['setting']}", collections.defaultdict(list))
        for k in ("chain_us", "dispatch_us", "combine_us"):
            s[k].append(c[k])
    print("\nmedians over rounds:")
    for name, s in summary.items():
        print(f"  {name:<36} " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in s.items()))
    last = {}
    for c in cases:
        last[(c["tokens"], c["setting"])] = c["gaps"]
    for (T, st), gaps in last.items():
        print(f"\nT={T} {st}: kernel boundaries in the chain graph (last round)")
        for k, v in gaps.items():
            print(f"  {v['gap_us']:7.2f} gap  {v['start_to_start_us']:7.2f} start-to-start  x{v['count']:<3d} {k}")
    info = common.env_info(sys.argv, a.commit, 1, "none")
    info.update(calls=a.calls, rounds=a.rounds, iters=a.iters, num_sms=a.sms, hidden=H, experts=E, topk=K,
                note="world size 1 on one GPU: no NVLink; graph replays, device time only")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "graph_chain.json")
    common.write_json(path, {"schema": "mok-graph-chain/1", "env": info, "cases": cases,
                             "medians": {n: {k: statistics.median(v) for k, v in s.items()} for n, s in summary.items()}})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

"""Phase ends of the phased combine on a loopback group: W ranks as threads on ONE GPU
(developer tool, for sessions where only one GPU is lent).

    python scripts/profile_loopback_phases.py [--world 2] [--tokens 4096] [--sms 24] [--iters 20] [--out FILE]

Every rank captures one static-shape combine in a CUDA graph; rank 0 then replays all ranks'
graphs back to back (their kernels start microseconds apart) --iters times, and after each
replay reads every rank's trace (CudaBackend.trace_view): when the rank's combine kernel
started, when its last block ended the produce phase, and when its last block ended, in us
from that rank's first block start. Prints and writes the medians per rank.

These are loopback figures (flags and pulls through L2/HBM of one GPU, both ranks' SMs
sharing it: megatron_mok/loopback.py), not NVLink figures; they show how the two phases of a
change move against each other, e.g. a produce phase doing more work for a lighter consume.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
sys.path.insert(1, _ROOT)

import common  # noqa: E402  (sets the no-multicast environment before torch loads)

import torch  # noqa: E402

import megatron_mok as mok  # noqa: E402
from megatron_mok import loopback  # noqa: E402

H, E, K = 7168, 256, 8
_HALF = 128  # trace row of block b's phase end: _HALF + b (kTraceBlocks / 2)


def _phases(tr: torch.Tensor, num_blocks: int):
    """(produce phase end, kernel end) in us from the kernel's first block start, or None for
    the produce phase of a call that did not run phased."""
    t = tr.cpu()
    t0 = int(t[:num_blocks, 0].min())
    end = (int(t[:num_blocks, 1].max()) - t0) / 1e3
    ph = t[_HALF:_HALF + num_blocks, 1]
    produce = (int(ph.max()) - t0) / 1e3 if int(ph.min()) > 0 else None
    return produce, end


def _rank(rank, world, tokens, iters, sms):
    grp = loopback.current()
    dev = torch.device("cuda", torch.cuda.current_device())
    shape = common.Shape(f"t{tokens}", tokens, H, experts=E, topk=K, seed=1237 + tokens)
    idx, w = common.make_routing(shape, rank, world, dev)
    x = common.make_x(shape, rank, dev)
    stream = torch.cuda.current_stream(dev)
    kw = dict(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=tokens, backend="cuda", num_sms=sms)
    probe = mok.Buffer(None, **kw)
    cap = max(grp.exchange(probe.dispatch(x, idx, w).tokens.shape[0])) + 8
    probe.destroy()
    buf = mok.Buffer(None, max_recv_tokens=cap, **kw)
    res = buf.dispatch(x, idx, w)
    be = buf._get_backend("cuda")
    g = torch.cuda.CUDAGraph()
    stream.synchronize()
    for turn in range(world):  # one capture at a time (loopback.py)
        if turn == rank:
            with torch.cuda.graph(g):
                buf.combine(res.tokens, res.handle)
        grp.barrier()
    ranks = grp.exchange((g, stream, be.trace_view(), be.num_blocks))
    out = None
    if rank == 0:
        samples = [[] for _ in ranks]
        for it in range(iters + 3):  # 3 warm-up replays
            for _, st, tr, _ in ranks:
                with torch.cuda.stream(st):
                    tr.zero_()
                st.synchronize()
            for gr, st, _, _ in ranks:
                with torch.cuda.stream(st):
                    gr.replay()
            for _, st, _, _ in ranks:
                st.synchronize()
            if it >= 3:
                for r, (_, _, tr, nb) in enumerate(ranks):
                    samples[r].append(_phases(tr, nb))
        out = []
        for s in samples:
            prod = [p for p, _ in s if p is not None]
            out.append({"produce_end_us": round(statistics.median(prod), 1) if prod else None,
                        "kernel_end_us": round(statistics.median([e for _, e in s]), 1),
                        "samples": len(s)})
    out = grp.exchange(out)[0]
    buf.check_errors()
    buf.destroy()
    return out[rank]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON file for the medians")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    res = loopback.run(_rank, a.world, a.tokens, a.iters, a.sms, timeout_s=600)
    for r, v in enumerate(res):
        print(f"[phases] W={a.world} T={a.tokens} sms={a.sms} rank {r}: produce phase ends "
              f"{v['produce_end_us']} us, combine ends {v['kernel_end_us']} us "
              f"(medians of {v['samples']} graph replays, from the rank's kernel start)", flush=True)
    if a.out:
        env = {k: v for k, v in os.environ.items() if k.startswith("MOK_")}
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "env": env, "gpu": torch.cuda.get_device_name(), "ranks": res}, f, indent=1)


if __name__ == "__main__":
    main()

"""Where the time of one dispatch/combine goes, per SM budget (developer tool, GPU only).

    torchrun --nproc-per-node 2 scripts/profile_stages.py [--sms 24,48,132] [--out DIR]

Times, on the slowest rank (median of --iters CUDA-event timings after warm-up):
  dispatch (eager: layout + one host read + fill + transfer), dispatch (static shape: no host
  read), transfer only (a cached dispatch: staging + pull with the layout reused), combine,
  and the MoK-internal layout alone (static dispatch minus transfer). The numbers feed
  benchmarks/NOTES.md; the user-facing benchmark is benchmarks/bench_dispatch_combine.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)


def _print_clocks(tr, tag, what, kinds, rest):
    """A clock build's per-warp cycles by kind: the trace's last len(kinds) + 1 rows hold
    {sum of cycles, warps} per kind, then the total. Prints nothing for a normal build."""
    rows = tr[-(len(kinds) + 1):].cpu().tolist()
    total, warps = rows[-1]
    if warps <= 0 or total <= 0:   # a normal build, or a kernel whose warps had no work of this kind
        return
    parts = ", ".join(f"{k} {100.0 * rows[i][0] / total:.1f}%" for i, k in enumerate(kinds))
    parts += f", {rest} {100.0 * (total - sum(r[0] for r in rows[:-1])) / total:.1f}%"
    print(f"[{tag}] {what} ({warps} warps, {total / warps / 1e3:.1f} k cycles per warp): {parts}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--sms", default="24,48,132")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--kernels", action="store_true", help="also print per-kernel device times")
    p.add_argument("--kernel-sms", default="24",
                   help="with --kernels: the SM counts whose per-kernel times are printed")
    p.add_argument("--expert-alignment", default="1",
                   help="comma-separated Buffer expert_alignment values: every SM count once per value")
    p.add_argument("--env-sweep", default=None,
                   help="NAME=v1,v2,...: repeat every SM count once per value of env var NAME")
    args = p.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    import megatron_mok as mok
    from megatron_mok.bench import timed

    def median_us(fn, iters, warmup):  # CUDA events, median (the main job's timer)
        return timed(fn, iters, warmup, dev)

    g = torch.Generator().manual_seed(rank)
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    rows = []
    sweep_name, sweep_vals = None, [None]
    if args.env_sweep:
        sweep_name, vals = args.env_sweep.split("=")
        sweep_vals = vals.split(",")
    aligns = [int(a) for a in args.expert_alignment.split(",") if a]
    configs = [(int(s), v, al) for s in args.sms.split(",") for v in sweep_vals for al in aligns]
    for sms, env_val, align in configs:
        if sweep_name:
            os.environ[sweep_name] = env_val
        buf = mok.Buffer(None, num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T,
                         backend="cuda", num_sms=sms, device=dev, expert_alignment=align)
        res = buf.dispatch(x, idx, w)
        cap = int(res.tokens.shape[0] * 1.1) + 64
        sbuf = mok.Buffer(None, num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T,
                          backend="cuda", num_sms=sms, device=dev, max_recv_tokens=cap,
                          expert_alignment=align)
        be = buf._get_backend("cuda")
        t = {
            "dispatch_eager_us": median_us(lambda: buf.dispatch(x, idx, w), args.iters, args.warmup),
            "dispatch_static_us": median_us(lambda: sbuf.dispatch(x, idx, w), args.iters, args.warmup),
            "transfer_only_us": median_us(lambda: be.dispatch_cached(x, res.handle), args.iters, args.warmup),
            "combine_us": median_us(lambda: buf.combine(res.tokens, res.handle), args.iters, args.warmup),
        }
        vals = torch.tensor(list(t.values()), dtype=torch.float64, device=dev)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        t = dict(zip(t.keys(), vals.tolist()))
        t["layout_static_us"] = t["dispatch_static_us"] - t["transfer_only_us"]
        t["num_sms"] = sms
        t["expert_alignment"] = align
        if sweep_name:
            t[sweep_name] = env_val
        rows.append(t)
        if rank == 0:
            print(f"[profile] sms={sms}: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in t.items()), flush=True)
        # Per-block start/end inside one transfer kernel: which role finishes last, and when.
        for name, fn in (("dispatch_transfer", lambda: be.dispatch_cached(x, res.handle)),
                         ("combine", lambda: buf.combine(res.tokens, res.handle))):
            tr = be.trace_view()
            torch.cuda.synchronize()
            dist.barrier()
            tr.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            fn()
            torch.cuda.synchronize()
            prod = be.dispatch_producers if name.startswith("dispatch") else be.combine_producers
            t = tr[: be.num_blocks].cpu()
            t0 = int(t[:, 0].min())
            rel = [((int(a) - t0) / 1e3, (int(b) - t0) / 1e3) for a, b in t.tolist()]
            pe = [e for _, e in rel[:prod]]
            ce = [e for _, e in rel[prod:]]
            ps = [st for st, _ in rel]
            print(f"[trace] rank {rank} sms={sms} {name}: starts within {max(ps):.1f} us; producers "
                  f"({prod}) end {min(pe):.1f}..{max(pe):.1f} us; consumers ({len(ce)}) end "
                  f"{min(ce):.1f}..{max(ce):.1f} us", flush=True)
            # Phased kernels (every block produces, then consumes) also mark the first phase's
            # end per block in the trace's second half; then the role labels above do not apply.
            half = tr.shape[0] // 2
            ph = tr[half: half + be.num_blocks, 1].cpu()
            if be.num_blocks <= half and int(ph.min()) > 0:
                pend = [(int(v) - t0) / 1e3 for v in ph.tolist()]
                ends = [e for _, e in rel]
                print(f"[trace] rank {rank} sms={sms} {name} (phased, all {be.num_blocks} blocks): "
                      f"produce phase ends {min(pend):.1f}..{max(pend):.1f} us; consume phase ends "
                      f"{min(ends):.1f}..{max(ends):.1f} us", flush=True)
            # Clock builds (MOK_CONSUME_CLOCKS, MOK_DISPATCH_CLOCKS): cycles by kind in the last rows.
            if name == "combine":
                _print_clocks(tr, "cclocks", f"rank {rank} sms={sms} combine consume",
                              ("token setup", "partial wait", "issue", "copy wait", "own sums",
                               "rank sum + y", "token tail"), "rest")
            else:
                _print_clocks(tr, "dclocks", f"rank {rank} sms={sms} dispatch pull",
                              ("setup local", "setup remote (flag waits incl.)", "load wait local",
                               "load wait NVLink", "store issue"), "rest (chunk release accounting, loop)")
        kernel_sms = sms in [int(v) for v in args.kernel_sms.split(",") if v]
        if args.kernels and rank == 0 and kernel_sms:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    sbuf.dispatch(x, idx, w)
                    buf.combine(res.tokens, res.handle)
                torch.cuda.synchronize()
            try:
                table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)
            except Exception:  # older names
                table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
            print(table, flush=True)
            if args.out:
                with open(os.path.join(args.out, "kernels.txt"), "a") as f:
                    f.write(f"sms={sms}\n{table}\n")
        elif args.kernels and kernel_sms:
            for _ in range(5):
                sbuf.dispatch(x, idx, w)
                buf.combine(res.tokens, res.handle)
        buf.destroy()
        sbuf.destroy()
    if rank == 0:
        print("| SMs | dispatch eager | dispatch static | transfer only | layout (static - transfer) | combine |")
        print("| --- | --- | --- | --- | --- | --- |")
        for t in rows:
            print(f"| {t['num_sms']}{' ' + sweep_name + '=' + str(t.get(sweep_name)) if sweep_name else ''}"
                  f"{' A=' + str(t['expert_alignment']) if t['expert_alignment'] > 1 else ''} | {t['dispatch_eager_us']:.1f} | {t['dispatch_static_us']:.1f} | "
                  f"{t['transfer_only_us']:.1f} | {t['layout_static_us']:.1f} | {t['combine_us']:.1f} |")
        if args.out:
            with open(os.path.join(args.out, "profile_stages.json"), "w") as f:
                json.dump({"shape": vars(args), "world_size": world,
                           "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

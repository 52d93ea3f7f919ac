"""The main job: dispatch -> identity experts -> combine on every local GPU, checked and timed.

    python -m megatron_mok.bench                 # all local GPUs (CUDA backend), else 2 CPU ranks
    python -m megatron_mok.bench --tokens 512 --iters 50 --backend reference

One process per GPU (NCCL), or 2 CPU processes (gloo, reference backend) without a GPU. Every
rank builds every rank's inputs from one seed, so each checks its own output against an
independent computation: rows (order, source, content) from the inputs directly, and the
combine result of identity experts from the contract's formula (per rank d holding rows of a
token: ``round_partial(n_d * x)``, summed in rank order in fp32, rounded once). Prints one
table: shape, backend, median time of dispatch and combine on the slowest rank, the bytes
that crossed between ranks and their rate. Standalone benchmarks live in ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .cuda.peer_memory import disable_multicast_env
from .version import source_commit

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_routing(seed: int, rank: int, tokens: int, experts: int, topk: int, device):
    """Rank ``rank``'s inputs, the same on every rank that asks: uniform random top-k."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    idx = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices
    w = torch.rand(tokens, topk, generator=g)
    return idx.to(device), w.to(device)


def make_tokens(seed: int, rank: int, tokens: int, hidden: int, dtype, device):
    g = torch.Generator().manual_seed(seed * 1000 + rank + 500)
    return torch.randn(tokens, hidden, generator=g).to(dtype).to(device)


def expected_rows(seed, args, rank, world, dtype, device):
    """Rows this rank must receive, built directly from every rank's inputs."""
    e_local = args.experts // world
    keys = []
    for s in range(world):
        idx, _ = make_routing(seed, s, args.tokens, args.experts, args.topk, "cpu")
        for t in range(args.tokens):
            for k in range(args.topk):
                e = int(idx[t, k]) - rank * e_local
                if 0 <= e < e_local:
                    keys.append((e, s, t, k))
    keys.sort()
    return keys


def expected_combine(x, idx, world, experts, partial_dtype, dtype):
    """Identity experts: token t comes back as sum_d round_partial(n_d(t) * x_t)."""
    e_local = experts // world
    dest = torch.where(idx >= 0, idx // e_local, torch.full_like(idx, -1))
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for d in range(world):
        n_d = (dest == d).sum(1, keepdim=True).float()
        y += (x.float() * n_d).to(partial_dtype).float()   # n_d * x is exact in fp32 (n_d <= 32)
    return y.to(dtype)


def timed(fn, iters: int, warmup: int, device) -> float:
    """Median microseconds of ``fn`` (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return times[len(times) // 2]


def peer_read_gbps(rank: int, world: int, device, nbytes: int = 256 << 20) -> float:
    """GB/s of one rank reading ``nbytes`` from the next rank's memory (copy engine through a
    symmetric-memory peer view), every rank at once; 0.0 when it cannot be measured."""
    if device.type != "cuda" or world < 2:
        return 0.0
    try:
        import torch.distributed._symmetric_memory as symm_mem

        n = nbytes // 2
        buf = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
        hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        src = hdl.get_buffer((rank + 1) % world, (n,), torch.bfloat16)
        dst = torch.empty(n, dtype=torch.bfloat16, device=device)
        dist.barrier()
        us = timed(lambda: dst.copy_(src), 5, 2, device)
        dist.barrier()
        return nbytes / (us * 1e-6) / 1e9
    except Exception as e:  # noqa: BLE001 - the figure is optional; say why it is missing
        print(f"[bench] rank {rank}: peer bandwidth not measured ({type(e).__name__}: {e})", flush=True)
        return 0.0


def worker(rank: int, world: int, port: int, args) -> None:
    disable_multicast_env()
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    from . import Buffer

    dtype = DTYPES[args.dtype]
    buf = Buffer(None, num_experts=args.experts, hidden=args.hidden, topk=args.topk,
                 max_tokens_per_rank=args.tokens, dtype=dtype, backend=args.backend,
                 num_sms=args.num_sms, device=device)
    x = make_tokens(args.seed, rank, args.tokens, args.hidden, dtype, device)
    idx, w = make_routing(args.seed, rank, args.tokens, args.experts, args.topk, device)
    backend_name = buf._backend_for(x).name
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"[bench] {world} rank(s) on {'GPU' if use_cuda else 'CPU'}, backend={backend_name}, "
        f"T={args.tokens} H={args.hidden} E={args.experts} K={args.topk} {args.dtype}")

    # ---- correctness: rows and combine against independent computations
    say("[bench] checking dispatch rows and combine against the inputs ...")
    res = buf.dispatch(x, idx, w)
    keys = expected_rows(args.seed, args, rank, world, dtype, device)
    ok = res.tokens.shape[0] == len(keys)
    if ok and keys:
        s_t = torch.tensor([[s, t] for _, s, t, _ in keys], device=device)
        ok &= bool((res.src_rank == s_t[:, 0]).all()) and bool((res.src_token == s_t[:, 1]).all())
        all_x = torch.stack([make_tokens(args.seed, s, args.tokens, args.hidden, dtype, "cpu")
                             for s in range(world)]).to(device)
        ok &= torch.equal(res.tokens, all_x[s_t[:, 0], s_t[:, 1]])
    y = buf.combine(res.tokens, res.handle)
    y_ref = expected_combine(x, idx, world, args.experts, buf.combine_partial_dtype, dtype)
    ok &= torch.equal(y, y_ref)
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag)
    say(f"[bench] correctness: {'PASS' if int(flag) == 0 else f'FAIL on {int(flag)} rank(s)'}")

    # ---- timing
    say(f"[bench] timing {args.iters} iterations after {args.warmup} warm-up ...")
    t_disp = timed(lambda: buf.dispatch(x, idx, w), args.iters, args.warmup, device)
    t_comb = timed(lambda: buf.combine(res.tokens, res.handle), args.iters, args.warmup, device)
    times = torch.tensor([t_disp, t_comb], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    # Bytes that must cross between ranks: each (token, remote destination rank) once.
    e_local = args.experts // world
    dest = torch.where(idx >= 0, idx // e_local, torch.full_like(idx, -1))
    remote = sum(int(((dest == d).any(1)).sum()) for d in range(world) if d != rank)
    row_bytes = args.hidden * x.element_size()
    xbytes = torch.tensor([remote * row_bytes], dtype=torch.float64, device=device)
    dist.all_reduce(xbytes, op=dist.ReduceOp.MAX)
    bw = torch.tensor([peer_read_gbps(rank, world, device)], dtype=torch.float64, device=device)
    dist.all_reduce(bw, op=dist.ReduceOp.MIN)
    floor_us = float(xbytes) / (float(bw) * 1e9) * 1e6 if float(bw) > 0 else 0.0
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": source_commit(),
        "command": " ".join([os.path.basename(sys.executable), "-m", "megatron_mok.bench"] + sys.argv[1:]),
        "world_size": world, "device": torch.cuda.get_device_name(rank) if use_cuda else "cpu",
        "backend": backend_name, "tokens": args.tokens, "hidden": args.hidden,
        "experts": args.experts, "topk": args.topk, "dtype": args.dtype,
        "correct": int(flag) == 0, "dispatch_us": float(times[0]), "combine_us": float(times[1]),
        "bytes_crossing_per_rank": float(xbytes), "num_sms": args.num_sms,
        "peer_read_gbps": float(bw), "floor_us": floor_us,
        "dispatch_x_floor": float(times[0]) / floor_us if floor_us else None,
        "combine_x_floor": float(times[1]) / floor_us if floor_us else None,
    }
    if rank == 0:
        print()
        xf = lambda us: f"{us / floor_us:.2f}x" if floor_us else "n/a"
        print("| shape (T,H,E,K) | backend | ranks | dispatch us | combine us | MB crossing/rank | "
              "floor us (at peer GB/s) | dispatch / combine vs floor | correct |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        print(f"| {args.tokens},{args.hidden},{args.experts},{args.topk} | {backend_name} | {world} | "
              f"{times[0]:.1f} | {times[1]:.1f} | {float(xbytes) / 1e6:.1f} | "
              f"{floor_us:.1f} ({float(bw):.0f}) | {xf(float(times[0]))} / {xf(float(times[1]))} | "
              f"{report['correct']} |")
        if not use_cuda:
            print("(CPU reference backend: the times show the code runs, not how fast MoK is.)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    buf.destroy()
    dist.destroy_process_group()
    if int(flag) != 0:
        sys.exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    gpus = torch.cuda.device_count()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="force 2 CPU ranks (gloo, reference backend)")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: GPUs, or 2 on CPU)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (4096 GPU / 256 CPU)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (7168 GPU / 512 CPU)")
    p.add_argument("--experts", type=int, default=None, help="experts (256 GPU / 16 CPU)")
    p.add_argument("--topk", type=int, default=None, help="top-k (8 GPU / 4 CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--backend", choices=["auto", "reference", "cuda"], default="auto")
    p.add_argument("--num-sms", type=int, default=None, help="SMs for the CUDA kernels (default 24)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (50 GPU / 5 CPU)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rank-0 report here")
    args = p.parse_args(argv)
    on_gpu = gpus > 0 and not args.cpu
    big = on_gpu
    args.tokens = args.tokens if args.tokens is not None else (4096 if big else 256)
    args.hidden = args.hidden or (7168 if big else 512)
    args.experts = args.experts or (256 if big else 16)
    args.topk = args.topk or (8 if big else 4)
    args.iters = args.iters or (50 if big else 5)
    args.warmup = args.warmup if args.warmup is not None else (10 if big else 1)
    world = args.world_size or (gpus if on_gpu else 2)
    if on_gpu and world > gpus:
        p.error(f"--world-size {world} > {gpus} GPUs")
    disable_multicast_env()
    mp.spawn(worker, args=(world, free_port(), args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

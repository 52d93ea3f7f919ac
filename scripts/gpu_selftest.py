"""CUDA backend vs reference backend, bitwise, on every local GPU (one process each).

    python scripts/gpu_selftest.py [--quick]

A developer's check for the GPU machine (the pytest suite in tests/test_cuda_backend.py is
the one CI-style gate). Covers random and awkward routings, forward and backward, static-shape
mode, ring wrap-around with a tiny ring (incl. a call larger than the ring), repeated runs,
several SM counts, and a missing peer ending in a timeout error. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def routing(case, g, T, E, K, W):
    if case == "random":
        idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    elif case == "unrouted":
        idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
        idx[torch.rand(T, K, generator=g) < 0.3] = -1
    elif case == "one_expert":
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, 0] = E - 1
    elif case == "duplicates":
        idx = torch.randint(0, E, (T, K), generator=g)   # may name one expert twice
    elif case == "skewed":
        hot = torch.randint(0, 4, (T, K), generator=g)
        idx = torch.where(torch.rand(T, K, generator=g) < 0.5, hot,
                          torch.randint(0, E, (T, K), generator=g))
    else:
        raise ValueError(case)
    return idx


def inputs(seed, rank, T, H, E, K, W, case, dtype):
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    idx = routing(case, g, T, E, K, W)
    w = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g).to(dtype)
    return x, idx, w


def run_pair(bufs, x, idx, w, seed, partial_check=True):
    """Forward+backward on both buffers; returns the list of mismatching fields."""
    outs = []
    for buf in bufs:
        xx = x.clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        res = buf.dispatch(xx, idx, ww)
        g = torch.Generator(device=x.device).manual_seed(seed)
        scale = (torch.rand(res.tokens.shape[0], 1, generator=g, device=x.device) + 0.5).to(x.dtype)
        expert_out = (res.tokens * scale) * res.probs.to(x.dtype)[:, None]
        y = buf.combine(expert_out.contiguous(), res.handle)
        gy = torch.randn(y.shape, generator=g, device=x.device).to(y.dtype)
        y.backward(gy)
        outs.append(dict(tokens=res.tokens, probs=res.probs, tpe=res.tokens_per_expert,
                         src_rank=res.src_rank, src_token=res.src_token, y=y,
                         gx=xx.grad, gw=ww.grad))
    bad = []
    for k in outs[0]:
        a, b = outs[0][k], outs[1][k]
        if a is None or b is None:
            if (a is None) != (b is None):
                bad.append(k)
            continue
        if a.shape != b.shape or not torch.equal(a, b):
            bad.append(k)
    return bad


def worker(rank, world, port, args, errq):
    try:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, device_id=dev)
        import megatron_mok as mok

        failures = []

        def check(name, ok, detail=""):
            tag = "ok  " if ok else "FAIL"
            if rank == 0 or not ok:
                print(f"[rank {rank}] {tag} {name} {detail}", flush=True)
            if not ok:
                failures.append(name)

        H, E, K, T_max = 256, 4 * world * 2, 4, 300
        configs = [
            dict(dtype=torch.bfloat16, partial=None),
            dict(dtype=torch.bfloat16, partial=torch.float32),
            dict(dtype=torch.float32, partial=None),
            dict(dtype=torch.float16, partial=None),
        ]
        for cfg in configs if not args.quick else configs[:1]:
            ref = mok.Buffer(None, num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T_max,
                             dtype=cfg["dtype"], backend="reference",
                             combine_partial_dtype=cfg["partial"], device=dev)
            cud = mok.Buffer(None, num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T_max,
                             dtype=cfg["dtype"], backend="cuda", combine_partial_dtype=cfg["partial"],
                             device=dev, timeout_s=5)
            for case in ["random", "unrouted", "one_expert", "duplicates", "skewed"]:
                for Ts in ([T_max, 37], [0, 129], [1, 300]):
                    T = Ts[rank % len(Ts)]
                    x, idx, w = inputs(args.seed, rank, T, H, E, K, world, case, cfg["dtype"])
                    bad = run_pair([ref, cud], x.to(dev), idx.to(dev), w.to(dev), args.seed)
                    check(f"{cfg['dtype']} partial={cfg['partial']} {case} T={Ts}", not bad, str(bad))
            ref.destroy()
            cud.destroy()

        # K=1 and E=W
        for (EE, KK) in [(world, 1), (world, min(world, 2))]:
            ref = mok.Buffer(None, num_experts=EE, hidden=H, topk=KK, max_tokens_per_rank=64,
                             backend="reference", device=dev)
            cud = mok.Buffer(None, num_experts=EE, hidden=H, topk=KK, max_tokens_per_rank=64,
                             backend="cuda", device=dev, timeout_s=5)
            x, idx, w = inputs(args.seed + 1, rank, 61, H, EE, KK, world, "random", torch.bfloat16)
            bad = run_pair([ref, cud], x.to(dev), idx.to(dev), w.to(dev), args.seed)
            check(f"E={EE} K={KK}", not bad, str(bad))
            ref.destroy(); cud.destroy()

        # Standard-ish shape at hidden 7168, repeated runs bitwise, several SM counts.
        Hs, Es, Ks, Ts = 7168, 32 * world, 8, 1024
        ref = mok.Buffer(None, num_experts=Es, hidden=Hs, topk=Ks, max_tokens_per_rank=Ts,
                         backend="reference", device=dev)
        x, idx, w = inputs(args.seed + 2, rank, Ts, Hs, Es, Ks, world, "random", torch.bfloat16)
        x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
        for sms in ([4, 16, 24, 48] if not args.quick else [24]):
            cud = mok.Buffer(None, num_experts=Es, hidden=Hs, topk=Ks, max_tokens_per_rank=Ts,
                             backend="cuda", device=dev, num_sms=sms, timeout_s=5)
            bad = run_pair([ref, cud], x, idx, w, args.seed)
            check(f"H=7168 num_sms={sms}", not bad, str(bad))
            res0 = cud.dispatch(x, idx, w)
            y0 = cud.combine(res0.tokens, res0.handle)
            same = True
            for _ in range(20 if not args.quick else 3):
                r = cud.dispatch(x, idx, w)
                yy = cud.combine(r.tokens, r.handle)
                same &= torch.equal(r.tokens, res0.tokens) and torch.equal(yy, y0)
            check(f"20 repeats bitwise num_sms={sms}", same)
            cud.destroy()
        ref.destroy()

        # Ring wrap-around: a ring of 3 chunks, calls of varying size, one larger than the ring.
        H2, E2, K2, T2 = 512, 4 * world, 3, 640
        ref = mok.Buffer(None, num_experts=E2, hidden=H2, topk=K2, max_tokens_per_rank=T2,
                         backend="reference", device=dev)
        ring = 3 * 64 * H2 * 2 + 3 * 64 * K2 * 4
        cud = mok.Buffer(None, num_experts=E2, hidden=H2, topk=K2, max_tokens_per_rank=T2,
                         backend="cuda", device=dev, ring_bytes=ring, timeout_s=5)
        g = torch.Generator().manual_seed(args.seed + 3)
        n_calls = args.ring_calls
        all_ok = True
        t0 = time.time()
        for i in range(n_calls):
            T = int(torch.randint(0, T2 + 1, (1,), generator=g)) if i % 10 else T2
            x, idx, w = inputs(args.seed + 100 + i, rank, T, H2, E2, K2, world, "random", torch.bfloat16)
            x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
            rr = ref.dispatch(x, idx, w)
            rc = cud.dispatch(x, idx, w)
            ok = torch.equal(rr.tokens, rc.tokens)
            ok &= torch.equal(ref.combine(rr.tokens, rr.handle), cud.combine(rc.tokens, rc.handle))
            if not ok and all_ok:
                print(f"[rank {rank}] ring call {i} (T={T}) mismatch", flush=True)
            all_ok &= ok
        check(f"{n_calls} ring-wrapping calls (ring = 3 chunks, calls up to 10 chunks)", all_ok,
              f"{time.time() - t0:.1f}s")
        cud.destroy(); ref.destroy()

        # Static-shape mode + CUDA graph capture/replay.
        cap = 4096
        ref = mok.Buffer(None, num_experts=E2, hidden=H2, topk=K2, max_tokens_per_rank=T2,
                         backend="reference", device=dev, max_recv_tokens=cap)
        cud = mok.Buffer(None, num_experts=E2, hidden=H2, topk=K2, max_tokens_per_rank=T2,
                         backend="cuda", device=dev, max_recv_tokens=cap, timeout_s=5)
        x, idx, w = inputs(args.seed + 4, rank, 333, H2, E2, K2, world, "random", torch.bfloat16)
        x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
        bad = run_pair([ref, cud], x, idx, w, args.seed)
        check("static-shape mode eager", not bad, str(bad))
        # graph: warm up on a side stream, then capture dispatch+combine
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                r = cud.dispatch(x, idx, w)
                cud.combine(r.tokens, r.handle)
        torch.cuda.current_stream().wait_stream(s)
        dist.barrier()
        graph_ok = False
        try:
            gph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gph):
                r = cud.dispatch(x, idx, w)
                yg = cud.combine(r.tokens, r.handle)
            rr = ref.dispatch(x, idx, w)
            yr = ref.combine(rr.tokens, rr.handle)
            graph_ok = True
            for _ in range(3):
                gph.replay()
                torch.cuda.synchronize()
                graph_ok &= torch.equal(r.tokens, rr.tokens) and torch.equal(yg, yr)
        except Exception as e:  # noqa: BLE001 - report and count as a failure
            print(f"[rank {rank}] graph capture failed: {e!r}", flush=True)
        check("CUDA graph capture + 3 replays (static mode)", graph_ok)
        cud.check_errors()
        cud.destroy(); ref.destroy()

        # Missing peer: rank 0 dispatches alone and must get a timeout error, not a hang.
        if world > 1:
            cud = mok.Buffer(None, num_experts=E2, hidden=H2, topk=K2, max_tokens_per_rank=T2,
                             backend="cuda", device=dev, timeout_s=2)
            x, idx, w = inputs(args.seed + 5, rank, 100, H2, E2, K2, world, "random", torch.bfloat16)
            if rank == 0:
                t0 = time.time()
                try:
                    cud.dispatch(x.to(dev), idx.to(dev), w.to(dev))
                    check("missing peer -> timeout error", False, "no error raised")
                except RuntimeError as e:
                    check("missing peer -> timeout error", "timed out" in str(e),
                          f"after {time.time() - t0:.1f}s: {str(e)[:160]}")
            dist.barrier()
        dist.barrier()
        ok = torch.tensor([len(failures)], device=dev)
        dist.all_reduce(ok)
        if rank == 0:
            print(f"SELFTEST {'PASSED' if int(ok) == 0 else 'FAILED'}: {int(ok)} failure(s)", flush=True)
        dist.destroy_process_group()
        errq.put(int(ok))
    except Exception:
        traceback.print_exc()
        errq.put(1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ring-calls", type=int, default=1000)
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.world_size, port, args, q))
             for r in range(args.world_size)]
    for pr in procs:
        pr.start()
    results = [q.get(timeout=900) for _ in procs]
    for pr in procs:
        pr.join(timeout=30)
    sys.exit(0 if all(r == 0 for r in results) else 1)


if __name__ == "__main__":
    main()

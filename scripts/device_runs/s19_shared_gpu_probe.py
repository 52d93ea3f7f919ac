"""Run s19-1's probe (benchmarks/results/README.md): can two PROCESSES share one GPU as a
2-rank group, so that the process-group path (symmetric-memory rendezvous, IPC-mapped peer
workspaces, one CUDA context per rank) runs where only one GPU is lent?

    python3 scripts/device_runs/s19_shared_gpu_probe.py gloo|nccl OUT_JSON

Each rank: cuda:0, a process group of the given backend (nccl with
NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30's experimental multi-rank-per-GPU mode), a CUDA
Buffer and a reference Buffer over it, and for a few contract cases: forward + backward of
both, bitwise; then the time of 20 dispatch + combine pairs (time-sliced contexts: not a
performance figure)."""
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def rank_main(rank, world, backend, port, out_q):
    rep = {"rank": rank}
    try:
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                          NVSHMEM_DISABLE_NVLS="1", NCCL_MULTI_RANK_GPU_ENABLE="1")
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        kw = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kw)
        t = torch.ones(4, device="cuda") * (rank + 1)
        try:
            dist.all_reduce(t)
            rep["all_reduce_cuda"] = t.tolist()
        except Exception as e:
            rep["all_reduce_cuda"] = f"{type(e).__name__}: {e}"[:300]
        outs = [torch.empty(4, device="cuda") for _ in range(world)]
        try:
            dist.all_gather(outs, t)
            rep["all_gather_cuda"] = "ok"
        except Exception as e:
            rep["all_gather_cuda"] = f"{type(e).__name__}: {e}"[:300]
        from harness import _buffer, assert_same_results, contract_cases, full_pass, spec_inputs
        cases = contract_cases(world)
        rep["cases"] = {}
        for name in ("random", "unrouted_slots", "t0_on_rank0", "all_to_one_expert", "dsv3_like"):
            if name not in cases:
                continue
            spec = cases[name]
            inputs = spec_inputs(spec, world, torch.bfloat16, 7, device=torch.device("cuda", 0))
            t0 = time.time()
            buf = _buffer(spec, torch.bfloat16, "cuda", None, device=torch.device("cuda", 0))
            ref = _buffer(spec, torch.bfloat16, "reference", None, device=torch.device("cuda", 0))
            got = full_pass(buf, *inputs[rank], 7)
            want = full_pass(ref, *inputs[rank], 7)
            try:
                assert_same_results(got, want, f"{name} rank {rank}")
                rep["cases"][name] = f"bitwise ({time.time() - t0:.2f} s)"
            except AssertionError as e:
                rep["cases"][name] = f"MISMATCH {e}"[:400]
            buf.destroy()
            ref.destroy()
        rep["case_names"] = sorted(cases)
        import megatron_mok as mok
        b = mok.Buffer(None, num_experts=16, hidden=1024, topk=4, max_tokens_per_rank=512,
                       backend="cuda", device=torch.device("cuda", 0))
        x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(16, device="cuda")[:4] for _ in range(512)])
        w = torch.rand(512, 4, device="cuda")
        for i in range(25):
            if i == 5:
                torch.cuda.synchronize(); dist.barrier(); t0 = time.time()
            r = b.dispatch(x, idx, w)
            y = b.combine(r.tokens, r.handle)
        torch.cuda.synchronize()
        rep["pair_ms"] = (time.time() - t0) / 20 * 1e3
        b.destroy()
        dist.barrier()
        dist.destroy_process_group()
        rep["ok"] = True
    except BaseException:
        rep["error"] = traceback.format_exc()[-3000:]
    out_q.put(rep)


if __name__ == "__main__":
    backend, out = sys.argv[1], sys.argv[2]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    ps = [ctx.Process(target=rank_main, args=(r, 2, backend, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    reps = []
    deadline = time.time() + float(os.environ.get("PROBE_LIMIT_S", "150"))
    while len(reps) < 2 and time.time() < deadline:
        try:
            reps.append(q.get(timeout=1))
        except Exception:
            if not any(p.is_alive() for p in ps):
                break
    for p in ps:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    res = {"backend": backend, "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
           "ranks": sorted(reps, key=lambda r: r["rank"]), "finished": len(reps)}
    json.dump(res, open(out, "w"), indent=1)
    print(json.dumps(res, indent=1)[:6000])

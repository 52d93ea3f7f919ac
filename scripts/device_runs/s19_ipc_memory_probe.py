"""Runs s19-6 and s19-7's probe (benchmarks/results/README.md): does a destroyed Buffer's workspace go
back to the GPU when ranks are processes sharing one GPU (CUDA IPC peer memory)? s19-5 ran
out of GPU memory after ~15 W=4 tests in one pool of ranks (each rank held 31-37 GiB).

    MOK_TEST_SHARED_GPU=1 python3 scripts/device_runs/s19_ipc_memory_probe.py OUT_JSON

Each rank creates and destroys 4 Buffers (with one dispatch + combine, then without any
call), recording torch's allocated bytes and the GPU's free bytes after each destroy, and
again after torch.cuda.ipc_collect()."""
import gc
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def _probe(rank, world_size):
    import torch.distributed as dist

    import megatron_mok as mok
    from harness import make_inputs, rank_device

    dev = rank_device(rank)
    rows = []

    def snap(tag):
        torch.cuda.synchronize(dev)
        dist.barrier()
        rows.append((tag, torch.cuda.memory_allocated(dev) >> 20, torch.cuda.mem_get_info(dev)[0] >> 20))

    snap("start")
    for i in range(8):
        buf = mok.Buffer(None, num_experts=8, hidden=64, topk=2, max_tokens_per_rank=32,
                         backend="cuda", device=dev)
        if i < 4:
            x, idx, w = make_inputs(i, world_size, [32] * world_size, 8, 64, 2, torch.bfloat16, device=dev)[rank]
            r = buf.dispatch(x, idx, w)
            buf.combine(r.tokens, r.handle)
            del r
        buf.destroy()
        del buf
        gc.collect()
        snap(f"destroyed {i} ({'called' if i < 4 else 'no call'})")
        if i % 2 == 1:
            torch.cuda.ipc_collect()
            snap(f"ipc_collect after {i}")
    return rows


if __name__ == "__main__":
    from harness import run_distributed, shutdown_pools

    out = {}
    try:
        for w in (2, 4):
            out[w] = run_distributed(_probe, w, backend="nccl", timeout=150)
    finally:
        shutdown_pools()
    json.dump(out, open(sys.argv[1], "w"), indent=1)
    for w, ranks in out.items():
        print(f"W={w} rank 0 (tag, torch allocated MiB, GPU free MiB):")
        for row in ranks[0]:
            print("  ", row)

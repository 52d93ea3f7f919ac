"""One rank of tests/test_isolated_gpus.py, as its own process with ``CUDA_VISIBLE_DEVICES``
naming only its own GPU (as Slurm's ``--gpus-per-task=1`` or a launcher that isolates ranks
does): each process sees its GPU as ``cuda:0`` and none of its peers'.

    CUDA_VISIBLE_DEVICES=R python tests/isolated_gpu_worker.py RANK WORLD PORT OUT_JSON  ({rank} in it: this rank's)

Both ranks run a dispatch -> expert -> combine forward and backward on the CUDA backend and on
the reference backend (same inputs, NCCL group) and write whether every output and gradient is
bitwise equal, or the error the CUDA backend raised (NOTES item 69).
"""

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
out = sys.argv[4].format(rank=rank)     # a path, or a pattern with {rank}
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS, os.path.dirname(_TESTS)]     # harness, and megatron_mok from this checkout
from harness import assert_same_results, full_pass, make_inputs  # noqa: E402

import megatron_mok as mok  # noqa: E402
from megatron_mok.cuda.peer_memory import disable_multicast_env  # noqa: E402

disable_multicast_env()                 # before the NCCL group is made

result = {"visible_gpus": torch.cuda.device_count()}
try:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=dev)
    E, H, K, T = 8 * world, 256, 4, [37, 0, 19, 64][:world]
    x, idx, w = make_inputs(11, world, T, E, H, K, torch.bfloat16, "mixed", device=dev)[rank]
    got = {}
    for backend in ("cuda", "reference"):
        buf = mok.Buffer(None, num_experts=E, hidden=H, topk=K, max_tokens_per_rank=64, backend=backend,
                         device=dev, timeout_s=60)
        got[backend] = full_pass(buf, x, idx, w, seed=5)
        buf.destroy()
    try:
        assert_same_results(got["cuda"], got["reference"], "cuda vs reference")
        result["ok"] = True
    except AssertionError as e:
        result.update(ok=False, error=f"not bitwise: {e}"[:3000])
except Exception as e:  # noqa: BLE001  (what the isolated setting raises is the finding)
    result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
with open(out, "w") as f:
    json.dump(result, f)
os._exit(0)     # a peer may be stuck in a collective: no teardown

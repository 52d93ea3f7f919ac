"""One rank of tests/test_exit_stop.py's GPU test, as its own process (an uncaught exception
must really end the interpreter, which the test harness's pooled ranks never let happen).

    python tests/exit_worker.py RANK WORLD PORT OUT_JSON

Both ranks make a CUDA-backend Buffer over gloo (processes sharing a GPU map each other's
workspaces with CUDA IPC) and dispatch. Rank 1 then raises, uncaught, as an expert that blew
up; rank 0 combines and reads its errors: it must raise naming rank 1 and quoting the
exception, long before its timeout_s.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
from megatron_mok.cuda.peer_memory import disable_multicast_env  # noqa: E402

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
disable_multicast_env()                 # before any process group or CUDA allocation
dev = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(dev)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=120))
import megatron_mok as mok  # noqa: E402  (after the process group, as in a training script)
from megatron_mok.cuda.errors import MokDevicePeerStopped  # noqa: E402

TIMEOUT_S = 90
buf = mok.Buffer(None, num_experts=4 * world, hidden=64, topk=2, max_tokens_per_rank=16,
                 backend="cuda", device=dev, timeout_s=TIMEOUT_S)
x = torch.randn(7, 64, device=dev, dtype=torch.bfloat16)
idx = torch.stack([torch.arange(7, device=dev) % (4 * world), (torch.arange(7, device=dev) + 3) % (4 * world)], 1)
res = buf.dispatch(x, idx, torch.rand(7, 2, device=dev))
torch.cuda.synchronize()
dist.barrier()                          # both dispatched: rank 0 now waits for rank 1's partials
if rank == 1:
    raise RuntimeError("an expert blew up on rank 1")
t0 = time.monotonic()
result = {"raised": None}
try:
    buf.combine(res.tokens.clone(), res.handle)       # identity experts
    buf.check_errors()
except MokDevicePeerStopped as e:
    result = {"raised": type(e).__name__, "rank": e.rank, "reason": e.reason, "message": str(e)}
result["seconds"] = time.monotonic() - t0
result["timeout_s"] = TIMEOUT_S
with open(out, "w") as f:
    json.dump(result, f)
os._exit(0)    # rank 1 is gone: no collective teardown

"""Ranks that each see only their own GPU (``CUDA_VISIBLE_DEVICES`` per rank: Slurm's
``--gpus-per-task=1``, launchers that isolate ranks) are common on clusters. The CUDA backend's
kernels read and write their peers' GPU memory; whether torch's symmetric memory maps a peer
GPU the process cannot see, and so whether the backend works there, has not been run (NOTES
item 69): this test runs it on two GPUs (not in shared-GPU mode: one GPU cannot be isolated
from itself) and reports what happens, bitwise against the reference backend.
"""

import json
import os

import pytest
import torch

from harness import run_rank_scripts


@pytest.mark.gpu
@pytest.mark.multigpu
def test_ranks_that_see_only_their_own_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (each rank isolated on its own: shared-GPU mode cannot do it)")
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    # one argument for every rank: each worker fills in its own {rank}
    codes, logs = run_rank_scripts("isolated_gpu_worker.py", 2, str(tmp_path / "rank{rank}.json"),
                                   env_for_rank=lambda r: {"CUDA_VISIBLE_DEVICES": str(r)})
    got = [json.load(open(o)) if os.path.exists(o) else {"ok": False, "exit": codes[r], "log": logs[r][-3000:]}
           for r, o in enumerate(outs)]
    assert [g.get("visible_gpus") for g in got] == [1, 1], got
    assert all(g["ok"] for g in got), got

"""Ranks that each see only their own GPU (``CUDA_VISIBLE_DEVICES`` per rank: Slurm's
``--gpus-per-task=1``, launchers that isolate ranks) are common on clusters. The CUDA backend's
kernels read and write their peers' GPU memory; whether torch's symmetric memory maps a peer
GPU the process cannot see, and so whether the backend works there, has not been run (NOTES
item 69): this test runs it on two GPUs (not in shared-GPU mode: one GPU cannot be isolated
from itself) and reports what happens, bitwise against the reference backend.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gpu
@pytest.mark.multigpu
def test_ranks_that_see_only_their_own_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (each rank isolated on its own: shared-GPU mode cannot do it)")
    here = os.path.dirname(os.path.abspath(__file__))
    port = _free_port()
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    procs = []
    for r in range(2):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(r),
               "PYTHONPATH": os.path.dirname(here) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs.append(subprocess.Popen([sys.executable, os.path.join(here, "isolated_gpu_worker.py"), str(r), "2",
                                       str(port), outs[r]], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank did not finish within 240 s (a hang in the isolated setting)")
    got = [json.load(open(o)) if os.path.exists(o) else {"ok": False, "log": logs[r][-3000:]}
           for r, o in enumerate(outs)]
    assert [g.get("visible_gpus") for g in got] == [1, 1], got
    assert all(g["ok"] for g in got), got

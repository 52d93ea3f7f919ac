"""The README's main job (``python -m megatron_mok.bench``): its correctness check must be able
to fail, and a failure must fail the command (exit status 1), not only print FAIL.

The worker runs in this process (world size 1, gloo, the reference backend, CPU sizes), once
as it is and once with ``Buffer.dispatch`` / ``Buffer.combine`` corrupted by one bit.
"""

from __future__ import annotations

import argparse
import socket

import pytest
import torch
import torch.distributed as dist

import megatron_mok
from megatron_mok import bench


def _args(**kw):
    a = dict(cpu=True, world_size=1, tokens=96, hidden=64, experts=8, topk=3, dtype="bf16",
             backend="reference", num_sms=None, iters=2, warmup=1, seed=0, json=None)
    a.update(kw)
    return argparse.Namespace(**a)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args):
    try:
        bench.worker(0, 1, _port(), args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_main_job_passes_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "main.json"
    _run(_args(json=str(out)))
    import json
    report = json.loads(out.read_text())
    assert report["correct"] is True and report["backend"] == "reference"
    assert report["dispatch_us"] > 0 and report["combine_us"] > 0
    assert "correctness: PASS" in capsys.readouterr().out


def _flip_first_bit(t: torch.Tensor) -> None:
    if t.numel():
        t.detach().view(torch.int16).view(-1)[0] ^= 1


@pytest.mark.parametrize("method", ["dispatch", "combine"])
def test_main_job_fails_the_command_on_one_wrong_bit(method, monkeypatch, capsys):
    real = getattr(megatron_mok.Buffer, method)

    def corrupted(self, *a, **k):
        out = real(self, *a, **k)
        _flip_first_bit(out.tokens if method == "dispatch" else out)
        return out
    monkeypatch.setattr(megatron_mok.Buffer, method, corrupted)
    with pytest.raises(SystemExit) as e:
        _run(_args())
    assert e.value.code == 1
    assert "correctness: FAIL on 1 rank(s)" in capsys.readouterr().out

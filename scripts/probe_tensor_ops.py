"""Host cost of the tensor attribute reads and views the call paths make, on a CPU tensor and
on a CUDA tensor in the same process (benchmarks/NOTES.md item 74: the same Python checks took
~3x longer on CUDA tensors under cProfile on the GPU host than on CPU tensors here).

    python scripts/probe_tensor_ops.py [--out FILE.json] [--calls 20000]

Per operation: the median over ``--calls`` timed repetitions (each timing 10 calls) in us per
call, CPU and CUDA side by side; on a machine without a GPU only the CPU column.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def per_call_us(fn, calls: int) -> float:
    """Median over ``calls`` timings of 10 back-to-back ``fn()``, in us per call."""
    for _ in range(1000):
        fn()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(); fn(); fn(); fn(); fn(); fn(); fn(); fn(); fn(); fn()  # noqa: E702
        samples.append((time.perf_counter() - t0) / 10)
    return round(statistics.median(samples) * 1e6, 3)


def ops(torch, t, idx):
    """name -> call on tensor ``t`` (bf16 [128, 7168]) and ``idx`` (int64 [128, 8], the same
    device)."""
    dev = t.device
    cnt = torch.zeros(258, dtype=torch.int64, device=dev)       # counts, R, rows received
    src = torch.zeros(2, 1024, dtype=torch.int64, device=dev)   # (src_rank, src_token) rows
    return {
        "device": lambda: t.device,
        "device_compare": lambda: t.device != idx.device,
        "device_compare_cached": lambda: dev != dev,
        "is_cuda": lambda: t.is_cuda,
        "dtype": lambda: t.dtype,
        "shape_index": lambda: t.shape[1],
        "shape_tuple": lambda: tuple(idx.shape),
        "dim": lambda: t.dim(),
        "is_contiguous": lambda: t.is_contiguous(),
        "requires_grad": lambda: t.requires_grad,
        "data_ptr": lambda: t.data_ptr(),
        "numel": lambda: t.numel(),
        "element_size": lambda: t.element_size(),
        "contiguous": lambda: idx.contiguous(),
        "slice": lambda: idx[:5],
        "select": lambda: idx[0],
        "empty": lambda: torch.empty(1024, dtype=torch.float32, device=dev),
        # Ways to take the views a handle holds (item 74): one op for several views, or none.
        "narrow": lambda: cnt.narrow(0, 0, 256),
        "as_strided": lambda: cnt.as_strided((256,), (1,), 0),
        "split_3": lambda: cnt.split((256, 1, 1)),
        "unbind_2": lambda: src.unbind(0),
        "select_2": lambda: (src[0], src[1]),
        "empty_2": lambda: (torch.empty(1024, dtype=torch.int64, device=dev),
                            torch.empty(1024, dtype=torch.int64, device=dev)),
        "detach": lambda: t.detach(),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=20000)
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
    importlib.import_module("common")   # the no-multicast environment before torch loads
    import torch  # noqa: E402

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    table = {}
    for d in devices:
        t = torch.empty(128, 7168, dtype=torch.bfloat16, device=d)
        idx = torch.zeros(128, 8, dtype=torch.int64, device=d)
        for name, fn in ops(torch, t, idx).items():
            table.setdefault(name, {})[d] = per_call_us(fn, a.calls)
    print(f"{'op':24s}" + "".join(f"{d:>10s}" for d in devices) + "   (us per call)")
    for name, row in table.items():
        print(f"{name:24s}" + "".join(f"{row[d]:10.3f}" for d in devices))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"devices": devices, "calls": a.calls, "us_per_call": table,
                       "gpu": torch.cuda.get_device_name() if len(devices) > 1 else None}, f, indent=1)


if __name__ == "__main__":
    main()

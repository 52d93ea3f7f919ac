"""Where a small dispatch's layout and fill spend their time, step by step, at world size 1:
reads the stamps of a ``MOK_LAYOUT_STAMPS=1`` build of the library (thread 0 of every layout
and fill block writes the globaltimer at the end of each step; ``layout_stamp`` in
``csrc/include/mok/device.h``).

    MOK_CUDA_LIB=path/to/stamps/libmok_cuda.so python scripts/profile_layout_stamps.py \\
        [--tokens 128,512] [--iters 50] [--out DIR]

Build such a library with ``make -C csrc EXTRA=-DMOK_LAYOUT_STAMPS=1 OUT=DIR`` (its own
folder: it must not replace the normal build). Per token count: one static-shape dispatch per iteration
(the stamp area zeroed before it), and per (kernel, block, step) the median over iterations of
the stamp's time since the call's first stamp, in microseconds. A normal build writes no
stamps: the script then says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
sys.path.insert(1, _ROOT)

import common  # noqa: E402  (the no-multicast environment before torch loads)
import torch  # noqa: E402

import megatron_mok as mok  # noqa: E402

H, E, K = 7168, 256, 8
STAMPS_PER_BLOCK = 16
# Step names by stamp index (device.h LayoutStamp), per region.
LAYOUT_STEPS = {0: "entry", 1: "pub_slot_free", 2: "pub_copied", 3: "pub_send_scan", 4: "pub_prefix",
                5: "pub_released", 6: "count_ready", 7: "count_copied", 8: "count_done",
                9: "scan_rows", 10: "scan_tasks", 11: "scan_end"}
FILL_STEPS = {0: "entry", 1: "loaded", 2: "rows", 3: "tasks", 4: "released", 5: "end"}
REGIONS = (("layout", LAYOUT_STEPS), ("fill", FILL_STEPS))


def stamp_view(impl) -> torch.Tensor:
    """The 512 stamp words after the transfer kernels' 512 trace words (int64, ns)."""
    off = impl.lib.mok_trace_offset(impl.ctx) + 4096
    return impl.mem.tensor[off: off + 4096].view(torch.int64)


def steps_of(words) -> dict:
    """``words``: the 512 stamp words of one call. Returns {(region, block, step): ns since the
    call's first stamp} for every stamp written."""
    nz = [w for w in words if w > 0]
    if not nz:
        return {}
    t0 = min(nz)
    out = {}
    for r, (region, names) in enumerate(REGIONS):
        for b in range(256 // STAMPS_PER_BLOCK):
            for k, name in names.items():
                w = words[r * 256 + b * STAMPS_PER_BLOCK + k]
                if w > 0:
                    out[(region, b, name)] = w - t0
    return out


def medians(calls) -> dict:
    per = collections.defaultdict(list)
    for c in calls:
        for key, ns in c.items():
            per[key].append(ns)
    return {key: statistics.median(v) / 1000.0 for key, v in per.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_layout_stamps.py needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    report = {"env": common.env_info(sys.argv, None, 1, "none"), "cases": []}
    for T in (int(v) for v in a.tokens.split(",")):
        shape = common.Shape(f"t{T}", T, H, experts=E, topk=K, seed=1237 + T)
        idx, w = common.make_routing(shape, 0, 1, dev)
        x = common.make_x(shape, 0, dev)
        kw = dict(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T, backend="cuda")
        rows = mok.Buffer(None, **kw).dispatch(x, idx, w).tokens.shape[0]
        buf = mok.Buffer(None, max_recv_tokens=rows + 8, **kw)
        impl = buf._get_backend("cuda")
        view = stamp_view(impl)
        for _ in range(5):
            buf.dispatch(x, idx, w)
        calls = []
        for _ in range(a.iters):
            torch.cuda.synchronize()
            view.zero_()
            torch.cuda.synchronize()
            buf.dispatch(x, idx, w)
            torch.cuda.synchronize()
            calls.append(steps_of(view.tolist()))
        buf.check_errors()
        if not any(calls):
            print("no stamps: the library was not built with -DMOK_LAYOUT_STAMPS=1", file=sys.stderr)
            sys.exit(2)
        med = medians(calls)
        print(f"T={T} rows={rows}: median us since the call's first stamp ({a.iters} calls)")
        for region, names in REGIONS:
            blocks = sorted({b for (r, b, _) in med if r == region})
            for b in blocks:
                cells = [f"{n} {med[(region, b, n)]:.2f}" for n in names.values() if (region, b, n) in med]
                print(f"  {region} block {b:2d}: " + ", ".join(cells))
        report["cases"].append({"tokens": T, "rows": rows, "median_us": {f"{r}/{b}/{n}": v for (r, b, n), v in med.items()}})
        buf.destroy()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "layout_stamps.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

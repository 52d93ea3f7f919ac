"""Where an FP8 dispatch's host time goes, on ONE GPU (NOTES item 18 after session 22).

    python scripts/profile_fp8_host.py --out DIR [--tokens 128,512] [--blocks 12] [--per-block 40]

s24-1 (``bench_small_batch.py --fp8-ab``, one process) measured a 128-token static FP8 dispatch
returning ~42 us later than the bf16 one at world size 1. This splits that: in one process, in
``--blocks`` alternating blocks (``profile_host_calls.alternating_blocks``: the host's speed
drifts, so every variant sees the same drift), it times until return, with the stream
synchronised after each call and outside the timed part:

- ``dispatch_bf16`` / ``dispatch_fp8``: ``Buffer.dispatch`` of a static-shape Buffer
  (``max_recv_tokens``), bf16 tokens / the FP8 pair (1x128 float32 scales);
- ``check_fp8_pair``, ``check_dispatch_inputs_bf16`` / ``_fp8``: the input checks alone;
- ``pack``: ``fp8.pack`` (its allocation and kernel launch); ``unpack``: the two views;
- ``apply_bf16`` / ``apply_packed``: ``DispatchFunction.apply`` on the backend, bf16 tokens /
  the packed byte rows (what the Buffer calls after its checks);
- ``dispatch_rows`` / ``apply_pair_rows``: the pair read in place (NOTES #57): building the
  ``fp8.PairRows``, and the backend call on a built one; ``dispatch_rows_s24``: building it as
  session 24 did (byte views, an environment read per call; NOTES item 25);
- ``chain_*``: the FP8 call's steps chained one more at a time (pack then apply; the same with
  the pack as two torch copies; the checks before; the views after), to find where the parts'
  sum and the whole call differ (s24-2: by ~30 us).

Then ``cProfile`` of ``--profile-calls`` calls of each dispatch, the top functions by own time
(cProfile slows Python, so its times only rank the parts). Writes ``fp8_host.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--per-block", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--profile-calls", type=int, default=300)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(_ROOT, "scripts"))
    from profile_host_calls import alternating_blocks, call_inputs, median_us, one_gpu_setup  # noqa: E402
    common, torch, dev = one_gpu_setup("profile_fp8_host.py")

    import megatron_mok as mok  # noqa: E402
    from megatron_mok import fp8, validation  # noqa: E402
    from megatron_mok.autograd.functions import DispatchFunction  # noqa: E402
    stream = torch.cuda.current_stream(dev)
    out = {"env": common.env_info(sys.argv, a.commit, 1, "none"),
           "blocks": a.blocks, "per_block": a.per_block, "cases": []}
    for T in [int(t) for t in a.tokens.split(",")]:
        x, idx, w, kw = call_inputs(common, dev, T)
        H = x.shape[1]
        pair = fp8.quantize(x, 128)
        probe = mok.Buffer(None, **kw)
        rows = probe.dispatch(x, idx, w).src_rank.shape[0]
        probe.destroy()
        buf = mok.Buffer(None, max_recv_tokens=rows + 8, **kw)
        backend = buf._backend_for(x)
        packed = fp8.pack(*pair)
        pair_rows = fp8.dispatch_rows(*pair)

        def torch_pack(x_fp8, scales):
            """fp8.pack's torch-copy fallback (no library launch), for the chain variants."""
            sb = scales.view(torch.uint8)
            o = torch.empty_like(packed)
            o[:, :H].copy_(x_fp8.view(torch.uint8))
            o[:, H:H + sb.shape[1]].copy_(sb)
            return o
        def s24_dispatch_rows(x_fp8, scales):
            """fp8.dispatch_rows as session 24 left it (two byte views, the environment read per
            call), for item 25's A/B in one process."""
            sbv = fp8._bytes_of(scales)
            if H % 16 or sbv.shape[1] % 16 or os.environ.get("MOK_FP8_PACK") == "1":
                return fp8.pack(x_fp8, scales)
            a = fp8._bytes_of(x_fp8)
            if a.data_ptr() % 16 or sbv.data_ptr() % 16:
                raise RuntimeError("misaligned test pair")
            return fp8.PairRows(a, sbv, sbv.shape[1])
        got = buf.dispatch(pair, idx, w)
        received = got.tokens[0].as_strided((got.tokens[0].shape[0], packed.shape[1]),
                                            (packed.shape[1], 1)).view(torch.uint8)

        variants = {
            "dispatch_bf16": lambda: buf.dispatch(x, idx, w),
            "dispatch_fp8": lambda: buf.dispatch(pair, idx, w),
            "check_fp8_pair": lambda: validation.check_fp8_pair(buf, pair),
            "check_dispatch_inputs_bf16": lambda: validation.check_dispatch_inputs(
                buf, x, idx, w, check_values=False, fp8=False),
            "check_dispatch_inputs_fp8": lambda: validation.check_dispatch_inputs(
                buf, pair[0], idx, w, check_values=False, fp8=True),
            "pack": lambda: fp8.pack(*pair),
            "unpack": lambda: buf._fp8_rows(received, pair),
            "apply_bf16": lambda: DispatchFunction.apply(backend, [], x, w, idx, None),
            "apply_packed": lambda: DispatchFunction.apply(backend, [], packed, w, idx, None),
            # NOTES #57: the pair read in place (fp8.PairRows) instead of packed.
            "dispatch_rows": lambda: fp8.dispatch_rows(*pair),
            # NOTES item 25: the same with session 24's byte views and per-call environment read.
            "dispatch_rows_s24": lambda: s24_dispatch_rows(*pair),
            "apply_pair_rows": lambda: DispatchFunction.apply(backend, [], pair_rows, w, idx, None),
            # The FP8 call's steps chained, one more each: where the parts' sum and the whole differ.
            "chain_pack_apply": lambda: DispatchFunction.apply(backend, [], fp8.pack(*pair), w, idx, None),
            "chain_torch_pack_apply": lambda: DispatchFunction.apply(
                backend, [], torch_pack(*pair), w, idx, None),
            "chain_checks_pack_apply": lambda: (
                validation.check_fp8_pair(buf, pair),
                validation.check_dispatch_inputs(buf, pair[0], idx, w, check_values=False, fp8=True),
                DispatchFunction.apply(backend, [], fp8.pack(*pair), w, idx, None)),
            "chain_all_but_buffer": lambda: buf._fp8_rows(DispatchFunction.apply(
                backend, [], fp8.pack(*validation.check_fp8_pair(buf, pair)), w, idx, None)[0], pair),
        }
        for fn in variants.values():
            for _ in range(a.warmup):
                fn()
        stream.synchronize()
        calls, per_block = alternating_blocks(variants, a.blocks, a.per_block, stream.synchronize)
        case = {"tokens": T, "rows": rows,
                "host_us": {n: median_us(c["host"]) for n, c in calls.items()},
                "block_medians_us": {n: [round(v * 1e6, 2) for v in b] for n, b in per_block.items()},
                "paired_fp8_minus_bf16_us": round(statistics.median(
                    f - b for b, f in zip(per_block["dispatch_bf16"], per_block["dispatch_fp8"])) * 1e6, 2),
                "profiles": {}}
        for name in ("dispatch_bf16", "dispatch_fp8"):
            prof = cProfile.Profile()
            fn = variants[name]
            for _ in range(a.profile_calls):
                prof.enable()
                fn()
                prof.disable()
                stream.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
            case["profiles"][name] = s.getvalue().splitlines()
        buf.check_errors()
        buf.destroy()
        out["cases"].append(case)
        print(f"T={T} rows={rows}: host us until return (median over {a.blocks} x {a.per_block} calls)")
        for n, v in case["host_us"].items():
            print(f"  {n:28s} {v:8.2f}")
        print(f"  paired FP8 - bf16 dispatch     {case['paired_fp8_minus_bf16_us']:8.2f}")
        for name, lines in case["profiles"].items():
            print(f"--- cProfile {name}, {a.profile_calls} calls, top by own time")
            print("\n".join(lines[:40]))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_host.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {os.path.join(a.out, 'fp8_host.json')}")


if __name__ == "__main__":
    main()

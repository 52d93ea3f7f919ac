"""Where a small call's host time goes, layer by layer, on ONE GPU (world size 1), without a
profiler (benchmarks/NOTES.md item 72).

    python scripts/profile_host_layers.py --out DIR [--tokens 128,512] [--blocks 40] [--calls 2000]

For a static-shape Buffer (``max_recv_tokens`` = the rows + 8: no host read, so every layer is
pure host work) it times, in one process and in alternating blocks (``profile_host_calls.py``'s
``alternating_blocks``: this host's speed drifts), each layer of a dispatch and of a combine
called on its own, outermost first:

- ``buffer``: ``Buffer.dispatch`` / ``Buffer.combine`` (everything a user's call costs);
- ``function``: ``DispatchFunction.apply`` / ``CombineFunction.apply`` on the backend (without
  the Buffer's checks and result object); ``x`` and ``topk_weights`` require gradients, as in
  training, so each call records its autograd node;
- ``backend``: ``CudaBackend.dispatch`` / ``combine`` (without autograd);
- ``library``: the library call alone (``mok_dispatch_launch`` with every step / ``mok_combine``)
  with the arguments the backend passed it in one real call, kept (``library_args``): ctypes'
  conversion plus the launches the library issues;
- ``library_nopdl``: the same on a Buffer made with ``MOK_PDL=0`` (plain launches);
- ``checks``: ``validation.check_dispatch_inputs`` / ``check_combine_inputs`` alone;
- ``buffer_kept``: ``buffer`` with the call's result kept until the sync after the timed part.
  Every other figure (and ``profile_host_calls.py``'s host columns) includes freeing the call's
  own outputs, which the timed call drops before the clock stops; ``buffer`` minus
  ``buffer_kept`` is that free (item 74);
- ``buffer_py`` / ``backend_py``: ``buffer`` and ``backend`` with the C++ host ops off
  (``host_ops = None``: the Python path; item 75), so ``buffer_py`` minus ``buffer`` is what
  the op saves a call (without the op built, the two are the same path);
- ``buffer_nograd`` / ``function_nograd``: ``buffer`` and ``function`` under ``torch.no_grad()``
  (evaluation, inference): a Buffer call that needs no gradient calls the backend without its
  Function (item 73), so ``buffer_nograd`` minus ``backend`` is the Buffer's own cost there,
  and ``function_nograd`` minus ``backend`` what the Function cost such calls before.

The backward's two calls (item 77), at the backend layer, with the op and without (``_py``):
``cached_backend`` (``CudaBackend.dispatch_cached`` of a gradient of y: the combine's backward)
and ``gradcombine_backend`` (``CudaBackend.combine`` with prob gradients: the dispatch's
backward). And a training step's pair at the Buffer level, ``roundtrip_buffer`` /
``roundtrip_buffer_py``: ``Buffer.dispatch``, ``Buffer.combine``, then ``torch.autograd.grad``
of ``(y, probs)`` into ``(x, topk_weights)`` (the two backward calls and autograd's own work),
so ``roundtrip_buffer_py`` minus ``roundtrip_buffer`` is what the ops save one layer's
dispatch and combine, forward and backward; ``forward_buffer`` / ``forward_buffer_py`` are the
same pair without the backward (its graph recorded, then dropped), so ``roundtrip`` minus
``forward`` is the backward's host time (``backward_us_*``, paired by block) and the ops' saving
splits into forward and backward. (s43-3, s43-5: the step saved ~1.9x what its layers save
when timed one by one; s44-1: the rest lies in the backward, and grows with the tokens.)

Then every layer once more, each call made while the GPU still has ``--busy-ms`` of queued
work (``busy_device_probe``): ``busy_host_<layer>_us``, and ``waits_for_device`` lists the
layers whose calls took more than half of it (they wait for the device somewhere inside).

Each figure is the median host time to return (a stream sync after each call, outside the
timed part); the difference between two layers is what the outer one adds. The library-only
calls reuse one set of outputs (each call is a whole dispatch: layout, fill, transfer).
``--profile N``: also N calls each of ``Buffer.dispatch`` and ``Buffer.combine`` (with
gradients) under cProfile per token count, functions by own time into
``profile_<T>.txt`` (cProfile inflates Python-heavy parts: read the ranking, not the times).
Writes ``host_layers.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Results of the ``*_kept`` layers, freed by the sync after each call (outside the timed part).
KEPT: list = []

# (op, outer, inner): what layer ``{op}_{outer}`` adds over ``{op}_{inner}`` (``adds_*`` figures).
ADDS = [(op, outer, inner) for op in ("dispatch", "combine")
        for outer, inner in (("buffer", "function"), ("function", "backend"), ("backend", "library"),
                             ("library", "library_nopdl"), ("buffer_nograd", "backend"),
                             ("function_nograd", "backend"), ("buffer", "buffer_nograd"),
                             ("buffer", "buffer_kept"), ("buffer_py", "buffer"), ("backend_py", "backend"))]
ADDS += [("cached", "backend_py", "backend"), ("gradcombine", "backend_py", "backend"),
         ("roundtrip", "buffer_py", "buffer"), ("forward", "buffer_py", "buffer")]


def library_args(backend, name: str, call):
    """``(args, result)``: ``call()`` run once, and the arguments ``backend`` passed to its
    library function ``name`` in it (the backend's own assembly, not a copy of it). ``result``
    holds the tensors those pointers address: keep it while the arguments are used."""
    real, seen = backend.lib, {}

    class Recording:
        def __getattr__(self, attr):
            fn = getattr(real, attr)
            if attr != name:
                return fn

            def record(*args):
                seen["args"] = args
                return fn(*args)
            return record

    # The C++ host ops call the library by address, past this recorder: off while recording.
    backend.lib, ops, backend.host_ops = Recording(), backend.host_ops, None
    try:
        result = call()
    finally:
        backend.lib, backend.host_ops = real, ops
    return seen["args"], result


def layer_calls(mok, torch, common, phc, dev, T):
    """``(calls, buffers, rows, host_ops)``: name -> call of every layer at T tokens, the Buffers
    to destroy afterwards, the rows of a call, and whether the C++ host ops are on."""
    from megatron_mok import validation
    from megatron_mok.autograd.functions import CombineFunction, DispatchFunction

    x, idx, w, kw = phc.call_inputs(common, dev, T)
    # As in training: the tokens and the router weights require gradients (autograd records
    # each call's node; the graphs are dropped unused).
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    probe = mok.Buffer(None, **kw)
    rows = probe.dispatch(x, idx, w).tokens.shape[0]
    probe.destroy()
    bufs = {}
    for name, env in (("pdl", {}), ("nopdl", {"MOK_PDL": "0"})):
        with common.with_env(env):
            bufs[name] = mok.Buffer(None, max_recv_tokens=rows + 8, **kw)
    buf = bufs["pdl"]
    impl = buf._get_backend("cuda")
    res = buf.dispatch(x, idx, w)
    handle, tokens = res.handle, res.tokens

    def python_path(fn):
        def call():
            ops, impl.host_ops = impl.host_ops, None
            try:
                return fn()
            finally:
                impl.host_ops = ops
        return call

    def nograd(fn):
        def call():
            with torch.no_grad():
                return fn()
        return call

    calls = {
        "dispatch_buffer": lambda: buf.dispatch(x, idx, w),
        "dispatch_buffer_kept": lambda: KEPT.append(buf.dispatch(x, idx, w)),
        "combine_buffer_kept": lambda: KEPT.append(buf.combine(tokens, handle)),
        "dispatch_function": lambda: DispatchFunction.apply(impl, [], x, w, idx, None, None),
        "dispatch_backend": lambda: impl.dispatch(x, idx, w),
        "dispatch_checks": lambda: validation.check_dispatch_inputs(buf, x, idx, w, check_values=False),
        "combine_buffer": lambda: buf.combine(tokens, handle),
        "combine_function": lambda: CombineFunction.apply(impl, handle, tokens),
        "combine_backend": lambda: impl.combine(tokens, handle),
        "combine_checks": lambda: validation.check_combine_inputs(buf, tokens, handle),
        "dispatch_buffer_py": python_path(lambda: buf.dispatch(x, idx, w)),
        "dispatch_backend_py": python_path(lambda: impl.dispatch(x, idx, w)),
        "combine_buffer_py": python_path(lambda: buf.combine(tokens, handle)),
        "combine_backend_py": python_path(lambda: impl.combine(tokens, handle)),
        "dispatch_buffer_nograd": nograd(lambda: buf.dispatch(x, idx, w)),
        "dispatch_function_nograd": nograd(lambda: DispatchFunction.apply(impl, [], x, w, idx, None, None)),
        "combine_buffer_nograd": nograd(lambda: buf.combine(tokens, handle)),
        "combine_function_nograd": nograd(lambda: CombineFunction.apply(impl, handle, tokens)),
    }
    # The backward's calls (item 77): a gradient of y [T, H], the prob gradients [rows].
    grad_y = torch.randn(T, x.shape[1], device=dev).to(x.dtype)
    grad_probs = torch.rand(tokens.shape[0], device=dev)

    def forward():
        r = buf.dispatch(x, idx, w)
        return buf.combine(r.tokens, r.handle), r.probs

    def roundtrip():
        return torch.autograd.grad(forward(), (x, w), (grad_y, grad_probs))

    calls.update({
        "cached_backend": lambda: impl.dispatch_cached(grad_y, handle),
        "cached_backend_py": python_path(lambda: impl.dispatch_cached(grad_y, handle)),
        "gradcombine_backend": lambda: impl.combine(tokens, handle, grad_probs=grad_probs),
        "gradcombine_backend_py": python_path(lambda: impl.combine(tokens, handle, grad_probs=grad_probs)),
        "roundtrip_buffer": roundtrip,
        "roundtrip_buffer_py": python_path(roundtrip),
        "forward_buffer": forward,
        "forward_buffer_py": python_path(forward),
    })
    for name, b in bufs.items():
        be = b._get_backend("cuda")
        d_args, r = library_args(be, "mok_dispatch_launch", lambda b=b: b.dispatch(x, idx, w))
        c_args, y = library_args(be, "mok_combine", lambda b=b, r=r: b.combine(r.tokens, r.handle))
        suffix = "" if name == "pdl" else "_nopdl"
        keep = (r, y)
        calls[f"dispatch_library{suffix}"] = (lambda be=be, a=d_args, keep=keep: be._check(be.lib.mok_dispatch_launch(*a)))
        calls[f"combine_library{suffix}"] = (lambda be=be, a=c_args, keep=keep: be._check(be.lib.mok_combine(*a)))
    # Whether the C++ host ops are in use (else the *_py layers are the same path as the others).
    return calls, list(bufs.values()), rows, host_ops_state(impl)


def host_ops_state(impl) -> str:
    from megatron_mok.cuda import host_ops
    return "on" if impl.host_ops is not None else f"off ({host_ops.why_not()})"


def busy_device_probe(torch, phc, calls, sync, busy_ms=2.0, reps=7):
    """name -> median host time (us) of each call made while the GPU still has ``busy_ms`` of
    queued work (a ``torch.cuda._sleep`` kernel on the call's stream, queued right before it).
    A call that returns in microseconds never waits for the device; one that takes ~``busy_ms``
    or more does (a host read, a device-wide or stream sync somewhere inside it). The step's
    backward saved far more than its layers (item 77, s44-1: -115 us at 512 tokens against
    -24), growing with the tokens: this tells whether the Python path waits for the GPU there."""
    import time
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(1_000_000 * busy_ms / max(start.elapsed_time(end), 1e-3))
    out = {}
    for name, fn in calls.items():
        took = []
        for _ in range(reps):
            sync()
            torch.cuda._sleep(cycles)
            t0 = time.perf_counter()
            fn()
            took.append(time.perf_counter() - t0)
        sync()
        out[name] = phc.median_us(took)
    return out


def profile_calls(calls, n, sync, path):
    """``n`` calls of ``dispatch_buffer`` then of ``combine_buffer`` under cProfile (a stream sync
    after each, as in the timed blocks), functions by own time, then cumulative, into ``path``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for name in ("dispatch_buffer", "combine_buffer"):
        fn = calls[name]
        for _ in range(n):
            prof.enable()
            fn()
            prof.disable()
            sync()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        text.write(f"==== by {key}\n")
        pstats.Stats(prof, stream=text).strip_dirs().sort_stats(key).print_stats(40)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text.getvalue())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--calls", type=int, default=2000, help="calls per layer, over all blocks")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--busy-ms", type=float, default=2.0,
                    help="GPU work queued before each call of the device-wait probe")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also N Buffer calls of each op under cProfile per token count")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(_ROOT, "scripts"))
    import profile_host_calls as phc  # noqa: E402  (standard library only at import)
    common, torch, dev = phc.one_gpu_setup("profile_host_layers.py")

    import megatron_mok as mok  # noqa: E402
    stream = torch.cuda.current_stream(dev)

    def sync():
        stream.synchronize()
        KEPT.clear()
    from megatron_mok.cuda import library
    probes = phc.process_probes(torch, dev, library.get())
    print("process probes (us): " + ", ".join(f"{k} {v}" for k, v in probes.items()), flush=True)
    cases = []
    for T in (int(v) for v in a.tokens.split(",")):
        calls, bufs, rows, ops_state = layer_calls(mok, torch, common, phc, dev, T)
        print(f"T={T}: C++ host ops {ops_state}", flush=True)
        for fn in calls.values():
            for _ in range(a.warmup):
                fn()
        sync()
        per_block = max(1, a.calls // a.blocks)
        timed, blocks = phc.alternating_blocks(calls, a.blocks, per_block, sync)
        case = {"tokens": T, "rows": rows, "blocks": a.blocks, "per_block": per_block,
                "host_ops": ops_state}
        for n, c in timed.items():
            case[f"host_{n}_us"] = phc.median_us(c["host"])
        # What each layer adds, paired by block (the drift taken out).
        for op, outer, inner in ADDS:
            case[f"adds_{op}_{outer}_over_{inner}_us"] = phc.paired_change_us(
                blocks, f"{op}_{inner}", f"{op}_{outer}")
        for variant in ("buffer", "buffer_py"):     # the backward alone: the step minus its forward
            case[f"backward_us_{variant}"] = phc.paired_change_us(
                blocks, f"forward_{variant}", f"roundtrip_{variant}")
        busy = busy_device_probe(torch, phc, calls, sync, a.busy_ms)
        case["busy_ms"] = a.busy_ms
        case.update({f"busy_host_{n}_us": v for n, v in busy.items()})
        waits = sorted(n for n, v in busy.items() if v > 500 * a.busy_ms)
        case["waits_for_device"] = waits
        print(f"T={T}: calls that waited for {a.busy_ms} ms of queued GPU work: "
              f"{', '.join(waits) or 'none'}", flush=True)
        if a.profile:
            profile_calls(calls, a.profile, sync, os.path.join(a.out, f"profile_{T}.txt"))
        for b in bufs:
            b.check_errors()
            b.destroy()
        cases.append(case)
        print(f"T={T} rows={rows}")
        for k, v in case.items():
            if k.endswith("_us"):
                print(f"  {k} {v}")
        sys.stdout.flush()
    info = common.env_info(sys.argv, a.commit, 1, "none")
    info.update(blocks=a.blocks, calls=a.calls, note="world size 1 on one GPU, static-shape Buffers: host time per layer")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "host_layers.json")
    common.write_json(path, {"schema": "mok-host-layers/1", "env": info, "probes": probes, "cases": cases})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Host cost of small calls at world size 1, and graph replays timed with and without the
graph's own launch, on ONE GPU.

    python scripts/profile_host_calls.py --out DIR [--tokens 128,512] [--calls 200]
                                         [--root CHECKOUT] [--tag NAME] [--commit C]
    python scripts/profile_host_calls.py --out DIR --ab [--blocks 20] [--calls 400] ...
    torchrun --nproc-per-node 2 scripts/profile_host_calls.py --out DIR --ab ...   (2 GPUs)

``--root`` imports ``megatron_mok`` from another checkout (with its own built library): a
same-machine A/B of two trees' host paths, one process each, run alternately by the caller
(``scripts/device_runs/s14_host_calls_1gpu.sh``). Per token count, with the Buffer's default
SM budget (no ``num_sms``), an eager Buffer and a static-shape one (``max_recv_tokens`` = the
rows + 8), it measures, each the median over ``--calls`` calls after warm-up:

- ``host_<mode>_<op>_us``: the time the Python call takes to return (the host's share: its
  launches are queued, not waited for; an eager dispatch includes its one read of R), with
  a stream sync after each call, outside the timed part. It includes freeing the call's own
  outputs, which the timed call drops before the clock stops (~4 us per dispatch, ~1 per
  combine on one H200's host: ``profile_host_layers.py``'s ``buffer_kept``, NOTES item 74);
- ``latency_<mode>_<op>_us``: call start to stream synchronised (what a lone call costs);
- ``loop_<mode>_pair_us``: wall time per dispatch + combine pair over ``--calls`` pairs back
  to back, one sync at the end (the rate a host-bound loop reaches);
- ``graph_<op>_us`` / ``graph_busy_<op>_us``: one static call captured in a CUDA graph and
  replayed between CUDA events, first on an idle GPU (the start event then also counts the
  host's graph launch, as ``bench_small_batch.py --worlds 1`` and ``profile_graph_chain.py``'s
  single-call columns do), then with the GPU held busy by a sleep kernel queued before the
  start event, so that the launch is hidden and only device time is counted.

``--ab`` instead compares, in one process, a dispatch queued by one library call (#51) with
the same dispatch's launches issued one call each (the backend's ``separate_launches``), eager
and static, one Buffer per variant, in ``--blocks`` alternating blocks: this machine's host
speed drifts by up to 2x between and within processes (run s14-2's process probes), which
swamps a one-process-per-tree A/B; ``paired_change_<variant>_vs_<base>_us`` is the median
over blocks of the variant's block median minus its mode's first variant's (run s14-4, which
printed the one-call minus the separate variant as ``paired_change_<mode>_dispatch_us``).
``--ab --settings "A=1;B=0;"`` compares eager Buffers made under those environment settings
(the first is the base of every paired change). Under torchrun (``--ab`` only) every rank runs
the same blocks in the same order and the slowest rank's figures are reported.

Writes ``host_calls.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H, E, K = 7168, 256, 8


def one_gpu_setup(tool: str):
    """``(common, torch, device)`` for a one-GPU host-time tool (this one, ``profile_host_layers.py``,
    ``profile_fp8_host.py``): ``benchmarks/``, ``scripts/`` and the checkout on ``sys.path``,
    ``benchmarks/common.py`` imported before torch (it sets the no-multicast environment), and
    an exit naming ``tool`` where no CUDA GPU is."""
    for p in (os.path.join(_ROOT, "benchmarks"), os.path.join(_ROOT, "scripts"), _ROOT):
        if p not in sys.path:
            sys.path.insert(0, p)
    import common
    import torch
    if not torch.cuda.is_available():
        sys.exit(f"{tool} needs a CUDA GPU")
    return common, torch, torch.device("cuda", torch.cuda.current_device())


def median_us(samples) -> float:
    """Median of ``samples`` (seconds) in microseconds, 2 decimals."""
    return round(statistics.median(samples) * 1e6, 2)


def host_and_latency(fn, calls, sync):
    """(host seconds per call, latency seconds per call) lists: ``fn()`` timed to its return,
    and to ``sync()`` after it."""
    host, lat = [], []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        lat.append(t2 - t0)
    return host, lat


def loop_time(fn, calls, sync) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn`` with one sync at the end."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls


def process_probes(torch, dev, lib, n=2000):
    """Host speed of this process on work that is the same in every tree (medians of 9 runs,
    us per item): a pure-Python loop, a ctypes call that returns at once
    (``mok_abi_version``), one into the CUDA runtime (``mok_sm_count``: an attribute query)
    and a ``torch.empty`` on the GPU. Two processes that differ here differ in the machine's
    state, not in the code under test."""
    out = {}

    def py():
        acc = 0
        for i in range(100):
            acc += i * i
        return acc

    for name, fn in (("python_loop100", py), ("ctypes_return", lib.mok_abi_version),
                     ("ctypes_cuda_attribute", lambda: lib.mok_sm_count(0)),
                     ("torch_empty", lambda: torch.empty(256, device=dev))):
        runs = []
        for _ in range(9):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n)
        out[name] = median_us(runs)
    return out


def alternating_blocks(variants, blocks, per_block, sync):
    """Same-process A/B of host paths on a host whose speed drifts (run s14-2: a fixed Python
    loop took 2.9-6.9 us from one process to the next, and moved within processes too).
    ``variants``: name -> call. In each of ``blocks`` blocks every variant makes ``per_block``
    calls (``host_and_latency``), the order rotating from block to block, so a drift hits
    all alike. Returns name -> {"host": [...], "latency": [...]} (seconds, every call) and
    name -> [median host seconds per block] for paired comparisons."""
    names = list(variants)
    calls = {n: {"host": [], "latency": []} for n in names}
    per_block_host = {n: [] for n in names}
    for b in range(blocks):
        for n in names[b % len(names):] + names[:b % len(names)]:
            host, lat = host_and_latency(variants[n], per_block, sync)
            calls[n]["host"] += host
            calls[n]["latency"] += lat
            per_block_host[n].append(statistics.median(host))
    return calls, per_block_host


def paired_change_us(per_block_host, base, new) -> float:
    """Median over blocks of (new - base) block medians, in us: the change with the drift that
    both saw in the same block taken out."""
    return round(statistics.median(n - b for b, n in zip(per_block_host[base], per_block_host[new])) * 1e6, 2)


def call_inputs(common, dev, T, rank=0, world=1):
    """(x, topk_idx, topk_weights, Buffer keywords) of this rank's T-token call: the benchmark
    suite's routing and tokens for that size (same seeds as the other tools)."""
    shape = common.Shape(f"t{T}", T, H, experts=E, topk=K, seed=1237 + T)
    idx, w = common.make_routing(shape, rank, world, dev)
    x = common.make_x(shape, rank, dev)
    return x, idx, w, dict(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T, backend="cuda")


def ab_variants(settings, parse_settings, settings_label):
    """(name, mode, environment, separate launches) of every variant of an ``--ab`` run.
    No ``settings``: #51 against its separate launches, eager and static (``<mode>_one_call``,
    ``<mode>_separate``). ``settings`` (``"A=1;B=0;"``, as ``profile_graph_chain.py``): one eager
    Buffer per setting, named ``eager[<label>]``, e.g. the opt-in eager schedules against the
    default."""
    if not settings:
        return [(f"{m}_{l}", m, {}, l == "separate") for m in ("eager", "static")
                for l in ("one_call", "separate")]
    return [(f"eager[{settings_label(env)}]", "eager", env, False) for env in parse_settings(settings)]


def ab_case(mok, common, torch, dev, T, blocks, per_block, warmup, sync, settings="", rank=0, world=1):
    """Host paths side by side in one process (``ab_variants``), each with its own Buffer,
    alternating blocks. Paired changes: each variant against the first of its mode. Under
    torchrun every rank runs the same variants in the same order (each call is collective), and
    the static Buffers are sized by the largest rank's rows."""
    x, idx, w, kw = call_inputs(common, dev, T, rank, world)
    probe = mok.Buffer(None, **kw)
    rows = probe.dispatch(x, idx, w).tokens.shape[0]
    probe.destroy()
    if torch.distributed.is_initialized():
        most = torch.tensor([rows], device=dev)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        rows = int(most.item())
    bufs, variants, first_of = [], {}, {}
    for name, mode, env, separate in ab_variants(settings, common.parse_settings, common.settings_label):
        with common.with_env(env):
            buf = mok.Buffer(None, **kw, **({"max_recv_tokens": rows + 8} if mode == "static" else {}))
        buf._get_backend("cuda").separate_launches = separate
        bufs.append(buf)
        for _ in range(warmup):
            r = buf.dispatch(x, idx, w)
            buf.combine(r.tokens, r.handle)
        variants[name] = (lambda buf=buf: buf.dispatch(x, idx, w))
        first_of.setdefault(mode, name)
    calls, per_block = alternating_blocks(variants, blocks, per_block, sync)
    case = {"tokens": T, "rows": rows, "blocks": blocks, "per_block": len(calls[next(iter(calls))]["host"]) // blocks}
    for n, c in calls.items():
        case[f"host_{n}_dispatch_us"] = median_us(c["host"])
        case[f"latency_{n}_dispatch_us"] = median_us(c["latency"])
    for name, mode, _, _ in ab_variants(settings, common.parse_settings, common.settings_label):
        if name != first_of[mode]:
            case[f"paired_change_{name}_vs_{first_of[mode]}_us"] = paired_change_us(per_block, first_of[mode], name)
    for b in bufs:
        b.check_errors()
        b.destroy()
    return case


def gather_objects(torch, obj, world):
    out = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def merge_ranks(per_rank):
    """One case from every rank's: each ``*_us`` value is the largest over the ranks (the
    slowest rank's time, the suite's rule; for a paired change, the smallest gain), and
    ``per_rank`` keeps them all."""
    merged = {k: v for k, v in per_rank[0].items() if not k.endswith("_us")}
    for k in per_rank[0]:
        if k.endswith("_us"):
            merged[k] = max(c[k] for c in per_rank)
    merged["per_rank"] = per_rank
    return merged


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--root", default=_ROOT, help="checkout to import megatron_mok from")
    ap.add_argument("--tag", default="", help="label of this run in the JSON (e.g. base / new)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--ab", action="store_true",
                    help="instead: one call per dispatch (#51) against separate launches, in this "
                         "process, --blocks alternating blocks of --calls / --blocks calls")
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--settings", default="",
                    help="with --ab: eager Buffers under these environment settings instead "
                         "(';'-separated, each ','-separated VAR=value; empty item = defaults)")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
    sys.path.insert(0, os.path.abspath(a.root))
    import common  # noqa: E402  (the no-multicast environment before torch loads)
    import torch  # noqa: E402

    import megatron_mok as mok  # noqa: E402
    if not torch.cuda.is_available():
        sys.exit("profile_host_calls.py needs a CUDA GPU")
    print(f"megatron_mok from {os.path.dirname(mok.__file__)}", flush=True)
    rank, world, distributed = 0, 1, "RANK" in os.environ
    if distributed:   # torchrun: one rank per GPU, --ab only
        if not a.ab:
            sys.exit("under torchrun, profile_host_calls.py runs --ab only (the other columns are "
                     "world-size-1 measures)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("nccl")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream(dev)
    sync = stream.synchronize
    from megatron_mok.cuda import library
    probes = process_probes(torch, dev, library.get())
    print("process probes (us): " + ", ".join(f"{k} {v}" for k, v in probes.items()), flush=True)
    cases = []
    for T in (int(v) for v in a.tokens.split(",") if a.ab):
        case = ab_case(mok, common, torch, dev, T, a.blocks, max(1, a.calls // a.blocks), a.warmup, sync,
                       a.settings, rank, world)
        if distributed:
            case = merge_ranks(gather_objects(torch, case, world))
        cases.append(case)
        if rank == 0:
            print(f"T={T} rows={case['rows']} " + ", ".join(
                f"{k} {v}" for k, v in case.items() if k.endswith("_us")), flush=True)
    for T in (int(v) for v in a.tokens.split(",") if not a.ab):
        x, idx, w, kw = call_inputs(common, dev, T)
        eager = mok.Buffer(None, **kw)
        rows = eager.dispatch(x, idx, w).tokens.shape[0]
        static = mok.Buffer(None, max_recv_tokens=rows + 8, **kw)
        case = {"tokens": T, "rows": rows}
        for mode, buf in (("eager", eager), ("static", static)):
            res = buf.dispatch(x, idx, w)

            def d(buf=buf):
                return buf.dispatch(x, idx, w)

            def c(buf=buf, res=res):
                return buf.combine(res.tokens, res.handle)

            def pair(buf=buf):
                r = buf.dispatch(x, idx, w)
                buf.combine(r.tokens, r.handle)

            for _ in range(a.warmup):
                pair()
            for op, fn in (("dispatch", d), ("combine", c)):
                host, lat = host_and_latency(fn, a.calls, sync)
                case[f"host_{mode}_{op}_us"] = median_us(host)
                case[f"latency_{mode}_{op}_us"] = median_us(lat)
            case[f"loop_{mode}_pair_us"] = round(loop_time(pair, a.calls, sync) * 1e6, 2)
        gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        sync()
        with torch.cuda.graph(gd):
            gres = static.dispatch(x, idx, w)
        with torch.cuda.graph(gc):
            static.combine(gres.tokens, gres.handle)
        for name, g in (("dispatch", gd), ("combine", gc)):
            for busy in (False, True):
                samples = []
                for i in range(a.warmup + a.calls):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    if busy:
                        torch.cuda._sleep(common.BUSY_CYCLES)
                    s.record(stream)
                    g.replay()
                    e.record(stream)
                    e.synchronize()
                    if i >= a.warmup:
                        samples.append(s.elapsed_time(e) * 1e-3)
                case[f"graph_{'busy_' if busy else ''}{name}_us"] = median_us(samples)
        static.check_errors()
        for b in (eager, static):
            b.destroy()
        cases.append(case)
        print(f"T={T} rows={rows} " + ", ".join(f"{k} {v}" for k, v in case.items()
                                                  if k.endswith("_us")), flush=True)
    if rank != 0:
        torch.distributed.destroy_process_group()
        return
    info = common.env_info(sys.argv, a.commit, world, "nccl" if distributed else "none")
    info.update(tag=a.tag, root=os.path.abspath(a.root), calls=a.calls, warmup=a.warmup, hidden=H,
                experts=E, topk=K, note="world size 1 on one GPU: host-side times and graph replays")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "host_calls.json")
    common.write_json(path, {"schema": "mok-host-calls/1", "env": info, "probes": probes, "cases": cases})
    print(f"wrote {path}")
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

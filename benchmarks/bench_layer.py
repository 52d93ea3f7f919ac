"""Megatron ``MoELayer`` forward + backward with each dispatcher, same experts, same input.

    torchrun --nproc-per-node 2 benchmarks/bench_layer.py --tokens 4096 --hidden 2048
    torchrun --nproc-per-node 2 benchmarks/bench_layer.py --tiny        # CPU / gloo smoke
    torchrun --nproc-per-node 2 benchmarks/bench_layer.py --shared-ffn 2048 \
        --dispatchers alltoall,alltoall:overlap,mok,mok:overlap         # + a shared expert
    torchrun --nproc-per-node 2 benchmarks/bench_layer.py --etp 2       # expert TP (EP = 1)

Dispatchers: ``alltoall``, ``flex`` (only when ``deep_ep`` imports; ``flex:hybridep`` and
``flex:ncclep`` select Megatron's other flex backends, DeepEP's HybridEP and TE's NCCL EP, and
``flex:sms=N`` its SM budget; plain ``flex`` ran with a DeepEP built beside the project, runs
s4-3 and s4-4, but these three variants have not run: HybridEP and TE were never built on our
GPU machine) and ``mok``; a name with
``:overlap`` runs that dispatcher with ``moe_shared_expert_overlap`` (needs ``--shared-ffn``:
the shared expert on its own stream beside the dispatch and the combine), and ``mok:high`` /
``mok:overlap:high`` run MoK's kernels on a high-priority stream (``MOK_COMM_STREAM=high``
for that layer); ``mok:sms=N`` gives that layer's MoK kernels N SMs (``MOK_NUM_SMS``; plain
``mok`` takes the dispatcher's default, docs/MEGATRON.md). ``:graphs`` (any dispatcher, CUDA
only) runs that layer under Megatron's own partial CUDA graphs (``cuda_graph_impl="local"``,
scopes ``moe_router`` + ``moe_preprocess``: router and dispatch preprocess replayed, the rest
eager); with any ``:graphs`` variant every layer is a ``MoETransformerLayer`` (attention + MoE,
no dropout) instead of a bare ``MoELayer``, so graphed and eager layers differ only in the
graphs, and the first interleaved round records, ``create_cudagraphs()`` follows it (a warm-up
round). Every layer
gets the same router / expert weights (Megatron's local ``SequentialMLP`` experts) and the
same per-rank input. Each timed iteration is one forward + backward of the layer; time is
CUDA events on GPU (``perf_counter`` on CPU), median over ``--iters`` (>= 20) iterations after
``--warmup``, the dispatchers' iterations interleaved (one of each in turn; ``--sequential``:
one dispatcher after the other); the reported number is the slowest rank's median
(all_reduce MAX). One JSON per run goes to ``benchmarks/results/`` with the date, git
commit, GPU model and count, and the exact command.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dispatchers", default="alltoall,flex,mok")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn-hidden", type=int, default=1024)
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--shared-ffn", type=int, default=0,
                   help="a shared expert of this FFN size in every layer (0: none)")
    p.add_argument("--drop-and-pad", type=float, default=None, metavar="CF",
                   help="every layer with moe_expert_capacity_factor=CF and "
                        "moe_pad_expert_input_to_capacity (Megatron's drop-and-pad)")
    p.add_argument("--etp", type=int, default=1,
                   help="expert tensor parallelism: EP = world size / ETP (each expert split "
                        "over ETP ranks; no MoE biases)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tiny", action="store_true",
                   help="toy sizes for CPU smoke runs (tokens 64, hidden 32, experts 4)")
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--tag", default="")
    p.add_argument("--sequential", action="store_true",
                   help="time each dispatcher's iterations in one block (default: interleaved, "
                        "one iteration of each in turn)")
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.hidden, args.ffn_hidden, args.num_experts, args.topk = 64, 32, 64, 4, 2
    if args.iters < 20:
        p.error("--iters must be >= 20")
    if args.etp < 1 or args.ffn_hidden % args.etp:
        p.error(f"--etp {args.etp}: a positive divisor of --ffn-hidden ({args.ffn_hidden})")
    variants = [dispatcher_variant(d) for d in args.dispatchers.split(",") if d]
    if any(v is None for v in variants):
        p.error(f"--dispatchers {args.dispatchers!r}: each is NAME or NAME:overlap, and mok "
                "also takes :high and :sms=N (e.g. mok:overlap:high, mok:sms=24)")
    if any("overlap" in modes for _, modes in variants) and args.shared_ffn <= 0:
        p.error("':overlap' dispatchers overlap a shared expert: give --shared-ffn")
    if any("graphs" in modes for _, modes in variants):
        if args.warmup < 2:
            p.error("':graphs' needs --warmup >= 2 (the first round records the graphs)")
        if args.sequential:
            # Megatron's local graphs are created once per process, for every layer recorded
            # by then: a later group's layers could not be captured.
            p.error("':graphs' does not go with --sequential (one create_cudagraphs per process)")
    return args


FLEX_BACKENDS = ("deepep", "hybridep", "ncclep")   # Megatron's moe_flex_dispatcher_backend


def dispatcher_variant(d: str):
    """``"mok:overlap:high"`` -> ``("mok", {"overlap", "high"})``; ``None`` if not a variant
    this script knows. Any dispatcher's modes: ``overlap``, ``graphs``; MoK's own: ``high``
    (``MOK_COMM_STREAM=high``) and ``sms=N`` (``MOK_NUM_SMS=N``, N > 0); flex's own: one backend
    (``hybridep``, ``ncclep``; none: ``deepep``) and ``sms=N`` (Megatron's flex SM budget), each
    for that layer only."""
    name, *modes = d.split(":")
    modes = set(modes)
    own_of = {"mok": {m for m in modes if m == "high" or m.startswith("sms=")},
              "flex": {m for m in modes if m in FLEX_BACKENDS[1:] or m.startswith("sms=")}}
    own = own_of.get(name, set())
    if not modes - own <= {"overlap", "graphs"}:
        return None
    if any(m.startswith("sms=") and not (m[4:].isdigit() and int(m[4:]) > 0) for m in own):
        return None
    if len(modes & set(FLEX_BACKENDS[1:])) > 1:
        return None
    return name, modes


def variant_num_sms(modes):
    """The ``N`` of a ``sms=N`` mode, ``None`` without one."""
    return next((int(m[4:]) for m in modes if m.startswith("sms=")), None)


def flex_backend(modes) -> str:
    """The flex variant's ``moe_flex_dispatcher_backend``: its backend mode, else ``deepep``."""
    return next((m for m in FLEX_BACKENDS[1:] if m in modes), "deepep")


def flex_unavailable(backend: str):
    """Why this machine cannot run the flex ``backend`` (a string), or ``None``. Only what can be
    checked without building a layer: Megatron's own checks (versions of DeepEP / TE, the GPU)
    run when the layer is built. The hybridep and ncclep paths have not run here: HybridEP and TE
    were never built on our GPU machine."""
    if backend == "ncclep":
        from megatron_mok.megatron import versions
        if versions.installed_version_tuple()[:2] < (0, 19):
            return "the ncclep backend needs megatron-core 0.19+"
        if importlib.util.find_spec("transformer_engine") is None:
            return "transformer_engine is not importable (ncclep is TE's NCCL EP)"
        return None
    if importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not importable"
    if backend == "hybridep":
        try:
            import deep_ep
        except Exception as e:  # noqa: BLE001  (an importable but broken build says why)
            return f"deep_ep does not import: {e}"
        if not hasattr(deep_ep, "HybridEPBuffer"):
            return "deep_ep has no HybridEPBuffer (DeepEP's hybrid-ep build)"
    return None


def set_flex_num_sms(cfg, backend: str, n: int) -> None:
    """A flex layer's SM budget: ``moe_flex_dispatcher_num_sms`` (0.19+), else the older
    per-backend field."""
    if hasattr(cfg, "moe_flex_dispatcher_num_sms"):
        cfg.moe_flex_dispatcher_num_sms = n
    elif backend == "hybridep":
        cfg.moe_hybridep_num_sms = n
    else:
        cfg.moe_deepep_num_sms = n


def _git_commit():
    if os.environ.get("MOK_COMMIT"):  # see benchmarks/common.py git_commit
        return os.environ["MOK_COMMIT"], False
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        commit = out.stdout.strip() or None
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return commit, bool(dirty)
    except Exception:
        return None, None


def _command():
    """The command line as typed, as far as it can be known (torchrun's flags are not)."""
    cmd = " ".join([os.path.basename(sys.executable)] + sys.argv)
    if "LOCAL_WORLD_SIZE" in os.environ:
        cmd = f"torchrun --nproc-per-node {os.environ['LOCAL_WORLD_SIZE']} " + " ".join(sys.argv)
    return cmd


def init_distributed():
    """torchrun env (RANK/WORLD_SIZE/...) or an already-initialised group; else 1 process."""
    from megatron_mok.megatron.harness import init_distributed as _init

    _init()


def _forward(layer, x):
    """The layer's output tensor: ``MoELayer`` and ``TransformerLayer`` both return a pair;
    megatron-core 0.16's graph runner wraps a replayed ``MoETransformerLayer`` output in a
    1-tuple."""
    y = layer(x)[0]
    return y[0] if isinstance(y, tuple) else y


def time_iteration(layer, x, gy, device) -> float:
    """One forward + backward of ``layer`` in seconds (CUDA events on GPU); grads cleared."""
    xx = x.detach().requires_grad_(True)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = _forward(layer, xx)
        y.backward(gy)
        end.record()
        torch.cuda.synchronize()
        dt = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        y = _forward(layer, xx)
        y.backward(gy)
        dt = time.perf_counter() - t0
    for p in layer.parameters():
        p.grad = None
    return dt


def bench_interleaved(layers, x, gy, iters, warmup, device, after_first_round=None):
    """One iteration of each layer in turn, the starting layer rotating, so a drift of the
    host's or the GPU's speed during the run (seen up to 2x on the lent machines,
    benchmarks/NOTES.md item 7) reaches every dispatcher alike (``--sequential`` passes one
    layer at a time). ``after_first_round`` (e.g. Megatron's ``create_cudagraphs``) runs once,
    after the first (warm-up) round. Returns ``{name: [seconds] * iters}``."""
    names = list(layers)
    times = {d: [] for d in names}
    for i in range(warmup + iters):
        k = i % len(names)
        for d in names[k:] + names[:k]:
            dt = time_iteration(layers[d], x, gy, device)
            if i >= warmup:
                times[d].append(dt)
        if i == 0 and after_first_round is not None:
            after_first_round()
    return times


def run(args):
    warnings.filterwarnings("ignore", category=UserWarning)
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.etp:
        raise SystemExit(f"--etp {args.etp} does not divide the world size {world}")
    ep = world // args.etp
    # A gloo group (tests, CPU runs) means CPU tensors even where a GPU is visible.
    on_gpu = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]

    import megatron_mok.megatron as mm
    from megatron_mok.megatron import harness

    mm.install()
    harness.init_parallel(ep, seed=args.seed, etp_size=args.etp)
    harness.enable_cpu_megatron(on_cpu=device.type == "cpu")

    wanted = [d for d in args.dispatchers.split(",") if d]
    skipped = {}
    for d in list(wanted):
        name, modes = dispatcher_variant(d)
        why = flex_unavailable(flex_backend(modes)) if name == "flex" else None
        if why is not None:
            skipped[d] = why
        elif name == "flex" and device.type != "cuda":
            skipped[d] = "needs CUDA"
        elif "overlap" in modes and device.type != "cuda":
            # Megatron's SharedExpertMLP makes a CUDA stream for the overlap
            skipped[d] = "the shared expert overlap needs CUDA"
        elif "graphs" in modes and device.type != "cuda":
            skipped[d] = "CUDA graphs need CUDA"
        if d in skipped:
            wanted.remove(d)

    kw = dict(num_experts=args.num_experts, topk=args.topk, hidden=args.hidden,
              ffn_hidden=args.ffn_hidden, dtype=dtype,
              moe_router_load_balancing_type="aux_loss" if device.type == "cuda" else "none",
              moe_aux_loss_coeff=1e-2 if device.type == "cuda" else 0.0)
    if args.shared_ffn > 0:
        kw["moe_shared_expert_intermediate_size"] = args.shared_ffn
    if args.drop_and_pad is not None:
        kw.update(moe_expert_capacity_factor=args.drop_and_pad, moe_pad_expert_input_to_capacity=True)
    # ':graphs' variants: every layer a MoETransformerLayer (see the module docstring).
    graphs = any("graphs" in dispatcher_variant(d)[1] for d in wanted)
    if graphs:
        kw.update(hidden_dropout=0.0, attention_dropout=0.0)
        harness.use_cudagraphable_rng(args.seed)
    g = torch.Generator().manual_seed(args.seed + rank)
    x = torch.randn(args.tokens, 1, args.hidden, generator=g).to(dtype).to(device)
    gy = torch.randn(args.tokens, 1, args.hidden, generator=g).to(dtype).to(device)

    def build(d, state):
        torch.manual_seed(args.seed)
        name, modes = dispatcher_variant(d)
        extra = {"moe_flex_dispatcher_backend": flex_backend(modes)} if name == "flex" else {}
        if "overlap" in modes:
            extra["moe_shared_expert_overlap"] = True
        if "graphs" in modes:
            extra.update(cuda_graph_impl="local",
                         **harness.graph_scope_kwargs(["moe_router", "moe_preprocess"]))
        cfg = harness.moe_config(name, ep_size=ep, expert_tensor_parallel_size=args.etp,
                                 **kw, **extra)
        if "high" in modes:
            cfg.moe_mok_comm_stream = "high"     # MOK_COMM_STREAM=high for this layer only
        n_sms = variant_num_sms(modes)
        if n_sms is not None and name == "flex":
            set_flex_num_sms(cfg, flex_backend(modes), n_sms)
        elif n_sms is not None:
            cfg.moe_mok_num_sms = n_sms   # MOK_NUM_SMS, this layer only
        if graphs:
            layer = harness.build_moe_transformer_layer(cfg, device=device, dtype=dtype)
            for p in layer.parameters():    # graphed parameters' grads go to main_grad
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        else:
            layer = harness.build_moe_layer(cfg, device=device, dtype=dtype)
        if state is not None:
            layer.load_state_dict(state)
        return layer

    results = {}

    def report_one(d, layer, times):
        med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        slowest = med.clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        moe = getattr(layer, "mlp", layer)      # MoETransformerLayer or MoELayer
        backend = getattr(moe.token_dispatcher, "backend_name", None)
        results[d] = {"median_ms_slowest_rank": slowest.item() * 1e3,
                      "median_ms_this_rank0": med.item() * 1e3,
                      "min_ms_rank0": min(times) * 1e3, "max_ms_rank0": max(times) * 1e3,
                      "iters": args.iters, "warmup": args.warmup, "mok_backend": backend}
        if rank == 0:
            print(f"{d:<16} fwd+bwd median {results[d]['median_ms_slowest_rank']:9.3f} ms "
                  f"(slowest of {world} ranks)" + (f"  [mok backend: {backend}]" if backend else ""),
                  flush=True)
        dist.barrier()

    # Interleaved: every layer alive, timed in turn; --sequential: one layer at a time.
    groups = [[d] for d in wanted] if args.sequential else [wanted]
    state = None
    for group in groups:
        layers = {}
        for d in group:
            layers[d] = build(d, state)
            state = state if state is not None else layers[d].state_dict()
        record_then_capture = None
        if graphs:      # one interleaved group (parse_args refuses --sequential)
            from megatron.core.transformer.cuda_graphs import create_cudagraphs

            record_then_capture = create_cudagraphs
        all_times = bench_interleaved(layers, x, gy, args.iters, args.warmup, device,
                                      after_first_round=record_then_capture)
        for d in group:
            report_one(d, layers.pop(d), all_times[d])

    commit, dirty = _git_commit()
    from megatron.core import package_info

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit, "dirty_tree": dirty,
        "command": _command(),
        "launcher_env": {k: os.environ[k] for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                   "NCCL_NVLS_ENABLE") if k in os.environ},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gpu_count": world if device.type == "cuda" else 0, "world_size": world,
        "backend": dist.get_backend(), "dtype": str(dtype).replace("torch.", ""),
        "shape": {"tokens_per_rank": args.tokens, "hidden": args.hidden,
                  "ffn_hidden": args.ffn_hidden, "num_experts": args.num_experts,
                  "topk": args.topk, "shared_ffn": args.shared_ffn,
                  "expert_parallel": ep, "expert_tensor_parallel": args.etp,
                  "drop_and_pad_capacity_factor": args.drop_and_pad,
                  "schedule": "sequential" if args.sequential else "interleaved",
                  "experts": "SequentialMLP (Megatron local spec)",
                  "layer": ("MoETransformerLayer (local attention, no dropout)" if graphs
                            else "MoELayer"),
                  "cuda_graphs": ("':graphs' variants: local impl, moe_router + moe_preprocess"
                                  if graphs else None)},
        "versions": {"torch": torch.__version__, "megatron_core": package_info.__version__},
        "results": results, "skipped": skipped,
    }
    path = None
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"bench_layer_{report['device'].replace(' ', '_')}_x{world}_{stamp}"
        path = os.path.join(args.out_dir, name + (f"_{args.tag}" if args.tag else "") + ".json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}", flush=True)
    if graphs:
        from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

        delete_cuda_graphs()
        harness.use_cudagraphable_rng(args.seed, on=False)
    harness.destroy_parallel()
    report["path"] = path
    return report


def main(argv=None):
    report = run(parse_args(argv))
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()

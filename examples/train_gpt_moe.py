"""A self-contained Megatron-Core GPT MoE training run on mock data.

No Megatron-LM checkout: only ``megatron-core`` (0.16.x - 0.19.x) and ``megatron_mok``.
The model is Megatron's ``GPTModel`` with the local layer spec (no TransformerEngine, no
apex: ``SequentialMLP`` experts); the dispatcher is chosen with the usual flag::

    torchrun --nproc-per-node 2 examples/train_gpt_moe.py \\
        --moe-token-dispatcher-type mok --expert-model-parallel-size 2 \\
        --train-iters 60 --output-json out/mok.json

With ``--num-microbatches N`` a step is Megatron's ``forward_backward_no_pipelining`` over N
micro-batches (on CPU the same math in a loop); ``--overlap-moe-expert-parallel-comm`` (bf16,
EP >= 2, CUDA) makes it Megatron's 1F1B EP overlap schedule, where one micro-batch's dispatch
and combine run beside another's attention and experts (``examples/run_gpu_ab.sh OUT
ab_ep_overlap`` A/Bs it).

Every rank but rank 0 prints nothing; rank 0 prints loss, time and tokens/s/GPU per step,
and writes a JSON summary. The mock data is a learnable next-token task (arithmetic
sequences mod the vocabulary), identical for every dispatcher, so loss curves of two
dispatchers can be compared step by step. Runs on CPU (gloo, reference backend) too, at toy
sizes.

Gradients: dense parameters are averaged over the data-parallel group; expert parameters
over the expert-data-parallel group and scaled by 1/DP (what Megatron's DDP does); then
AdamW. Kept explicit so the script has no optimizer / DDP version dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

DISPATCHERS = ("alltoall", "flex", "mok", "allgather")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moe-token-dispatcher-type", choices=DISPATCHERS, default="mok")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=512)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--moe-router-load-balancing-type", default=None,
                   help="default: aux_loss on GPU, none on CPU (Megatron's aux-loss tracker "
                        "allocates on CUDA)")
    p.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2)
    p.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    p.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="drop-and-pad: every expert gets capacity x EP rows (needs "
                        "--moe-expert-capacity-factor)")
    p.add_argument("--moe-flex-dispatcher-backend", default="deepep")
    p.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="a shared expert of this FFN size in every MoE layer")
    p.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="run the shared expert beside the dispatch / combine (needs CUDA)")
    p.add_argument("--expert-model-parallel-size", type=int, default=None,
                   help="default: the world size / the expert tensor-parallel size")
    p.add_argument("--expert-tensor-parallel-size", type=int, default=1,
                   help="each expert split over this many ranks (fc1 by rows, fc2 by columns)")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=1,
                   help="micro-batches per step; above 1 (or with the EP overlap) a step is "
                        "Megatron's forward_backward_no_pipelining over them")
    p.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help="Megatron's 1F1B EP overlap: one micro-batch's dispatch and combine "
                        "beside another's compute (CUDA, bf16, EP > 1, >= 2 micro-batches to "
                        "overlap anything)")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--train-iters", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bf16", action="store_true", help="bf16 params/activations")
    p.add_argument("--timing-warmup", type=int, default=3,
                   help="steps left out of the time / throughput summary")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA under an NCCL process group, else CPU; cuda: CUDA tensors "
                        "under any group (e.g. gloo ranks sharing one GPU in tests)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    args = p.parse_args(argv)
    if args.moe_shared_expert_overlap and not args.moe_shared_expert_intermediate_size:
        p.error("--moe-shared-expert-overlap needs --moe-shared-expert-intermediate-size")
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        p.error("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if args.num_microbatches < 1:
        p.error(f"--num-microbatches must be >= 1, got {args.num_microbatches}")
    if args.overlap_moe_expert_parallel_comm and not args.bf16:
        p.error("--overlap-moe-expert-parallel-comm needs --bf16 (Megatron allows the overlap "
                "for bf16 / fp16 models only)")
    if args.overlap_moe_expert_parallel_comm and args.moe_shared_expert_overlap:
        p.error("--overlap-moe-expert-parallel-comm and --moe-shared-expert-overlap do not go "
                "together (Megatron refuses both)")
    return args


# ------------------------------------------------------------------------------ set-up
def init_distributed():
    """torchrun env (RANK/WORLD_SIZE/...) or an already-initialised group; else 1 process."""
    from megatron_mok.megatron.harness import init_distributed as _init

    _init()


def build_model(args, device):
    from megatron.core.models.gpt import GPTModel
    from megatron_mok.megatron import harness

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    lb = args.moe_router_load_balancing_type or ("aux_loss" if device.type == "cuda" else "none")
    extra = {}
    if args.moe_token_dispatcher_type == "flex":
        extra["moe_flex_dispatcher_backend"] = args.moe_flex_dispatcher_backend
    config = harness.moe_config(
        args.moe_token_dispatcher_type, ep_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        num_experts=args.num_experts, topk=args.moe_router_topk, hidden=args.hidden_size,
        ffn_hidden=args.ffn_hidden_size, dtype=dtype, num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
        moe_router_load_balancing_type=lb,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff if lb != "none" else 0.0,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_overlap=args.moe_shared_expert_overlap,
        overlap_moe_expert_parallel_comm=args.overlap_moe_expert_parallel_comm,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, **extra)
    spec = harness.local_layer_spec(args.num_experts, cpu_router=device.type == "cpu")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
                     max_sequence_length=args.seq_length, pre_process=True, post_process=True,
                     position_embedding_type="learned_absolute")
    return model.to(device=device, dtype=dtype), config


def mock_batch(args, step, dp_rank, device, micro=0):
    """Arithmetic sequences mod V with per-sample start/stride: next token is learnable.

    Depends only on (seed, step, micro-batch, dp_rank): identical for every dispatcher (micro
    0 is the one-micro-batch run's batch)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + dp_rank + micro * 7919)
    b, s, v = args.micro_batch_size, args.seq_length, args.vocab_size
    start = torch.randint(0, v, (b, 1), generator=g)
    stride = torch.randint(1, 8, (b, 1), generator=g)
    seq = (start + stride * torch.arange(s + 1).view(1, -1)) % v
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    pos = torch.arange(s).view(1, -1).expand(b, s).contiguous()
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    return tokens.to(device), pos.to(device), causal.to(device), labels.to(device)


def forward_backward(args, model, step, dp_rank, device):
    """One step's forward and backward; returns the mean loss of its micro-batches (a 0-d
    tensor, read after the optimizer step so that no host sync comes in between).

    One micro-batch (and no EP overlap): the model called directly. Otherwise, on CUDA,
    Megatron's ``forward_backward_no_pipelining`` over ``--num-microbatches`` micro-batches
    (the 1F1B EP overlap schedule when the config asks for it); it scales each micro-batch's
    loss and the MoE aux loss by 1 / micro-batches, so the gradients are those of the mean
    loss (the aux-loss scale it sets replaces the 1 / DP that :func:`main` sets for direct
    steps). On CPU the same math written out (Megatron's schedule allocates on CUDA).

    A MoK kernel's device error (a timeout, a bad expert id) raises before this returns, so
    before the optimizer step: Megatron's schedule checks after itself (``install()``); the
    steps written out here call ``megatron_mok.megatron.check_errors()`` (a no-op without MoK
    layers)."""
    from megatron_mok.megatron import check_errors, harness

    if args.num_microbatches == 1 and not args.overlap_moe_expert_parallel_comm:
        tokens, pos, mask, labels = mock_batch(args, step, dp_rank, device)
        loss = model(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        check_errors()
        return loss.detach()
    n = args.num_microbatches
    batches = [mock_batch(args, step, dp_rank, device, micro=i) for i in range(n)]
    if device.type == "cuda":
        from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

        store = forward_backward_no_pipelining(
            forward_step_func=harness.gpt_forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=n, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False)
        return torch.stack([d["lm loss"].float() for d in store]).mean()
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=device) / n)   # as the schedule does
    losses = []
    for tokens, pos, mask, labels in batches:
        loss, _ = harness.mean_token_loss(model(tokens, pos, mask, labels=labels))
        (loss / n).backward()
        losses.append(loss.detach())
    check_errors()
    return torch.stack(losses).mean()


def sync_grads(model):
    """Average dense grads over DP; expert grads over expert-DP, scaled by 1/DP."""
    from megatron.core import parallel_state as ps

    dp_group = ps.get_data_parallel_group()
    dp = dist.get_world_size(dp_group)
    edp_group = ps.get_expert_data_parallel_group()
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "allreduce", True):
            if dp > 1:
                dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(dp)
        else:
            if dist.get_world_size(edp_group) > 1:
                dist.all_reduce(p.grad, group=edp_group)
            p.grad.div_(dp)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _versions():
    out = {"torch": torch.__version__}
    try:
        from megatron.core import package_info

        out["megatron_core"] = package_info.__version__
    except Exception:
        pass
    try:
        import megatron_mok

        out["megatron_mok"] = megatron_mok.__version__
    except Exception:
        pass
    return out


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    etp = args.expert_tensor_parallel_size
    if etp < 1 or world % etp:
        raise SystemExit(f"--expert-tensor-parallel-size {etp} does not divide the world size {world}")
    args.expert_model_parallel_size = args.expert_model_parallel_size or world // etp
    if world % (args.expert_model_parallel_size * etp):
        raise SystemExit(f"expert parallel x expert tensor parallel = {args.expert_model_parallel_size}"
                         f" x {etp} does not divide the world size {world}")
    # auto: a gloo group (tests, CPU runs) means CPU tensors even where a GPU is visible.
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()
                                       and dist.get_backend() == "nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if args.moe_shared_expert_overlap and not on_gpu:
        raise SystemExit("--moe-shared-expert-overlap needs CUDA (Megatron runs the shared expert "
                         "on its own CUDA stream)")
    if args.overlap_moe_expert_parallel_comm and not on_gpu:
        raise SystemExit("--overlap-moe-expert-parallel-comm needs CUDA (Megatron's 1F1B schedule "
                         "runs the dispatch and combine on its own CUDA streams)")
    if args.overlap_moe_expert_parallel_comm and args.expert_model_parallel_size < 2:
        raise SystemExit("--overlap-moe-expert-parallel-comm needs expert parallelism (EP >= 2): "
                         "there is no exchange to overlap")

    if args.moe_token_dispatcher_type == "mok":
        import megatron_mok.megatron

        megatron_mok.megatron.install()
    if args.moe_token_dispatcher_type == "flex":
        try:
            import deep_ep  # noqa: F401
        except ImportError:
            raise SystemExit("--moe-token-dispatcher-type flex needs deep_ep (DeepEP) installed")

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_mok.megatron import harness

    harness.init_parallel(args.expert_model_parallel_size, seed=args.seed, etp_size=etp)
    harness.enable_cpu_megatron(on_cpu=device.type == "cpu")
    torch.manual_seed(args.seed)
    model, config = build_model(args, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=device) / dp)

    tokens_per_step = args.micro_batch_size * args.seq_length * args.num_microbatches
    losses, times = [], []
    for step in range(args.train_iters):
        _sync(device)
        t0 = time.perf_counter()
        loss = forward_backward(args, model, step, dp_rank, device)
        sync_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        dt = time.perf_counter() - t0
        stat = torch.tensor([loss.item(), dt], dtype=torch.float64, device=device)
        mean_loss = stat[:1].clone()
        dist.all_reduce(mean_loss)
        slow = stat[1:].clone()
        dist.all_reduce(slow, op=dist.ReduceOp.MAX)
        losses.append(float(mean_loss.item()) / world)
        times.append(float(slow.item()))
        if rank == 0 and not args.quiet:
            print(f"step {step + 1:4d}/{args.train_iters} | loss {losses[-1]:.5f} | "
                  f"{times[-1] * 1e3:8.1f} ms | {tokens_per_step / times[-1]:10.0f} tokens/s/GPU",
                  flush=True)

    timed = times[args.timing_warmup:] or times
    med = statistics.median(timed)
    mok_backend = None
    for m in model.modules():
        d = getattr(m, "token_dispatcher", None)
        if d is not None and hasattr(d, "backend_name"):
            mok_backend = d.backend_name
            break
    if args.overlap_moe_expert_parallel_comm:
        schedule = "1f1b_ep_overlap"
    elif args.num_microbatches > 1:
        schedule = "forward_backward_no_pipelining" if on_gpu else "micro_batch_loop_cpu"
    else:
        schedule = "direct"
    summary = {
        "dispatcher": args.moe_token_dispatcher_type, "mok_backend": mok_backend,
        "schedule": schedule, "num_microbatches": args.num_microbatches,
        "world_size": world, "expert_model_parallel_size": args.expert_model_parallel_size,
        "expert_tensor_parallel_size": etp,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": "bf16" if args.bf16 else "fp32", "args": vars(args), "versions": _versions(),
        "tokens_per_step_per_gpu": tokens_per_step, "losses": losses, "step_times_s": times,
        "median_step_time_s": med, "tokens_per_s_per_gpu": tokens_per_step / med,
        "final_loss": losses[-1], "command": " ".join([sys.executable] + sys.argv),
        "parameters_this_rank": sum(p.numel() for p in model.parameters()),
        "shared_expert_parameters_this_rank": sum(
            p.numel() for n, p in model.named_parameters() if ".shared_experts." in n),
    }
    if rank == 0:
        print(f"[{args.moe_token_dispatcher_type}] final loss {losses[-1]:.5f} | median step "
              f"{med * 1e3:.1f} ms | {tokens_per_step / med:.0f} tokens/s/GPU", flush=True)
        if args.output_json:
            os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
            with open(args.output_json, "w") as f:
                json.dump(summary, f, indent=1)
    harness.destroy_parallel()
    return summary


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()

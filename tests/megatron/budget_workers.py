"""Rank functions: megatron-core 0.19's per-rank receive budget
(``moe_expert_rank_capacity_factor``) with ``mok`` (``megatron_mok/megatron/budget.py``).

The factor is set on the config after it is built: megatron-core 0.16 has no such field, and
0.19's own ``__post_init__`` accepts it only with ``moe_flex_dispatcher_backend='hybridep'`` and
the TE op fuser (whose pad multiple, 256, would round these small budgets past every row).

Routing is skewed towards EP rank 0's experts (a constant added to the router's logits of
both layers compared, :func:`skew_routing`), so that with factor 1.0 rank 0 receives more
rows than its budget and rank 1 fewer: one rank drops, the other does not.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from mok_megatron_workers import (_assert_bitwise, _cpu_cuda_streams, _device, _gpt_batches,
                                  _pop_grads, _run_layer, _schedules_on_cpu, _setup,
                                  _TorchCpuZeros, _train_step)

SKEW = 0.1          # added to the logits of EP rank 0's experts (logits' spread here: ~0.1)


def factors(world: int):
    """``(generous, tight)``: ``world`` (a rank receives at most ``world x T x K`` rows when
    every rank has ``T`` tokens: nothing dropped) and a factor that drops on EP rank 0 (1.0
    with the skew at EP 2: rank 0 gets more than ``T x K`` rows, rank 1 fewer; 0.5 at EP 1)."""
    return float(world), (1.0 if world > 1 else 0.5)


def hybridep_budget(num_tokens: int, topk: int, factor: float, pad_multiple: int = 1) -> int:
    """HybridEP's budget (``_HybridEPManager.setup_metadata``, megatron-core 0.19), written out."""
    budget = int(num_tokens * topk * factor)
    return budget + (-budget % pad_multiple)


def skew_routing(router, num_experts: int, world: int) -> None:
    """Add :data:`SKEW` to the router's logits of EP rank 0's experts (``router.gating``'s
    output; everything after it, the top-k and the probs, is Megatron's). Nothing at EP 1."""
    if world == 1:
        return
    skew = torch.zeros(num_experts)
    skew[:num_experts // world] = SKEW
    gating = router.gating

    def skewed(inp):
        logits = gating(inp)
        return logits + skew.to(logits.device, logits.dtype)

    router.gating = skewed


class PaddedRowsExperts(torch.nn.Module):
    """A stand-in for megatron-core 0.19's fused ``TEGroupedMLP`` (TE op fuser; Transformer
    Engine is not installable here) as far as the budget goes: takes all ``M`` rows with
    ``tokens_per_expert`` on the rows' device summing to the kept rows, reads nothing on the
    host, returns ``M`` rows (``mok_takes_padded_rows``: the dispatcher then hands it the
    padded rows). Expert ``e``: ``tanh(x * scale_e) * prob`` per row; the rows past the counts
    get a zero scale.

    Row ``i``'s expert comes from the counts by ``repeat_interleave`` with ``output_size`` (no
    host read), the rows past them in an extra bucket. The scales' gradient is the index's
    backward, an ``index_add`` over the rows in order (sequential on CPU: the same sums with
    or without padding rows, whose gradient is zero)."""

    mok_takes_padded_rows = True

    def __init__(self, num_local_experts: int, hidden: int, seed: int = 7):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.scale = torch.nn.Parameter(torch.rand(num_local_experts, hidden, generator=g) + 0.5)
        self.rows_seen = []

    def forward(self, tokens, tokens_per_expert, probs, **_):
        rows, n_exp = tokens.shape[0], self.scale.shape[0]
        self.rows_seen.append((rows, tokens_per_expert.device.type))
        counts = tokens_per_expert.to(device=tokens.device, dtype=torch.int64)
        counts = torch.cat([counts, (rows - counts.sum()).view(1)])
        expert = torch.repeat_interleave(torch.arange(n_exp + 1, device=tokens.device), counts,
                                         output_size=rows)
        scale = torch.cat([self.scale, self.scale.new_zeros(1, self.scale.shape[1])])[expert]
        out = torch.tanh(tokens * scale.to(tokens.dtype)) * probs.unsqueeze(-1).to(tokens.dtype)
        return out, None


def _close(got, want, what, tol):
    """``(output, input grad, {param: grad})`` within ``tol`` of each tensor's largest value."""
    for name, a, b in (("output", got[0], want[0]), ("input grad", got[1], want[1]),
                       *((f"grad {k}", got[2][k], want[2][k]) for k in want[2])):
        scale = float(b.float().abs().max()) or 1.0
        torch.testing.assert_close(a.float(), b.float(), atol=tol * scale, rtol=tol,
                                   msg=lambda m: f"{name}, {what}: {m}")


def _compare(got, want, what, bitwise):
    if bitwise:
        _assert_bitwise(got[0], want[0], f"output, {what}")
        _assert_bitwise(got[1], want[1], f"input grad, {what}")
        assert got[2].keys() == want[2].keys()
        for k in want[2]:
            _assert_bitwise(got[2][k], want[2][k], f"grad {k}, {what}")
    else:
        _close(got, want, what, 2e-2)


@contextlib.contextmanager
def _zero_rows_past(experts, rows: int):
    """The experts' output rows from ``rows`` on zeroed (a forward hook): what the budget's
    drop of the rows past ``M`` (contract order) must equal, up to the expert GEMMs' sums."""
    def hook(module, args, out):
        y, bias = out
        if y.shape[0] <= rows:
            return out
        return torch.cat([y[:rows], y.new_zeros(y.shape[0] - rows, *y.shape[1:])]), bias

    handle = experts.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def layer_rank_budget(rank, world, experts="sequential", backend_env=None):
    """A full ``MoELayer`` (EP = world, 4 experts per rank, top-2, 40 tokens per rank) with
    ``moe_expert_rank_capacity_factor`` against the same layer without it (same weights, same
    skewed router, :func:`skew_routing`), through five steps:

    1. a generous factor (:func:`factors`: nothing dropped): output, input gradient and every
       parameter gradient bitwise those without the factor; the flag stays False;
    2. ``_comm_manager``'s factor made tight (rank 0 drops at EP 2, rank 1 does not): the flag
       is set where rows were dropped and only there; the results equal, within 1e-5 of each
       tensor's largest value (2e-2 on GPUs), those of the layer without the factor whose
       experts' output rows past ``M`` are zeroed (what dropping them means); a generous step
       after it leaves the flag as it was (it accumulates);
    3. ``reset_over_budget()`` clears the flag;
    4. ``_comm_manager``'s factor ``None`` (Megatron's ``PagedStashRunner`` before its rerun):
       the dispatch asks for no budget and the step is bitwise the one without the factor;
    5. the factor back from the config (``PagedStashRunner`` after a clean step): the generous
       budget again, bitwise.

    Every budget ``M`` is HybridEP's formula (:func:`hybridep_budget`). ``experts``:
    ``"sequential"`` (Megatron's ``SequentialMLP``: the kept rows only, output padded back) or
    ``"padded"`` (:class:`PaddedRowsExperts` in both layers: all ``M`` rows). Bitwise on GPUs
    too, except the stand-in's scale gradient (an ``index_add`` with atomics there). Returns
    ``{"R", "M", "dropped", "flag", "differs", "rows_seen"}`` (``M``: the tight budget;
    ``rows_seen``: what the budget layer's experts got per step).
    """
    from megatron_mok.megatron import budget

    h = _setup(world, backend_env)
    try:
        dev = _device()
        gpu = dev.type == "cuda"
        dt = torch.bfloat16 if gpu else torch.float32
        E, K, T = 4 * world, 2, 40
        H = 64 if gpu else 32
        generous, tight = factors(world)
        kw = dict(num_experts=E, topk=K, hidden=H, moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0, **({"dtype": dt} if gpu else {}))
        layers = {}
        for name, factor in (("plain", None), ("budget", generous)):
            torch.manual_seed(0)
            cfg = h.moe_config("mok", ep_size=world, **kw)
            cfg.moe_expert_rank_capacity_factor = factor        # (see the module docstring)
            layer = h.build_moe_layer(cfg, **({"device": dev, "dtype": dt} if gpu else {}))
            if experts == "padded":
                layer.experts = PaddedRowsExperts(E // world, H).to(dev, dt)
                layer.token_dispatcher.configure_for_experts(layer.experts)
            skew_routing(layer.router, E, world)
            layers[name] = layer
        layers["budget"].load_state_dict(layers["plain"].state_dict())
        plain, layer = layers["plain"], layers["budget"]
        disp = layer.token_dispatcher
        want_mode = budget.PADDED if experts == "padded" else budget.EXACT
        assert disp.budget_rows == want_mode, (disp.budget_rows, want_mode)

        seen = {name: [] for name in layers}
        for name, lay in layers.items():
            lay.experts.register_forward_pre_hook(
                lambda mod, args, name=name: seen[name].append(
                    (args[0].shape[0], [int(c) for c in args[1].tolist()])))
        budgets = []
        recv_budget = disp.recv_budget
        disp.recv_budget = lambda n: budgets.append(recv_budget(n)) or budgets[-1]

        g = torch.Generator().manual_seed(400 + rank)
        x = torch.randn(T, 1, H, generator=g).to(dt).to(dev)
        gy = torch.randn(T, 1, H, generator=g).to(dt).to(dev)
        ref = _run_layer(plain, x, gy)
        R, counts = seen["plain"][0]
        bitwise = not (gpu and experts == "padded")

        def flag():
            f = disp.check_over_budget()
            assert f.dtype == torch.bool and tuple(f.shape) == (1,), f
            return bool(f.view(-1)[0])

        # 1. generous: nothing dropped, bitwise
        _compare(_run_layer(layer, x, gy), ref, "generous budget vs no budget", bitwise)
        M_gen = hybridep_budget(T, K, generous)
        assert budgets == [M_gen], (budgets, M_gen)
        assert R <= M_gen and not flag()
        rows, got_counts = seen["budget"][-1]
        assert rows == (M_gen if experts == "padded" else R) and got_counts == counts

        # 2. tight: rows past M dropped on the ranks that receive more than M, flagged there
        disp._comm_manager.moe_expert_rank_capacity_factor = tight
        M = hybridep_budget(T, K, tight)
        got = _run_layer(layer, x, gy)
        assert budgets[-1] == M, (budgets, M)
        dropped = R > M
        assert flag() is dropped, (R, M)
        rows, got_counts = seen["budget"][-1]
        kept = min(R, M)
        cum = [sum(counts[:e]) for e in range(len(counts) + 1)]
        assert got_counts == [min(cum[e + 1], M) - min(cum[e], M) for e in range(len(counts))]
        assert rows == (M if experts == "padded" else kept), (rows, M, kept)
        with _zero_rows_past(plain.experts, M):
            masked = _run_layer(plain, x, gy)
        _close(got, masked, "tight budget vs no budget with the rows past M zeroed",
               2e-2 if gpu else 1e-5)
        differs = not torch.equal(got[0], ref[0])

        # the flag accumulates until reset: a step that drops nothing leaves it as it was
        disp._comm_manager.moe_expert_rank_capacity_factor = generous
        _compare(_run_layer(layer, x, gy), ref, "generous budget after the tight one", bitwise)
        assert flag() is dropped

        # 3. reset; 4. no factor on _comm_manager (the rerun): dropless, bitwise
        disp.reset_over_budget()
        assert not flag()
        disp._comm_manager.moe_expert_rank_capacity_factor = None
        _compare(_run_layer(layer, x, gy), ref, "no factor on _comm_manager vs no budget", bitwise)
        assert budgets[-1] is None and seen["budget"][-1] == (R, counts) and not flag()

        # 5. the factor back from the config, as PagedStashRunner restores it
        disp._comm_manager.moe_expert_rank_capacity_factor = \
            disp.config.moe_expert_rank_capacity_factor
        _compare(_run_layer(layer, x, gy), ref, "restored generous budget vs no budget", bitwise)
        assert budgets[-1] == M_gen and not flag()
        if experts == "padded":
            assert all(dev_type == dev.type for _, dev_type in layer.experts.rows_seen)
        return {"R": R, "M": M, "dropped": dropped, "differs": differs,
                "rows_seen": [r for r, _ in seen["budget"]]}
    finally:
        h.destroy_parallel()


# ------------------------------------------------------------- Megatron's PagedStashRunner
def _gpt(h, world, factor, dev):
    """A 2-layer bf16 ``GPTModel`` (local spec, EP = world, 4 experts per rank, top-2, a
    shared expert) with ``moe_expert_rank_capacity_factor = factor`` on its config before the
    model is built, and the ``zero_grad_buffer()`` that ``PagedStashRunner`` calls on each model
    chunk (DDP's; here every ``.grad`` set to ``None``)."""
    from megatron.core.models.gpt import GPTModel

    cpu = dev.type == "cpu"
    cfg = h.moe_config("mok", ep_size=world, num_layers=2, num_experts=4 * world, topk=2,
                       hidden=32, ffn_hidden=64, dtype=torch.bfloat16, hidden_dropout=0.0,
                       attention_dropout=0.0, init_method_std=0.02, moe_router_dtype=None,
                       moe_shared_expert_intermediate_size=32,
                       moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    cfg.moe_expert_rank_capacity_factor = factor
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=h.local_layer_spec(4 * world, cpu_router=cpu),
                     vocab_size=64, max_sequence_length=16,
                     position_embedding_type="learned_absolute").to(dev, torch.bfloat16)
    for layer in model.decoder.layers:
        skew_routing(layer.mlp.router, 4 * world, world)
    model.zero_grad_buffer = functools.partial(_pop_grads, model)
    return model


@contextlib.contextmanager
def _paged_stash_on_cpu():
    """megatron-core 0.19's paged-stash module on CPU: its overflow checks allocate
    ``torch.zeros(..., device='cuda')`` (made on the CPU instead, as for the schedules:
    ``_TorchCpuZeros``), and its manager singleton makes a CUDA stream (a no-op stand-in,
    ``_cpu_cuda_streams``; the stash itself is off)."""
    from megatron.core.transformer.moe import paged_stash as PS

    orig_torch, orig_mgr = PS.torch, PS.PagedStashManager.STASH_MGR
    PS.torch = _TorchCpuZeros("torch")
    try:
        with _cpu_cuda_streams():
            PS.PagedStashManager.get_instance()
        yield
    finally:
        PS.torch = orig_torch
        PS.PagedStashManager.STASH_MGR = orig_mgr


def paged_stash_runner(rank, world, backend_env=None):
    """Megatron's own ``PagedStashRunner`` (megatron-core 0.19, ``transformer/moe/paged_stash.py``:
    what ``megatron.training`` wraps around its forward-backward function whenever
    ``moe_expert_rank_capacity_factor`` is set) around ``forward_backward_no_pipelining`` over
    ``mok`` models (:func:`_gpt`, 2 micro-batches of 2 x 16 tokens per rank), against the same
    model without the factor stepped by the bare schedule:

    - tight factor (:func:`factors`): the first attempt drops rows on EP rank 0 only (each
      layer's ``check_over_budget()`` as the runner reads it: set on rank 0, clear on rank 1 at
      EP 2), the runner's all-reduce makes both ranks rerun, its ``prepare_for_rerun`` clears
      ``_comm_manager``'s factor (the rerun's dispatches ask for no budget) and the flags and
      zeroes the gradients; the step's losses and every gradient are bitwise the step without
      the factor; afterwards the factor is back on every layer's ``_comm_manager``;
    - generous factor: one attempt, every dispatch budgeted, nothing flagged, bitwise too.

    On CPU the paged-stash module's CUDA allocations and stream are stood in
    (:func:`_paged_stash_on_cpu`) and the schedule's token counter made on the CPU
    (``_schedules_on_cpu``). Returns ``{name: {"attempts", "flags", "budgets"}}``: per attempt,
    the layers' local flags when the runner checked, and whether its dispatches had a budget.
    """
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.transformer.moe import paged_stash as PS

    from megatron_mok.megatron.harness import gpt_forward_step

    h = _setup(world, backend_env)
    try:
        dev = _device()
        cpu = dev.type == "cpu"
        with (_schedules_on_cpu() if cpu else contextlib.nullcontext()), \
                (_paged_stash_on_cpu() if cpu else contextlib.nullcontext()):
            h.enable_cpu_megatron(on_cpu=cpu)
            generous, tight = factors(world)
            plain = _gpt(h, world, None, dev)
            batches = _gpt_batches(rank, 2, 2, 16, 64, dev)
            want_losses, want_grads = _train_step(plain, batches)
            report = {}
            for name, factor in (("tight", tight), ("generous", generous)):
                model = _gpt(h, world, factor, dev)
                model.load_state_dict(plain.state_dict())
                disps = [layer.mlp.token_dispatcher for layer in model.decoder.layers]
                attempts, flags = [], []

                def schedule(**kwargs):
                    attempts.append([])
                    return forward_backward_no_pipelining(**kwargs)

                for d in disps:
                    orig = d.recv_budget
                    d.recv_budget = lambda n, orig=orig: (
                        attempts[-1].append(orig(n)) or attempts[-1][-1])
                runner = PS.PagedStashRunner(model.config, False, [model], None, schedule)
                assert [m.token_dispatcher for m in runner.moe_layers] == disps
                check = runner.check_moe_overflow
                runner.check_moe_overflow = lambda check=check: (
                    flags.append([bool(d.check_over_budget().view(-1)[0]) for d in disps])
                    or check())
                _pop_grads(model)
                store = runner(forward_step_func=gpt_forward_step, data_iterator=iter(batches),
                               model=[model], num_microbatches=len(batches), seq_length=16,
                               micro_batch_size=2, forward_only=False)
                losses = torch.stack([s["lm loss"].float().cpu() for s in store])
                grads = _pop_grads(model)
                _assert_bitwise(losses, want_losses, f"losses, {name} budget under the runner")
                assert grads.keys() == want_grads.keys()
                for k in want_grads:
                    _assert_bitwise(grads[k], want_grads[k], f"grad {k}, {name} budget")
                assert all(d._comm_manager.moe_expert_rank_capacity_factor == factor
                           for d in disps), "the factor is back after the step"
                assert not any(bool(d.check_over_budget().view(-1)[0]) for d in disps)
                report[name] = {"attempts": len(attempts), "flags": flags,
                                "budgets": [[b is not None for b in a] for a in attempts]}
        return report
    finally:
        h.destroy_parallel()

"""Rank functions for ``test_megatron_features.py``: Megatron-Core MoE features that change
what the dispatcher is handed (latent-dim tokens, top-1 probs applied on the experts' input,
replayed or random routing, drop-and-pad switched on and off between calls) run through a
full ``MoELayer`` with ``mok`` against Megatron's own ``alltoall``.

The helpers of ``mok_megatron_workers`` (setup, one forward + backward, bitwise checks) are
imported, not copied. Every function tears down the parallel state, the shared MoK Buffers
and any process-global Megatron state it touched in ``finally``: the ranks are pooled and
take the next test's call.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from mok_megatron_workers import (_assert_runs_bitwise, _compare, _device,
                                  _full_state_dict, _run_layer, _setup, patched_attrs)

# mok vs alltoall is not asserted bitwise (as in layer_mok_vs_alltoall_cpu, which allows
# 1e-5): mok sums a token's expert outputs in its own order (slot order, in the combine)
# where alltoall's unpermute scatter-adds them, and the experts get their rows in another
# order (EP=2 vs EP=1 layouts), so the last bits may differ. On a GPU the GEMMs' reduction
# order also depends on the row count. Relative to each tensor's largest value (``_compare``):
# with Megatron's default init (std 0.02) the layer's outputs are ~1e-3, where an absolute
# 1e-5 would let a 1% error in the probs through (checked: a mutant scaling them by 1.001
# passed the latent test with atol=1e-5).
CPU_TOL = 1e-5
GPU_TOL = 1e-4


def _config_fields() -> set:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {f.name for f in dataclasses.fields(TransformerConfig)}


# ----------------------------------------------------------------- latent MoE stand-in
class DuplicatedLinear(torch.nn.Module):
    """Stands in for ``TELinear(parallel_mode="duplicated")`` in ``MoELayer``'s latent
    projections (``moe_latent_size``), which Megatron builds only with TransformerEngine.
    Same constructor keywords, same ``(output, bias or None)`` return; the weight is whole on
    every rank, as TE's duplicated mode keeps it. What this lets a test check is the
    dispatcher's part of latent MoE (dispatch and combine of latent-dim tokens, experts
    working in the latent dim), not TE's linear."""

    def __init__(self, input_size, output_size, *, parallel_mode, config, init_method, bias,
                 skip_bias_add, skip_weight_param_allocation, is_expert, name=None,
                 tp_comm_buffer_name=None, **_):
        super().__init__()
        assert parallel_mode == "duplicated" and not skip_weight_param_allocation
        self.skip_bias_add = skip_bias_add
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size,
                                                     dtype=config.params_dtype))
        init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) \
            if bias else None

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight)
        if self.bias is None:
            return y, None
        return (y, self.bias) if self.skip_bias_add else (y + self.bias, None)


@contextlib.contextmanager
def latent_projection_standin():
    """``MoELayer`` builds its latent projections with TE's ``TELinear`` and asserts
    ``HAVE_TE``; without TE (this machine) put :class:`DuplicatedLinear` in its place for the
    duration, then restore ``moe_layer``'s two names as they were (0.16 leaves ``TELinear``
    undefined without TE, 0.19 sets it to ``None``)."""
    from megatron.core.transformer.moe import moe_layer

    with patched_attrs(moe_layer, HAVE_TE=True, TELinear=DuplicatedLinear):
        yield


# ------------------------------------------------------------------- mok vs alltoall
def _build_pair(h, world: int, dev, **kw):
    """``(mok over EP = world, alltoall with every expert local)``, the same weights."""
    torch.manual_seed(0)
    on = {"device": dev} if dev.type == "cuda" else {}
    mok = h.build_moe_layer(h.moe_config("mok", ep_size=world, **kw), **on)
    a2a = h.build_moe_layer(h.moe_config("alltoall", ep_size=1, **kw),
                            pg_collection=h.single_rank_pg_collection(), **on)
    assert type(mok.token_dispatcher).__name__ == "MokTokenDispatcher"
    assert type(a2a.token_dispatcher).__name__ == "MoEAlltoAllTokenDispatcher"
    a2a.load_state_dict(_full_state_dict(mok, world, kw["num_experts"] // world), strict=True)
    return mok, a2a


def _nonzero(run) -> None:
    """A comparison of zeros proves nothing: the output and every gradient carry signal."""
    assert float(run[0].abs().sum()) > 0
    for k, g in run[2].items():
        assert float(g.abs().sum()) > 0, f"grad {k} is zero"


def _inputs(rank, dev, hidden, seq=8, batch=3):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(seq, batch, hidden, generator=g).to(dev)
    return x, torch.randn(seq, batch, hidden, generator=g).to(dev)


def _record_expert_inputs(layer) -> list:
    """What the layer's experts are handed, ``(tokens, tokens_per_expert, probs)`` per call."""
    seen = []
    layer.experts.register_forward_pre_hook(
        lambda mod, args: seen.append(tuple(a.detach().clone() for a in args[:3])))
    return seen


# Each feature: (TransformerConfig overrides, the megatron-core field it needs).
FEATURES = {
    # latent MoE (Nemotron-3): hidden 32 -> latent 16 before the dispatch, back after combine
    "latent": (dict(moe_latent_size=16), "moe_latent_size"),
    # the experts scale their input by the probs (top-1 only)
    "apply_probs_on_input": (dict(moe_apply_probs_on_input=True, topk=1,
                                  moe_router_pre_softmax=True),   # Megatron wants it at top-1
                             "moe_apply_probs_on_input"),
    # random router logits (benchmarking): routing independent of the input
    "force_load_balancing": (dict(moe_router_force_load_balancing=True),
                             "moe_router_force_load_balancing"),
    # 0.19: a random bias, the same on every rank, added to the logits
    "force_biased": (dict(moe_router_force_biased=1.0), "moe_router_force_biased"),
}


def layer_feature_vs_alltoall(rank, world, feature, backend_env=None):
    """One :data:`FEATURES` entry on: a full ``MoELayer`` with ``mok`` over EP = world
    against Megatron's ``alltoall`` with every expert local, same weights and input; output,
    input gradient and every parameter gradient within :data:`CPU_TOL` (:data:`GPU_TOL` on a
    GPU). The random-logit features draw from the CPU generator on CPU (the CUDA RNG
    tracker's fork is a no-op there: ``harness.enable_cpu_megatron``), reseeded identically
    before each layer's run. ``latent`` also checks that the dispatcher moved latent-dim
    tokens (the experts' input and the Buffer are 16 wide). Returns ``{"errors": {what: max
    difference, relative}, "dispatched_width": H of the experts' input, "tokens_per_expert": ...}``.
    """
    from megatron_mok.megatron import harness as mh

    overrides, field = FEATURES[feature]
    if field not in _config_fields():
        return {"skipped": f"{field} is not a TransformerConfig field in this megatron-core"}
    h = _setup(world, backend_env)
    dev = _device()
    prev_cpu_run = mh._CPU_RUN["on"]
    stack = contextlib.ExitStack()
    try:
        if dev.type == "cpu":
            mh.enable_cpu_megatron(on_cpu=True)      # CUDA RNG tracker fork: a no-op on CPU
        if feature == "latent":
            stack.enter_context(latent_projection_standin())
        kw = dict(num_experts=4 * world, topk=2, hidden=32,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        kw.update(overrides)
        mok, a2a = _build_pair(h, world, dev, **kw)
        seen = _record_expert_inputs(mok)
        x, gy = _inputs(rank, dev, kw["hidden"])

        def run(layer):
            torch.manual_seed(7 + rank)     # the random-logit features draw the same logits
            return _run_layer(layer, x, gy)

        run_m = run(mok)
        _assert_runs_bitwise(run(mok), run_m, "mok run 2 vs run 1")
        run_a = run(a2a)
        _nonzero(run_m)
        errs = _compare(rank, run_m, run_a, kw["num_experts"] // world,
                        GPU_TOL if dev.type == "cuda" else CPU_TOL)
        tokens, tpe, probs = seen[0]
        if feature == "latent":
            assert tokens.shape[1] == 16 and mok.token_dispatcher.buffer.hidden == 16, \
                (tokens.shape, mok.token_dispatcher.buffer.hidden)
            assert any(k.startswith("fc1_latent_proj") for k in run_m[2]), sorted(run_m[2])
        if feature == "apply_probs_on_input":
            assert float(probs.min()) > 0 and float(probs.max()) < 1, probs  # real top-1 probs
        return {"errors": errs, "dispatched_width": int(tokens.shape[1]),
                "tokens_per_expert": tpe.tolist()}
    finally:
        stack.close()
        mh._CPU_RUN["on"] = prev_cpu_run
        h.destroy_parallel()


# ------------------------------------------------------------------------ routing replay
def _replay_instances():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay


def layer_routing_replay(rank, world, backend_env=None):
    """``moe_enable_routing_replay``: Megatron's router records its top-k ids or takes
    given ones (RL: the routing an inference engine chose); the dispatcher then gets the
    replayed routing map. Checked, with a mok layer (EP = world) and an alltoall layer (EP 1)
    of the same weights, the routers being ``RouterReplay.global_router_replay_instances``
    [mok, alltoall]:

    - RECORD: both routers record the same top-k ids (same weights, same tokens);
    - REPLAY_FORWARD of other ids (every recorded id + 1 mod E): mok and alltoall agree
      within :data:`CPU_TOL` (output, input and parameter gradients), the routing that
      reached mok's experts is the replayed one (their ``tokens_per_expert``, summed over the
      ranks, is the replayed ids' count) and the output differs from the recorded run's;
    - REPLAY_FORWARD of the recorded ids: mok's output and gradients bitwise the recorded
      run's (a recorded step replayed dispatches the same rows).

    Returns the replayed ids' per-expert counts as mok's experts saw them."""
    RouterReplay = _replay_instances()
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    h = _setup(world, backend_env)
    dev = _device()
    RouterReplay.clear_global_router_replay_instances()
    try:
        E, K = 4 * world, 2
        mok, a2a = _build_pair(h, world, dev, num_experts=E, topk=K, hidden=32,
                               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                               moe_enable_routing_replay=True)
        instances = RouterReplay.global_router_replay_instances
        assert instances == [mok.router.router_replay, a2a.router.router_replay], instances
        seen = _record_expert_inputs(mok)
        x, gy = _inputs(rank, dev, 32)

        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        rec = _run_layer(mok, x, gy)
        _run_layer(a2a, x, gy)
        ids_m, ids_a = RouterReplay.get_recorded_data()
        assert torch.equal(ids_m, ids_a), "mok's and alltoall's routers recorded other ids"

        other = (ids_m + 1) % E                       # still K distinct experts per token
        RouterReplay.set_replay_data([other, other])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        run_m = _run_layer(mok, x, gy)
        run_a = _run_layer(a2a, x, gy)
        _nonzero(run_m)
        errs = _compare(rank, run_m, run_a, E // world, CPU_TOL if dev.type == "cpu" else GPU_TOL)
        assert not torch.equal(run_m[0], rec[0]), "the replayed routing changed nothing"
        want = torch.bincount(other.flatten().cpu(), minlength=E)
        dist.all_reduce(want)
        got = seen[-1][1].cpu()
        e_local = E // world
        assert got.tolist() == want[rank * e_local:(rank + 1) * e_local].tolist(), (got, want)

        RouterReplay.clear_global_indices()
        RouterReplay.set_replay_data([ids_m, ids_a])
        _assert_runs_bitwise(_run_layer(mok, x, gy), rec, "recorded ids replayed vs recorded")
        return {"errors": errs, "tokens_per_expert": got.tolist()}
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_instances()
        h.destroy_parallel()


# --------------------------------------------------- drop-and-pad toggled for decode
def _set_decode_padding(layer, on: bool, capacity_factor):
    """Megatron's ``set_decode_expert_padding`` (what its inference controllers call around
    CUDA-graphed decode steps with ``moe_pad_experts_for_cuda_graph_inference``) on one
    layer: it flips the config's drop-and-pad fields and each dispatcher's ``drop_and_pad`` /
    ``moe_expert_capacity_factor``. Its MoE-layer cache is module-global: emptied before and
    after, so it walks this layer only."""
    from megatron.core.inference import utils as iu

    iu.moe_layer_cache = None
    try:
        iu.set_decode_expert_padding(layer, on, capacity_factor=capacity_factor)
    finally:
        iu.moe_layer_cache = None


def _close_runs(run, ref, tol, what) -> None:
    """Two ``_run_layer`` results of the same layer (same parameters): output, input grad and
    every parameter grad within ``tol`` of each reference tensor's largest value."""
    pairs = [("output", run[0], ref[0]), ("input grad", run[1], ref[1])]
    pairs += [(f"grad {k}", run[2][k], ref[2][k]) for k in ref[2]]
    for name, got, want in pairs:
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, atol=tol * scale, rtol=tol,
                                   msg=lambda m: f"{name}, {what}: {m}")


def layer_decode_expert_padding(rank, world, backend_env=None):
    """``moe_pad_experts_for_cuda_graph_inference`` (megatron-core 0.19's config field; 0.16's
    ``InferenceWrapperConfig``): for CUDA-graphed decode steps Megatron switches an already
    built dropless model to drop-and-pad with the capacity factor ``E / topk`` (capacity =
    the token count: nothing dropped, fixed shapes) through ``set_decode_expert_padding``,
    and back for prefill. It sets the dispatcher's ``drop_and_pad`` and
    ``moe_expert_capacity_factor`` attributes (alltoall's names) and the shared config.

    Checked on a mok layer (EP = world) and an alltoall layer (EP 1), both built dropless:
    switched on, mok's experts get ``T x EP`` rows per local expert with host counts
    (drop-and-pad), mok's output and gradients are bitwise its dropless ones (no route
    dropped; only zero rows appended) and within :data:`CPU_TOL` of alltoall's (switched on
    too); switched off again, mok is dropless again (its experts get exactly the routed rows)
    and bitwise its first run. Returns ``{"N": rows per expert while padded, ...}``."""
    h = _setup(world, backend_env)
    dev = _device()
    try:
        E, K, T = 4 * world, 2, 24
        mok, a2a = _build_pair(h, world, dev, num_experts=E, topk=K, hidden=32,
                               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        seen = _record_expert_inputs(mok)
        x, gy = _inputs(rank, dev, 32, seq=T, batch=1)
        dropless = _run_layer(mok, x, gy)
        routed = int(seen[-1][1].sum())

        factor = E / K
        for layer in (mok, a2a):
            _set_decode_padding(layer, True, factor)
        padded = _run_layer(mok, x, gy)
        tokens, tpe, probs = seen[-1]
        e_local = E // world
        assert tpe.device.type == "cpu" and tpe.tolist() == [T * world] * e_local, tpe
        assert tokens.shape[0] == T * world * e_local
        if dev.type == "cpu":
            _assert_runs_bitwise(padded, dropless, "mok with decode padding vs dropless")
        else:   # cuBLAS picks its kernel by the row count: T x EP rows per expert, not the routed
            _close_runs(padded, dropless, GPU_TOL, "mok with decode padding vs dropless")
        errs = _compare(rank, padded, _run_layer(a2a, x, gy), e_local,
                        CPU_TOL if dev.type == "cpu" else GPU_TOL)

        # Another factor (half: routes dropped) is the one its dispatch uses: read per call.
        from megatron.core.transformer.moe.moe_utils import get_capacity

        _set_decode_padding(mok, True, factor / 2)
        _run_layer(mok, x, gy)
        half = get_capacity(num_tokens=T * K, num_experts=E, capacity_factor=factor / 2)
        assert seen[-1][1].tolist() == [half * world] * e_local, (half, seen[-1][1])

        for layer in (mok, a2a):
            _set_decode_padding(layer, False, None)
        again = _run_layer(mok, x, gy)
        assert int(seen[-1][1].sum()) == routed == seen[-1][0].shape[0]
        _assert_runs_bitwise(again, dropless, "mok after decode padding vs before")
        _nonzero(dropless)
        return {"N": T * world, "routed_rows": routed, "errors": errs}
    finally:
        h.destroy_parallel()

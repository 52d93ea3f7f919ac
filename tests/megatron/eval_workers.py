"""Rank functions for ``test_megatron_eval.py``: the ``mok`` dispatcher in evaluation and
generation-style use. With ``transformer_impl="local"`` or ``"transformer_engine"`` Megatron
keeps the configured dispatcher for ``eval()`` / ``torch.no_grad()`` forwards (evaluation,
RL rollouts); only ``transformer_impl="inference_optimized"`` swaps in its own. Generation
changes the token count per call: a prefill, then decode steps of a few tokens (a rank may
have none), then another prefill.

The Buffer's ``T_max`` is fixed at the first dispatch of the group (the largest token count
of any EP rank there, one all-reduce), or by ``MOK_MAX_TOKENS_PER_RANK`` read when the
dispatcher is built (``MokOptions.from_config``). A later call with more tokens raises a
``ValueError`` naming that knob, on the rank that has them (``MokTokenDispatcher._get_buffer``),
which first stops the group's Buffer (``Buffer.abort``): its EP peers, already in the same
dispatch, raise at once naming that rank, and the Buffer refuses every later call (a world of
one rank excepted) until the parallel state is re-initialised (``reset_buffers``).

Every function tears down the parallel state, the shared Buffers and the env var it set in
``finally``: the ranks are pooled and take the next test's call.
"""

from __future__ import annotations

import os

import torch

from feature_workers import CPU_TOL, GPU_TOL, _build_pair, _inputs, _nonzero
from mok_megatron_workers import (_assert_bitwise, _compare, _device, _run_layer, _setup)

HIDDEN = 32

# Per-rank token counts of a generation-style sequence, each call ``[seq, batch, H]``:
# a prefill, decode steps of 0-3 tokens (a rank with none in some steps), a second prefill no
# larger than the first's T_max (rank 1's is larger than its own first one: it is the EP
# group's T_max that bounds it). Index = EP rank; at world size 1 rank 0's.
PREFILL = {0: (12, 2), 1: (10, 2)}                  # 24 and 20 tokens: T_max = 24
DECODE = {0: [1, 3, 0, 2, 1], 1: [2, 1, 3, 0, 1]}  # tokens per step, as [n, 1, H]
PREFILL2 = {0: (8, 2), 1: (12, 2)}                  # 16 and 24 tokens


def _tokens(rank, step, shape, dev):
    """Input of one call, seeded by (rank, step): a re-run of the step gets the same tokens."""
    g = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    return torch.randn(*shape, HIDDEN, generator=g).to(dev)


def _forward(layer, x):
    y, bias = layer(x)
    assert bias is None
    return y


def _close(what, got, want, tol) -> float:
    """``_compare``'s tolerance on one output: ``tol`` x the reference's largest value (absolute)
    and ``tol`` relative; returns the largest difference relative to that value."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if want.numel() == 0:
        return 0.0
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, atol=tol * scale, rtol=tol,
                               msg=lambda s: f"{what} (largest value {scale:.3g}): {s}")
    return (got.float() - want.float()).abs().max().item() / (scale or 1.0)


def _perturb_expert(a2a, expert=0, scale=1.001):
    """Scale one expert's fc1 weight of the alltoall layer (the test's mutant switch)."""
    with torch.no_grad():
        a2a.experts.local_experts[expert].linear_fc1.weight.mul_(scale)


def _generation(rank, mok, a2a, steps, dev, tol):
    """Run ``steps`` (``[(name, shape)]``) in ``eval()`` under ``no_grad`` on both layers, each
    mok step twice: returns ``{name: (tokens, error vs alltoall, bitwise vs alltoall)}``."""
    out = {}
    mok.eval()
    a2a.eval()
    with torch.no_grad():
        for i, (name, shape) in enumerate(steps):
            x = _tokens(rank, i, shape, dev)
            y = _forward(mok, x)
            assert y.shape == x.shape, (name, y.shape, x.shape)
            assert not y.requires_grad
            _assert_bitwise(_forward(mok, x), y, f"mok {name} run 2 vs run 1")
            want = _forward(a2a, x)
            err = _close(f"output, {name}", y, want, tol)
            if y.numel():
                assert float(y.abs().sum()) > 0, f"{name}: mok's output is zero"
            out[name] = (int(x.shape[0] * x.shape[1]), err, bool(torch.equal(y, want)))
    return out


def _steps(rank, zero_ok=True):
    decode = DECODE[rank] if zero_ok else [max(n, 1) for n in DECODE[rank]]
    steps = [("prefill", PREFILL[rank])]
    steps += [(f"decode{i}", (n, 1)) for i, n in enumerate(decode)]
    steps += [("prefill2", PREFILL2[rank])]
    return steps


def layer_generation_vs_alltoall(rank, world, backend_env=None, mutant=False, zero_ok=False):
    """A ``MoELayer`` pair (mok over EP = world, alltoall with every expert local, same
    weights) in ``eval()`` under ``torch.no_grad()``: a prefill, decode steps of 0-3 tokens
    per rank, a second prefill (:data:`PREFILL`, :data:`DECODE`, :data:`PREFILL2`). Each mok
    output is bitwise its own re-run of the step and within ``_compare``'s tolerance of
    alltoall's. Then ``train()`` with grad: one forward + backward, output, input grad and
    every parameter grad against alltoall (``_compare``): the Buffer made at the first
    (no-grad) dispatch serves the training step. ``mutant``: one alltoall expert's weight
    scaled by 1.001 before anything runs (the checks must then fail). ``zero_ok``: whether
    Megatron's ``MoELayer`` takes a 0-token input (:func:`zero_token_input_accepted`); when
    not, the 0-token decode steps run 1 token instead.

    Returns ``{"steps": {name: [tokens, error, bitwise]}, "t_max": the Buffer's T_max,
    "buffers": Buffers made, "train_errors": _compare's dict}``."""
    from megatron_mok.megatron import dispatcher as md

    h = _setup(world, backend_env)
    dev = _device()
    tol = GPU_TOL if dev.type == "cuda" else CPU_TOL
    try:
        E = 4 * world
        mok, a2a = _build_pair(h, world, dev, num_experts=E, topk=2, hidden=HIDDEN,
                               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        if mutant:
            _perturb_expert(a2a)
        gen = _generation(rank, mok, a2a, _steps(rank, zero_ok), dev, tol)
        buf = mok.token_dispatcher.buffer
        t_max = buf.max_tokens_per_rank
        want_t_max = max(PREFILL[r][0] * PREFILL[r][1] for r in range(world))
        assert t_max == want_t_max, (t_max, want_t_max)

        mok.train()
        a2a.train()
        x, gy = _inputs(rank, dev, HIDDEN)          # 8 x 3 = 24 tokens <= T_max
        run_m = _run_layer(mok, x, gy)
        run_a = _run_layer(a2a, x, gy)
        _nonzero(run_m)
        errs = _compare(rank, run_m, run_a, E // world, tol)
        assert mok.token_dispatcher.buffer is buf, "the training step made another Buffer"
        return {"steps": {k: list(v) for k, v in gen.items()}, "t_max": t_max,
                "buffers": len(md._BUFFERS), "train_errors": errs}
    finally:
        h.destroy_parallel()


def layer_small_first_dispatch(rank, world, backend_env=None, set_env=True):
    """The first dispatch a decode step (:data:`DECODE`'s first: T_max = the EP group's
    largest, 2 here), then a prefill larger than that on every rank: the dispatch raises a
    ``ValueError`` naming ``MOK_MAX_TOKENS_PER_RANK`` on each rank (before any communication
    of the call). In a world of one rank the layer still serves a decode step after it; in a
    larger one the error stopped the group's Buffer, and the decode step is refused naming the
    first error. Then, unless ``set_env=False`` (the mutant), ``MOK_MAX_TOKENS_PER_RANK`` = the largest
    prefill is set before a new pair is built (the dispatcher reads it when built): the same
    sequence -- decode first, then the prefills -- runs, within tolerance of alltoall.

    Returns ``{"error": the ValueError's message, "t_max": the env-sized Buffer's T_max,
    "steps": ...}``."""
    h = _setup(world, backend_env)
    dev = _device()
    tol = GPU_TOL if dev.type == "cuda" else CPU_TOL
    try:
        E = 4 * world
        kw = dict(num_experts=E, topk=2, hidden=HIDDEN,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        decode_first = [("decode0", (DECODE[rank][0], 1)), ("prefill", PREFILL[rank]),
                        ("decode1", (1, 1)), ("prefill2", PREFILL2[rank])]

        mok, a2a = _build_pair(h, world, dev, **kw)
        mok.eval()
        message = None
        with torch.no_grad():
            _forward(mok, _tokens(rank, 0, decode_first[0][1], dev))
            small = mok.token_dispatcher.buffer.max_tokens_per_rank
            assert small == max(DECODE[r][0] for r in range(world)), small
            try:
                _forward(mok, _tokens(rank, 1, PREFILL[rank], dev))
            except ValueError as e:
                message = str(e)
            assert message is not None, f"a {PREFILL[rank]} prefill passed a T_max={small} Buffer"
            assert "MOK_MAX_TOKENS_PER_RANK" in message and f"max_tokens_per_rank={small}" \
                in message, message
            x = _tokens(rank, 2, decode_first[2][1], dev)
            a2a.eval()
            if world == 1:
                # Nothing to stop without peers: the next decode step runs and agrees.
                _close("decode after the error", _forward(mok, x), _forward(a2a, x), tol)
            else:
                # The error stopped the EP group's Buffer; every later call names it.
                try:
                    _forward(mok, x)
                    refused = None
                except RuntimeError as e:
                    refused = str(e)
                assert refused is not None and f"stopped on rank {rank}" in refused \
                    and "MOK_MAX_TOKENS_PER_RANK" in refused, refused
        h.destroy_parallel()

        h = _setup(world, backend_env)           # pops MOK_MAX_TOKENS_PER_RANK
        largest = max(PREFILL[r][0] * PREFILL[r][1] for r in range(world))
        if set_env:
            os.environ["MOK_MAX_TOKENS_PER_RANK"] = str(largest)
        mok, a2a = _build_pair(h, world, dev, **kw)
        gen = _generation(rank, mok, a2a, decode_first, dev, tol)
        t_max = mok.token_dispatcher.buffer.max_tokens_per_rank
        assert t_max == largest, (t_max, largest)
        return {"error": message, "t_max": t_max, "steps": {k: list(v) for k, v in gen.items()}}
    finally:
        os.environ.pop("MOK_MAX_TOKENS_PER_RANK", None)
        h.destroy_parallel()


def layer_one_rank_over_t_max(rank, world, backend_env=None):
    """``MOK_MAX_TOKENS_PER_RANK`` = 22: rank 0's 24-token prefill (:data:`PREFILL`) is over it,
    rank 1's 20 tokens are not. Rank 0 raises the ``ValueError`` naming the knob; rank 1, in the
    same dispatch waiting for rank 0's routing, must raise at once (``MokDevicePeerStopped`` naming
    rank 0 on the CUDA backend, ``MokPeerStopped`` on the reference), not after its timeout. Returns ``(seconds, message)``."""
    import time

    h = _setup(world, backend_env)
    os.environ["MOK_MAX_TOKENS_PER_RANK"] = "22"
    dev = _device()
    try:
        kw = dict(num_experts=4 * world, topk=2, hidden=HIDDEN,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        mok, _ = _build_pair(h, world, dev, **kw)
        mok.eval()
        x = _tokens(rank, 1, PREFILL[rank], dev)
        t0 = time.monotonic()
        message = None
        with torch.no_grad():
            try:
                _forward(mok, x)
            except (ValueError, RuntimeError) as e:
                message = f"{type(e).__name__}: {e}"
        took = time.monotonic() - t0
        assert message is not None, f"rank {rank}: the dispatch passed"
        return took, message
    finally:
        os.environ.pop("MOK_MAX_TOKENS_PER_RANK", None)
        h.destroy_parallel()


def zero_token_input_accepted(rank, world):
    """Whether Megatron's ``MoELayer`` (alltoall, EP 1, no mok) takes a ``[0, 1, H]`` input in
    ``eval()`` / ``no_grad`` on this megatron-core: ``(True, output shape)`` or ``(False, the
    error)``. (0.16.1 and 0.19.2 on CPU: no -- the router's ``RouterGatingLinearFunction``
    reshapes its output with ``view(*shape[:-1], -1)``, ambiguous for 0 elements; the
    dispatcher is never reached.)"""
    h = _setup(1)
    try:
        torch.manual_seed(0)
        a2a = h.build_moe_layer(h.moe_config("alltoall", ep_size=1, num_experts=4, topk=2,
                                             hidden=HIDDEN, moe_router_load_balancing_type="none",
                                             moe_aux_loss_coeff=0.0),
                                pg_collection=h.single_rank_pg_collection())
        a2a.eval()
        try:
            with torch.no_grad():
                y = _forward(a2a, torch.zeros(0, 1, HIDDEN))
            return True, tuple(y.shape)
        except Exception as e:      # noqa: BLE001  (reported, not hidden)
            return False, f"{type(e).__name__}: {e}"
    finally:
        h.destroy_parallel()

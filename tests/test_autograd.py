"""Gradients (docs/CONTRACT.md, "Gradients").

Two kinds of check, at world sizes 1, 2 and 4:

- bitwise, against the oracle: the backward of dispatch is a combine of ``grad_tokens``
  (same order and rounding as the forward combine, both partial-dtype modes), the prob
  gradient of each row lands on its slot, and the backward of combine is a dispatch of
  ``grad_y``. The upstream gradients are seeded, so every rank knows every rank's.
- against a float64 autograd reference of dispatch -> expert -> combine (the expert scales
  each row by its prob and a per-expert factor, as Megatron's experts apply the probs).
  Tolerance, per tensor: ``2 * err_same + eps(dtype) / 2 * max|ref|``, where ``err_same`` is
  the max error of the same model written with plain torch ops in the test dtype (products
  in the dtype, sums in float32 rounded once; see ``oracle.pipeline_reference``): the
  flash-attention rule, no worse than twice a same-precision torch implementation. The
  second term (one rounding of the largest value) covers a baseline that happens to be
  exact. Seen: MoK's error is 0.5x-1.2x ``err_same``.
"""

import pytest
import torch

import oracle
from harness import (DTYPES, _buffer, assert_bitwise, contract_cases, run_distributed, seeded,
                     spec_inputs)

WORLD_SIZES = (1, 2, 4)
CASES = ("random", "t0_on_rank0", "unrouted_slots", "same_expert_twice", "experts_without_rows",
         "mixed", "k1", "e_equals_w_duplicates", "all_to_one_expert")


def _seeds(seed, world_size):
    return {"G": [seed * 31 + 1000 + d for d in range(world_size)],
            "P": [seed * 31 + 2000 + d for d in range(world_size)],
            "Gy": [seed * 31 + 3000 + s for s in range(world_size)],
            "EO": [seed * 31 + 4000 + d for d in range(world_size)]}


def _backward_bitwise(rank, world_size, name, seed):
    spec = contract_cases(world_size)[name]
    H, K = spec["H"], spec["K"]
    for di, dtype in enumerate(DTYPES):
        inputs = spec_inputs(spec, world_size, dtype, seed + di)
        routing = oracle.route(inputs, spec["E"])
        S = _seeds(seed + di, world_size)
        R = [rr.num_rows for rr in routing]
        T = [inp[0].shape[0] for inp in inputs]
        G = [seeded(S["G"][d], (R[d], H)) for d in range(world_size)]          # float32
        P = [seeded(S["P"][d], (R[d],)) for d in range(world_size)]
        Gy = [seeded(S["Gy"][s], (T[s], H)) for s in range(world_size)]
        EO = [seeded(S["EO"][d], (R[d], H), dtype) for d in range(world_size)]
        x0, idx, w0 = inputs[rank]
        for partial in (None, torch.float32):
            tag = f"[{name} {dtype} partial={partial} rank {rank}]"
            buf = _buffer(spec, dtype, "reference", partial)
            x = x0.clone().requires_grad_(True)
            w = w0.clone().requires_grad_(True)
            res = buf.dispatch(x, idx, w)
            eo = EO[rank].clone().requires_grad_(True)
            y = buf.combine(eo, res.handle)
            loss = ((res.tokens.float() * G[rank]).sum() + (res.probs * P[rank]).sum()
                    + (y.float() * Gy[rank]).sum())
            loss.backward()
            pd = dtype if partial is None else partial
            want_gx = oracle.expected_combine(routing, [g.to(dtype) for g in G], rank, T[rank], dtype, pd)
            assert_bitwise(x.grad, want_gx, f"grad_x {tag}")
            want_gw = oracle.expected_grad_topk_weights(routing, P, rank, T[rank], K)
            assert_bitwise(w.grad, want_gw, f"grad_topk_weights {tag}")
            want_geo = oracle.expected_dispatch_of(routing, [g.to(dtype) for g in Gy], rank)
            assert_bitwise(eo.grad, want_geo, f"grad_expert_out {tag}")
            # the forward of the combine, for good measure
            assert_bitwise(y, oracle.expected_combine(routing, EO, rank, T[rank], dtype, pd), f"y {tag}")
            buf.destroy()
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", CASES)
def test_backward_is_the_opposite_op_bitwise(name, world_size):
    assert run_distributed(_backward_bitwise, world_size, name, 300 + world_size) == [True] * world_size


def _row_scales(res, rank, world_size, num_experts):
    el = num_experts // world_size
    experts = torch.repeat_interleave(torch.arange(el) + rank * el, res.tokens_per_expert.cpu())
    return torch.tensor([oracle.expert_scale(int(e), num_experts) for e in experts],
                        dtype=torch.float32)


def _max_err(a, b):
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def _against_float64(rank, world_size, name, seed):
    spec = contract_cases(world_size)[name]
    E, H = spec["E"], spec["H"]
    report = {}
    for di, dtype in enumerate(DTYPES):
        inputs = spec_inputs(spec, world_size, dtype, seed + di)
        T = [inp[0].shape[0] for inp in inputs]
        Gy = [seeded(seed * 17 + s + 50 * di, (T[s], H)) for s in range(world_size)]
        ref = oracle.pipeline_reference(inputs, E, Gy, torch.float64)
        same = oracle.pipeline_reference(inputs, E, Gy, dtype)
        eps = torch.finfo(dtype).eps
        x0, idx, w0 = inputs[rank]
        for partial in (None, torch.float32):
            buf = _buffer(spec, dtype, "reference", partial)
            x = x0.clone().requires_grad_(True)
            w = w0.clone().requires_grad_(True)
            res = buf.dispatch(x, idx, w)
            scale = _row_scales(res, rank, world_size, E)
            eo = (res.tokens.float() * (res.probs * scale)[:, None]).to(dtype)
            y = buf.combine(eo, res.handle)
            (y.float() * Gy[rank]).sum().backward()
            for key, got in (("y", y), ("grad_x", x.grad), ("grad_topk_weights", w.grad)):
                want = ref[key][rank]
                err = _max_err(got, want)
                err_same = _max_err(same[key][rank], want)
                big = float(want.detach().abs().max()) if want.numel() else 0.0
                tol = 2 * err_same + eps / 2 * big
                assert err <= tol, (f"{key} [{name} {dtype} partial={partial} rank {rank}]: "
                                    f"max error {err:.3g} > tol {tol:.3g} (same-precision torch: "
                                    f"{err_same:.3g}, max|ref| {big:.3g})")
                report[f"{key} {dtype} {partial}"] = (err, tol, err_same)
            buf.destroy()
    return report


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ("random", "mixed", "same_expert_twice", "dsv3_like"))
def test_gradients_against_float64(name, world_size):
    reports = run_distributed(_against_float64, world_size, name, 700 + world_size)
    # the comparison saw real gradients (not all-zero tensors compared to zeros)
    assert any(err > 0 or tol > 0 for rep in reports for err, tol, _ in rep.values())


def _partial_requires_grad(rank, world_size):
    spec = contract_cases(world_size)["mixed"]
    dtype = torch.float32
    inputs = spec_inputs(spec, world_size, dtype, 5)
    routing = oracle.route(inputs, spec["E"])
    x0, idx, w0 = inputs[rank]
    T = [inp[0].shape[0] for inp in inputs]
    G = [seeded(90 + d, (routing[d].num_rows, spec["H"])) for d in range(world_size)]
    # only x needs a gradient
    buf = _buffer(spec, dtype, "reference")
    x = x0.clone().requires_grad_(True)
    res = buf.dispatch(x, idx, w0)
    (res.tokens * G[rank]).sum().backward()
    assert_bitwise(x.grad, oracle.expected_combine(routing, G, rank, T[rank], dtype, dtype), "grad_x only")
    # only topk_weights needs a gradient
    w = w0.clone().requires_grad_(True)
    res = buf.dispatch(x0, idx, w)
    P = [seeded(95 + d, (routing[d].num_rows,)) for d in range(world_size)]
    (res.probs * P[rank]).sum().backward()
    assert_bitwise(w.grad, oracle.expected_grad_topk_weights(routing, P, rank, T[rank], spec["K"]),
                   "grad_topk_weights only")
    # nothing needs a gradient: plain tensors out
    res = buf.dispatch(x0, idx, w0)
    assert not res.tokens.requires_grad and not res.probs.requires_grad
    return True


@pytest.mark.parametrize("world_size", (1, 2))
def test_partial_requires_grad(world_size):
    assert run_distributed(_partial_requires_grad, world_size) == [True] * world_size


def _calls_without_gradients(rank, world_size, backend="reference"):
    """A dispatch, a cached dispatch and a combine that need no gradient (under ``no_grad``, or
    with no input requiring one) call the backend without their autograd Functions (item 73:
    the Functions' host time), and give bitwise what the Functions' path gives. ``backend``
    "cuda": on the current GPU (``test_cuda_loopback.py`` runs it)."""
    from unittest import mock

    from megatron_mok import buffer as buffer_mod

    spec = contract_cases(world_size)["mixed"]
    dtype = torch.bfloat16
    device = "cuda" if backend == "cuda" else "cpu"
    x0, idx, w0 = spec_inputs(spec, world_size, dtype, 11, device=device)[rank]
    buf = _buffer(spec, dtype, backend, **({"device": "cuda"} if backend == "cuda" else {}))

    def calls(x, w):
        res = buf.dispatch(x, idx, w)
        cached = buf.dispatch(x, handle=res.handle).tokens
        y = buf.combine(res.tokens, res.handle)
        return [res.tokens, res.probs, res.tokens_per_expert, res.src_rank, res.src_token, cached, y]

    with_functions = calls(x0.clone().requires_grad_(True), w0.clone().requires_grad_(True))
    assert with_functions[0].grad_fn is not None and with_functions[-1].grad_fn is not None

    def refuse(*args, **kwargs):
        raise AssertionError("an autograd Function was used by a call that needs no gradient")

    with mock.patch.object(buffer_mod.DispatchFunction, "apply", refuse), \
            mock.patch.object(buffer_mod.CachedDispatchFunction, "apply", refuse), \
            mock.patch.object(buffer_mod.CombineFunction, "apply", refuse):
        with torch.no_grad():
            outs = [calls(x0.clone().requires_grad_(True), w0.clone().requires_grad_(True))]
        outs.append(calls(x0, w0))   # grad mode on, nothing requires a gradient
    for got in outs:
        for i, (a, b) in enumerate(zip(with_functions, got)):
            assert not b.requires_grad and b.grad_fn is None
            assert_bitwise(b, a.detach(), f"output {i} without the Functions")
    return True


@pytest.mark.parametrize("world_size", (1, 2))
def test_calls_without_gradients_skip_the_functions_bitwise(world_size):
    assert run_distributed(_calls_without_gradients, world_size) == [True] * world_size

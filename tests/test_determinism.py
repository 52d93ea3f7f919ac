"""Same inputs, same bits (docs/CONTRACT.md, "Determinism"): forward and backward, on one
Buffer called repeatedly, on fresh Buffers, and with other calls interleaved."""

import pytest
import torch

from harness import (DTYPES, _buffer, assert_same_results, contract_cases, full_pass,
                     run_distributed, spec_inputs)

REPEATS = 6


def _repeat(rank, world_size, name, seed):
    spec = contract_cases(world_size)[name]
    magnitude = 0.0
    for di, dtype in enumerate(DTYPES):
        inputs = spec_inputs(spec, world_size, dtype, seed + di)
        other = spec_inputs(spec, world_size, dtype, seed + 50 + di)
        for partial in (None, torch.float32):
            tag = f"[{name} {dtype} partial={partial} rank {rank}]"
            buf = _buffer(spec, dtype, "reference", partial)
            first = full_pass(buf, *inputs[rank], seed)
            magnitude += float(first["y"].float().abs().sum() + first["grad_x"].float().abs().sum())
            for i in range(REPEATS):
                if i % 2:
                    full_pass(buf, *other[rank], seed + 1)      # different call in between
                assert_same_results(full_pass(buf, *inputs[rank], seed), first, f"repeat {i} {tag}")
            buf.destroy()
            fresh = _buffer(spec, dtype, "reference", partial)
            assert_same_results(full_pass(fresh, *inputs[rank], seed), first, f"fresh Buffer {tag}")
            fresh.destroy()
    return magnitude


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("name", ("random", "mixed", "same_expert_twice"))
def test_bitwise_repeatable(name, world_size):
    magnitudes = run_distributed(_repeat, world_size, name, 11)
    assert all(m > 0 for m in magnitudes), "a rank computed only zeros: the check would be empty"


def _order_of_ranks_does_not_matter(rank, world_size, seed):
    """Ranks reach the call at different times; the result must not depend on who is first."""
    import time

    spec = contract_cases(world_size)["mixed"]
    inputs = spec_inputs(spec, world_size, torch.bfloat16, seed)
    results = []
    for delay_rank in range(world_size):
        buf = _buffer(spec, torch.bfloat16, "reference")
        if rank == delay_rank:
            time.sleep(0.2)
        results.append(full_pass(buf, *inputs[rank], seed))
        buf.destroy()
    for r in results[1:]:
        assert_same_results(r, results[0], f"arrival order, rank {rank}")
    return True


def test_arrival_order_does_not_matter():
    assert run_distributed(_order_of_ranks_does_not_matter, 2, 3) == [True, True]

"""``Buffer(expert_alignment=A)``: each local expert's rows followed by zero rows up to a
multiple of A (docs/CONTRACT.md, "Expert alignment"), checked as a pure relayout of the
unaligned dispatch, bitwise, forward and backward (``harness.check_alignment_case``).

CPU (gloo, reference backend) here, at world sizes 1-3; the CUDA backend runs the same check
against its unaligned self and the aligned reference in test_cuda_backend.py (2 GPUs, world
size 1) and test_cuda_loopback.py (2-3 ranks on one GPU)."""

import pytest
import torch

from harness import (ALIGNMENT_CASES, _buffer, check_alignment_case, contract_cases,
                     padded_row_positions, run_distributed)

SEED = 4321


def _aligned_reference(rank, world_size, name, alignment):
    spec = contract_cases(world_size)[name]
    return check_alignment_case(rank, world_size, spec, SEED + alignment, "reference", alignment,
                                static_extra=3)


@pytest.mark.parametrize("alignment", (16, 3))
@pytest.mark.parametrize("world_size", (1, 2, 3))
@pytest.mark.parametrize("name", ALIGNMENT_CASES)
def test_reference_alignment_is_a_relayout(name, world_size, alignment):
    gaps = run_distributed(_aligned_reference, world_size, name, alignment)
    if sum(contract_cases(world_size)[name]["T"]) == 0:
        assert sum(gaps) == 0
    if alignment == 16 and name in ("random", "all_to_one_expert", "k16_duplicates"):  # counts not multiples of 16
        assert sum(gaps) > 0, "no zero rows anywhere: the case would not test the padding"


def test_alignment_one_is_the_plain_layout():
    spec = contract_cases(1)["random"]
    assert check_alignment_case(0, 1, spec, SEED, "reference", 1) == 0


def test_padded_row_positions():
    pos, padded, R = padded_row_positions(torch.tensor([3, 0, 16, 1]), 4)
    assert pos.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert padded.tolist() == [4, 0, 16, 4] and R == 24


@pytest.mark.parametrize("bad", (0, -16, 1025, 2.0, True, "16"))
def test_bad_alignment_is_refused(bad):
    with pytest.raises(ValueError, match="expert_alignment"):
        _buffer(contract_cases(1)["random"], torch.float32, "reference", expert_alignment=bad)


def test_alignment_in_repr():
    buf = _buffer(contract_cases(1)["random"], torch.float32, "reference", expert_alignment=16)
    assert "expert_alignment=16" in repr(buf)

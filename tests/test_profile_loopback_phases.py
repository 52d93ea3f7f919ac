"""scripts/profile_loopback_phases.py's trace reading on CPU: a hand-made trace of 3 blocks."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

import profile_loopback_phases as plp  # noqa: E402


def _trace(starts, ends, phase_ends):
    tr = torch.zeros(256, 2, dtype=torch.int64)
    for b, (s, e) in enumerate(zip(starts, ends)):
        tr[b, 0], tr[b, 1] = s, e
    for b, p in enumerate(phase_ends):
        tr[plp._HALF + b, 1] = p
    return tr


def test_phases_are_relative_to_the_first_block_start():
    # Blocks start at 1000, 3000, 2000 ns; the last ends at 901000; phases end by 401000.
    tr = _trace([3000, 1000, 2000], [800000, 901000, 700000], [300000, 401000, 250000])
    produce, end = plp._phases(tr, 3)
    assert produce == 400.0 and end == 900.0


def test_a_call_that_did_not_run_phased_has_no_produce_phase():
    tr = _trace([0, 500], [10000, 12000], [7000])  # block 1 never marked a phase end
    assert plp._phases(tr, 2) == (None, 12.0)


def test_blocks_past_the_grid_are_ignored():
    tr = _trace([0, 0, 0], [1000, 2000, 99000], [500, 600, 99000])
    assert plp._phases(tr, 2) == (0.6, 2.0)

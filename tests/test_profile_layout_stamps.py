"""CPU checks of scripts/profile_layout_stamps.py: decoding the stamp words of a call."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import profile_layout_stamps as pls  # noqa: E402


def test_stamps_decode_per_region_block_and_step():
    words = [0] * 512
    words[0] = 1_000          # layout block 0 entry: the call's first stamp
    words[6] = 4_500          # layout block 0 count_ready
    words[16 + 11] = 9_000    # layout block 1 scan_end
    words[256 + 0] = 10_000   # fill block 0 entry
    words[256 + 16 + 5] = 12_250   # fill block 1 end
    got = pls.steps_of(words)
    assert got == {("layout", 0, "entry"): 0, ("layout", 0, "count_ready"): 3_500,
                   ("layout", 1, "scan_end"): 8_000, ("fill", 0, "entry"): 9_000,
                   ("fill", 1, "end"): 11_250}
    assert pls.steps_of([0] * 512) == {}


def test_medians_are_per_key_in_microseconds():
    calls = [{("fill", 0, "end"): 1000}, {("fill", 0, "end"): 3000}, {("fill", 0, "end"): 2000,
                                                                     ("layout", 0, "entry"): 0}]
    assert pls.medians(calls) == {("fill", 0, "end"): 2.0, ("layout", 0, "entry"): 0.0}

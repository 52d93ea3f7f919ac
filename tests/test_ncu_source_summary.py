"""scripts/ncu_source_summary.py on a small hand-made Nsight Compute source-page CSV."""

import csv
import gzip
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import ncu_source_summary as summary  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "# Samples", "Instructions Executed"]
ROWS = [
    ["0x0", "      LDC R1, c[0x0][0x28]", "5", "5", "5", "384"],
    ["0x10", "@!P1  LDGSTS.E.BYPASS.128 desc[UR40][R12.64], [R75]", "27", "0", "27", "113920"],
    ["0x20", "      FADD R67, R67, R74", "9", "0", "9", "229376"],
    ["0x30", "      FADD R65, R65, R76", "3", "0", "3", "229376"],
    ["0x40", "@P3   BRA 0x7f061020df60", "1", "1", "1", ""],
]


def _write(path, gz):
    opener = gzip.open if gz else open
    with opener(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "some_kernel"])
        w.writerow(HEADER)
        w.writerows(ROWS)


def test_summary_counts_opcodes_and_lists_hot_instructions(tmp_path):
    for gz in (False, True):
        path = str(tmp_path / ("s.csv.gz" if gz else "s.csv"))
        _write(path, gz)
        out = summary.summarise(path, min_executed=100000)
        assert out.splitlines()[0] == ("warp instructions executed: 573056; stall samples: 45; "
                                       "SASS instructions in the kernel: 5")
        mix = {line.split()[0]: line.split()[1] for line in out.splitlines()[3:6]}
        assert mix == {"FADD": "458752", "LDGSTS": "113920", "LDC": "384"}  # predicate and modifiers dropped
        hot = out.split("SASS\n")[1].splitlines()
        assert [h.split()[0] for h in hot] == ["1", "2", "3"]  # by index, address order; LDC below the bar
        assert "LDGSTS.E.BYPASS.128" in hot[0]

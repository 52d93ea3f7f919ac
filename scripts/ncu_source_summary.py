"""Summarise Nsight Compute's per-instruction counts of one kernel (developer tool).

    ncu --kernel-name regex:NAME --launch-count 1 --section SourceCounters -o REPORT <command>
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python scripts/ncu_source_summary.py source.csv [--min-executed 50000]

Prints the warp instructions executed and stall samples in all, the mix of opcodes (share of
instructions executed and of stall samples), and, in address order, every instruction executed
at least ``--min-executed`` times: where the kernel's hot loops are and what they spend on.
Accepts the CSV plain or gzipped. Used for benchmarks/NOTES.md #22 (run s6-2).
"""

import argparse
import collections
import csv
import gzip
import re


def _rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    # First line: the kernel's name; second: the column names.
    return rows[1], rows[2:]


def _opcode(sass):
    """'@!P1 LDGSTS.E.BYPASS.128 [R1], ...' -> 'LDGSTS' (the predicate and modifiers dropped)."""
    m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
    return (m.group(2) if m else sass.strip()).split(".")[0]


def summarise(path, min_executed=50000):
    header, data = _rows(path)
    col_exec = header.index("Instructions Executed")
    col_src = header.index("Source")
    col_stall = header.index("Warp Stall Sampling (All Samples)")
    count = lambda r, c: int(r[c] or 0)  # noqa: E731
    total = sum(count(r, col_exec) for r in data)
    stalls = sum(count(r, col_stall) for r in data)
    lines = [f"warp instructions executed: {total}; stall samples: {stalls}; "
             f"SASS instructions in the kernel: {len(data)}", "", "opcode       executed   share  stall-sample share"]
    executed, stalled = collections.Counter(), collections.Counter()
    for r in data:
        op = _opcode(r[col_src])
        executed[op] += count(r, col_exec)
        stalled[op] += count(r, col_stall)
    for op, n in executed.most_common(25):
        lines.append(f"{op:12s} {n:10d} {100 * n / max(total, 1):5.1f}%  {100 * stalled[op] / max(stalls, 1):5.1f}%")
    lines += ["", f"hot instructions (executed >= {min_executed} times), in address order: "
              "index, executed, stall samples, SASS"]
    for i, r in enumerate(data):
        if count(r, col_exec) >= min_executed:
            lines.append(f"{i:6d} {count(r, col_exec):9d} {r[col_stall]:>5s}  {r[col_src].strip()}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (plain or .gz)")
    ap.add_argument("--min-executed", type=int, default=50000)
    a = ap.parse_args()
    print(summarise(a.csv, a.min_executed))


if __name__ == "__main__":
    main()

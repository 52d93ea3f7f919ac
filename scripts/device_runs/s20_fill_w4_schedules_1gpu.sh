#!/usr/bin/env bash
# Run s20-3 (benchmarks/results/README.md): 1. the fill kernel's padding / zero-row stores as
# one helper (mark_no_source): the world-size-1 CUDA tests and, in shared-GPU mode, the W = 2
# alignment, rows_per_expert and static-shape tests (the rows it writes); 2. the alternative
# schedules at W = 4 in shared-GPU mode (never run: NOTES "after session 19" item 12), as far
# as LIMIT allows; $OUT/r/not_run.txt lists the rest for the next call.
#   bash scripts/device_runs/s20_fill_w4_schedules_1gpu.sh COMMIT [LIMIT_S]
C=${1:?commit}; LIMIT=${2:-330}
. "$(dirname "$0")/common.sh"
timeout -k 5 100 python3 -m pytest -q -p no:cacheprovider -m "not multigpu" tests/test_cuda_backend.py -rs > $R/cuda_w1.log 2>&1
echo "[CUDA tests, world size 1] rc=$?"; tail -1 $R/cuda_w1.log; grep -E "^(FAILED|ERROR)" $R/cuda_w1.log | head
export MOK_TEST_SHARED_GPU=1
python3 -m pytest --collect-only -q -m multigpu -k "(alignment or rows_per_expert or static) and not alternative" \
  tests/test_cuda_backend.py -p no:cacheprovider 2>/dev/null | grep "::" | grep -E -- "-2\]$|\[2\]$" > $R/fill_ids.txt
timeout -k 5 130 python3 -m pytest -q -p no:cacheprovider $(cat $R/fill_ids.txt) > $R/fill_w2.log 2>&1
echo "[W=2 alignment / rows_per_expert / static, $(wc -l < $R/fill_ids.txt) selected] rc=$?"; tail -1 $R/fill_w2.log; grep -E "^(FAILED|ERROR)" $R/fill_w2.log | head
python3 -m pytest --collect-only -q -m multigpu -k "alternative_schedules" tests/test_cuda_backend.py -p no:cacheprovider 2>/dev/null \
  | grep "::" | grep -E -- "-4\]$|\[4\]$" > $R/w4_ids.txt
timeout -k 10 $LIMIT python3 -m pytest -v -p no:cacheprovider --durations=5 $(cat $R/w4_ids.txt) > $R/w4_schedules.log 2>&1
echo "[W=4 alternative schedules] rc=$?"
grep -E "PASSED|FAILED|ERROR|SKIPPED" $R/w4_schedules.log | grep "::" | sed 's/ .*//' > $R/done.txt
grep -v -x -F -f $R/done.txt $R/w4_ids.txt > $R/not_run.txt
grep -cE " PASSED" $R/w4_schedules.log | sed 's/^/passed: /'; grep -E " FAILED| ERROR" $R/w4_schedules.log | head -20
echo "not run (time limit): $(wc -l < $R/not_run.txt)"; tail -4 $R/w4_schedules.log
cd $OUT && tar czf r.tgz r && rm -rf r

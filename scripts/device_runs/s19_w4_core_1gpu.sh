#!/usr/bin/env bash
# Run s19-8 (benchmarks/results/README.md): every W=4 "core" test in shared-GPU mode (four
# processes on one GPU) after the IPC memory fix (72e772f), the 1000-call ring wrap last.
C=${1:?commit}; LIMIT=${2:-300}
. "$(dirname "$0")/common.sh"
export MOK_TEST_SHARED_GPU=1
python3 -m pytest --collect-only -q -m multigpu -k "not alternative_schedules" tests/test_cuda_backend.py -p no:cacheprovider 2>/dev/null \
  | grep "::" | grep -E -- "-4\]$|\[4\]$" > $R/all_ids.txt
{ grep -v ring_wraps_1000 $R/all_ids.txt; grep ring_wraps_1000 $R/all_ids.txt; } > $R/ids.txt
timeout -k 10 $LIMIT python3 -m pytest -v -p no:cacheprovider --tb=short -rf --durations=10 $(cat $R/ids.txt) > $R/w4_core.log 2>&1
echo "rc=$? of $(wc -l < $R/ids.txt)"
grep -E "PASSED|FAILED|ERROR|SKIPPED" $R/w4_core.log | grep "::" | sed 's/ .*//' > $R/done.txt
grep -v -x -F -f $R/done.txt $R/ids.txt > $R/not_run.txt
grep -cE " PASSED" $R/w4_core.log | sed 's/^/passed: /'; grep -E " FAILED| ERROR" $R/w4_core.log | grep "::" | head
echo "not run (time limit): $(wc -l < $R/not_run.txt)"; cat $R/not_run.txt; tail -1 $R/w4_core.log
grep -E "^E " $R/w4_core.log | grep -v CudaIPC | head -20
cd $OUT && tar czf r.tgz r && rm -rf r

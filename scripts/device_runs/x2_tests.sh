#!/usr/bin/env bash
# The 2-GPU tests of tests/test_cuda_backend.py (and test_fp8_dispatch.py) in shards that fit one device call (each 2-GPU
# test spawns 2 processes: ~5-10 s apiece, ~180 tests at W=2 are ~25 min in all):
#
#   bash scripts/device_runs/x2_tests.sh COMMIT SELECT [SHARD NSHARDS] [LIMIT_S]
#
# SELECT: core (every 2-GPU test but the alternative-schedule ones), schedules (the
# alternative schedules x cases), rings (the alternative schedules' ring wraps), or a pytest
# -k expression. Runs every NSHARDS-th selected W=2 test from SHARD (0-based; default 0 1)
# under one time limit (default 540 s); writes $OUT/r/{ids,tests}.log and lists in
# $OUT/r/not_run.txt what the limit cut off, so the next call can take those first
# (pass SELECT=file:PATH with a list of node ids).
# WORLD=4 selects the 4-rank ids instead of the 2-rank ones. With MOK_TEST_SHARED_GPU=1 the
# ranks are processes sharing the GPUs there are (tests/harness.py): one GPU runs them all.
set -uo pipefail
C=${1:?commit}; SELECT=${2:?select}; SHARD=${3:-0}; NSHARDS=${4:-1}; LIMIT=${5:-540}
WORLD=${WORLD:-2}   # the world size whose test ids are selected (4: the 4-rank ids)
. "$(dirname "$0")/common.sh"
host_ops_build   # the C++ host ops for this machine's torch (NOTES items 75-76; ~30 s)
case "$SELECT" in
  core) K="not alternative_schedules" ;;
  schedules) K="alternative_schedules_match_reference" ;;
  rings) K="alternative_schedules_wrap_the_ring" ;;
  file:*) K= ;;
  *) K=$SELECT ;;
esac
if [ -z "$K" ]; then cp "${SELECT#file:}" $R/all_ids.txt
else
  world_ids "$K" $WORLD > $R/all_ids.txt
fi
awk -v s=$SHARD -v n=$NSHARDS '(NR - 1) % n == s' $R/all_ids.txt > $R/ids.txt
echo "$(wc -l < $R/ids.txt) of $(wc -l < $R/all_ids.txt) selected tests (shard $SHARD of $NSHARDS)"
MOK_TEST_EXIT_WATCHDOG_S=${MOK_TEST_EXIT_WATCHDOG_S:-60} timeout -k 10 $LIMIT python3 -m pytest -v -p no:cacheprovider $(cat $R/ids.txt) > $R/tests.log 2>&1
echo "tests rc=$?"
grep -E "PASSED|FAILED|ERROR|SKIPPED" $R/tests.log | grep "::" | sed 's/ .*//' > $R/done.txt
grep -v -x -F -f $R/done.txt $R/ids.txt > $R/not_run.txt
grep -cE " PASSED" $R/tests.log | sed 's/^/passed: /'
grep -E " FAILED| ERROR" $R/tests.log | head -20
echo "not run (time limit): $(wc -l < $R/not_run.txt)"
tail -3 $R/tests.log
cd $OUT && tar czf r.tgz r && rm -rf r

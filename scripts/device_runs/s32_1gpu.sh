#!/usr/bin/env bash
# Session 32's one-GPU call (benchmarks/NOTES.md, item 44, and the combine kernel's file split).
#
#   bash scripts/device_runs/s32_1gpu.sh COMMIT race      # (1)-(3)
#   bash scripts/device_runs/s32_1gpu.sh COMMIT combine [FUZZ_S]   # (4)-(5)
#
# (1) Item 41's loopback race test on both release schedules (release_at_end, release_per_task),
#     three times each, with this tree's library (rank 1's call time printed: it must outlast
#     rank 0's 10 ms timeout); then release_per_task with the re-read off
#     (MOK_DISPATCH_RECHECK=0; predicted to fail: rows of both calls, no error).
# (2) The mutation audit of the four mutants of items 41 and 43 (.mutants32, carried, built from
#     this tree): ce_recheck_skipped, ce_recheck_per_task_skipped, unfused_count_smem_not_raised,
#     create_chunk_smem_unchecked.
# (3) Item 37's selection (the lagging reader, the missing peer, the regression sample) and the
#     W = 2 error-path process tests on the shared GPU (MOK_TEST_SHARED_GPU=1).
# (4) The combine tests (W = 1 and loopback: every test whose id names combine, narrow, split,
#     phased, own_staged or the reference comparisons), on a library built from the split
#     csrc/kernels/combine/ files (the sm_90a code is byte-identical by construction; this is
#     the check that the build and the tests agree).
# (5) The fuzzer for FUZZ_S seconds (default 120).
C=${1:?commit}; PART=${2:?race|combine}; FUZZ=${3:-120}
. "$(dirname "$0")/common.sh"
if [ "$PART" = race ]; then
RACE="tests/test_cuda_loopback.py::test_loopback_reader_past_its_waits_never_returns_overwritten_rows_silently"
for sched in release_at_end release_per_task; do
  for i in 1 2 3; do
    timeout -k 10 120 python3 -m pytest -q -s -rfE "$RACE[$sched]" > $R/race_${sched}_$i.log 2>&1
    echo "[race $sched $i] rc=$?"; grep -E "rank 1's call|passed|failed" $R/race_${sched}_$i.log | cut -c1-200 | head -3
  done
done
MOK_DISPATCH_RECHECK=0 timeout -k 10 120 python3 -m pytest -q -s -rfE "$RACE[release_per_task]" > $R/race_per_task_off.log 2>&1
echo "[race release_per_task, MOK_DISPATCH_RECHECK=0] rc=$?"
grep -E "rank 1's call|passed|failed|silently" $R/race_per_task_off.log | cut -c1-200 | head -4
t0=$SECONDS
timeout -k 10 300 python3 scripts/mutation_audit_cuda.py run --libs .mutants32 --out $R/audit \
  --only ce_recheck_skipped,ce_recheck_per_task_skipped,unfused_count_smem_not_raised,create_chunk_smem_unchecked \
  --fuzz-seconds 0 > $R/audit.log 2>&1
echo "[audit] rc=$? in $((SECONDS - t0)) s"; tail -7 $R/audit.log
t0=$SECONDS
timeout -k 10 240 python3 -m pytest -q -rfE tests/test_cuda_backend.py tests/test_cuda_loopback.py \
  tests/test_fp8_dispatch.py -k "lagging or past_its_waits or missing_peer or one_rank or world_size_1 or (loopback_matches_reference and 3]) or loopback_static_shape or loopback_cached or (loopback_ring_wraps and 3-)" \
  --junitxml=$R/selection.xml > $R/selection.log 2>&1
echo "[selection] rc=$? in $((SECONDS - t0)) s"; tail -2 $R/selection.log; grep -E "FAILED|ERROR" $R/selection.log | head
t0=$SECONDS
world_ids "missing_peer or does_not_stall or one_rank_only or one_rank_in_place or (matches_reference and dsv3)" 2 \
  > $R/shared_gpu_ids.txt
MOK_TEST_SHARED_GPU=1 MOK_TEST_EXIT_WATCHDOG_S=60 timeout -k 10 150 python3 -m pytest -q -rfE -p no:cacheprovider \
  $(cat $R/shared_gpu_ids.txt) > $R/shared_gpu.log 2>&1
echo "[shared-GPU W=2 error paths] rc=$? in $((SECONDS - t0)) s"; tail -2 $R/shared_gpu.log; grep -E "FAILED|ERROR" $R/shared_gpu.log | head
else
t0=$SECONDS
timeout -k 10 420 python3 -m pytest -q -rfE -m "gpu and not multigpu" tests/test_cuda_backend.py tests/test_cuda_loopback.py \
  -k "combine or narrow or split or phased or own_staged or (matches_reference and not dsv3)" \
  --junitxml=$R/combine.xml > $R/combine.log 2>&1
echo "[combine tests] rc=$? in $((SECONDS - t0)) s"; tail -2 $R/combine.log; grep -E "FAILED|ERROR" $R/combine.log | head
fuzz $FUZZ fuzz
fi
cd $OUT && tar czf r_$PART.tgz r && rm -rf r

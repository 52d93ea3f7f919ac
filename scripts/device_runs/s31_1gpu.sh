#!/usr/bin/env bash
# Session 31's one-GPU calls (benchmarks/NOTES.md, items 41-43).
#
#   bash scripts/device_runs/s31_1gpu.sh COMMIT recheck [FUZZ_S]
#   bash scripts/device_runs/s31_1gpu.sh COMMIT chunks
#
# recheck: item 41's re-read before a copy-engine-staged call's release, and item 42's
#   stage_acquire_kernel barrier. (1) The new loopback test three times with this tree's library
#   (its call's time printed: it must outlast rank 0's 10 ms timeout), then once with the re-read
#   switched off (MOK_DISPATCH_RECHECK=0; predicted to fail: rows of both calls, no error);
#   (2) the mutation audit of stage_poison_skipped and ce_recheck_skipped (.mutants31, carried,
#   built from this tree); (3) item 37's selection (the lagging reader, the missing peer, the
#   regression sample); (4) the W = 2 error-path process tests, two processes sharing the GPU
#   over CUDA IPC (MOK_TEST_SHARED_GPU=1), where the staging check and the re-read run; (5) the
#   fuzzer for FUZZ_S seconds (default 90).
#
# chunks: item 43's loopback test (2048-token chunks, fused and unfused layout) with this tree's
#   library, then with .base_lib's (carried), where the unfused case is predicted to fail.
C=${1:?commit}; PART=${2:?recheck|chunks}
. "$(dirname "$0")/common.sh"
NEW_TEST="tests/test_cuda_loopback.py::test_loopback_reader_past_its_waits_never_returns_overwritten_rows_silently"
case "$PART" in
  recheck)
    FUZZ=${3:-90}
    for i in 1 2 3; do
      timeout -k 10 120 python3 -m pytest -q -s -rfE "$NEW_TEST" > $R/recheck_$i.log 2>&1
      echo "[new test $i] rc=$?"; grep -E "rank 1's call|passed|failed" $R/recheck_$i.log | head -4
    done
    MOK_DISPATCH_RECHECK=0 timeout -k 10 120 python3 -m pytest -q -s -rfE "$NEW_TEST" > $R/recheck_off.log 2>&1
    echo "[new test, MOK_DISPATCH_RECHECK=0] rc=$?"; grep -E "rank 1's call|passed|failed|silently" $R/recheck_off.log | head -4
    t0=$SECONDS
    timeout -k 10 240 python3 scripts/mutation_audit_cuda.py run --libs .mutants31 --out $R/audit \
      --only stage_poison_skipped,ce_recheck_skipped --fuzz-seconds 0 > $R/audit.log 2>&1
    echo "[audit] rc=$? in $((SECONDS - t0)) s"; tail -6 $R/audit.log
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
    fuzz $FUZZ fuzz
    ;;
  chunks)
    # Item 43: 2048-token chunks (64 KiB of count tables), fused and unfused layout, with this
    # tree's library and with .base_lib's (carried; its unfused layout never asked for > 48 KiB).
    BASE_LIB=$PWD/.base_lib/libmok_cuda.so
    for v in new base; do
      with_lib $v timeout -k 10 200 python3 -m pytest -q -rfE tests/test_cuda_loopback.py \
        -k chunks_past_48k > $R/chunks_$v.log 2>&1
      echo "[chunks $v] rc=$?"; tail -2 $R/chunks_$v.log; grep -E "FAILED|invalid argument" $R/chunks_$v.log | head -4
    done
    ;;
esac
cd $OUT && tar czf r_$PART.tgz r && rm -rf r

#!/usr/bin/env bash
# Session 23 on one H200 (benchmarks/results/README.md, "Session 23"):
#
#   bash scripts/device_runs/s23_1gpu.sh COMMIT check    # s23-3: tests, kernel profile, suite rows
#   bash scripts/device_runs/s23_1gpu.sh COMMIT ab       # s23-4: #56's A/B measured like for like
#   bash scripts/device_runs/s23_1gpu.sh COMMIT final    # s23-5: small calls, tests/megatron
#   bash scripts/device_runs/s23_1gpu.sh COMMIT cached   # branch wip/cached-row-check (not run yet)
#
# check: the row-size check across ranks (NOTES item 20, C ABI 13: every rank must raise, none
# hang, loopback eager/static and W = 2 processes sharing the GPU) and the prob-gradient-only
# combine of the FP8 dispatch's backward (NOTES #56, C ABI 14: bitwise the full combine's, phased,
# role split and ring wraps) with the rest of the FP8 GPU tests; the CUDA regression sample of
# session 22 (the combine's signature changed); the kernels of the FP8 backward beside a full
# zero-rows combine (#56's prediction); the suite's mok / mok_fp8 rows at W = 1 (d-bwd, and the
# same run's dispatch_bwd_full_combine_us in the JSON).
# ab: the kernel profile with every call waited for (s23-3's back-to-back calls overlapped under
# programmatic dependent launch), once more with MOK_PDL=0 as a cross-check, and the suite's
# mok_fp8 rows with both backwards called on the backend directly (no autograd time).
# final: NOTES item 18's host-path trims (caf584f) measured: bench_small_batch.py with bf16 and FP8
# dispatches at 128 / 512 tokens, W = 1; then every tests/megatron test one GPU runs, on
# megatron-core 0.19.2 (the combine's new argument under the Megatron dispatcher).
# cached (NOTES item 23 after session 23): the row size carried in each dispatch ring slot's ready
# value. Carry megatron_mok/_lib (the branch's build) and .base_lib/ (main's build:
# `make -C csrc -s OUT=../.base_lib` on a checkout of main): the one-rank-only tests (routed and
# cached, loopback and W = 2 processes sharing the GPU), the FP8 tests, the CUDA regression
# sample, then loopback W = 2 graph-replayed dispatches at 4096 tokens, main's library and the
# branch's alternating twice (the prediction: no measurable cost).
C=${1:?commit}; PART=${2:?check, ab, final or cached}
. "$(dirname "$0")/common.sh"
if [ "$PART" = check ]; then
  timeout -k 5 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short --durations=5 \
    tests/test_fp8_dispatch.py tests/test_cuda_library_abi.py > $R/fp8_tests.log 2>&1
  echo "[fp8 GPU tests] rc=$?"; grep -cE " PASSED" $R/fp8_tests.log; grep -E " FAILED| ERROR" $R/fp8_tests.log | head -20
  grep -E "prob_grads|one_rank_only" $R/fp8_tests.log | head -20; grep -E "^E " $R/fp8_tests.log | head -20; tail -2 $R/fp8_tests.log
  MOK_TEST_SHARED_GPU=1 timeout -k 5 120 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py -k "test_cuda_fp8 and not world_size_1" > $R/fp8_shared.log 2>&1
  echo "[fp8 W=2 shared GPU] rc=$?"; grep -E " PASSED| FAILED| ERROR|SKIPPED \[" $R/fp8_shared.log | head; grep -E "^E " $R/fp8_shared.log | head
  timeout -k 5 60 python3 scripts/profile_kernels_1gpu.py --fp8 --tokens 4096,128 > $R/fp8_kernels.log 2>&1
  echo "[fp8 kernels, W=1] rc=$?"; grep -E "^T=|^  " $R/fp8_kernels.log | head -70
  timeout -k 5 110 python3 benchmarks/bench_dispatch_combine.py --nproc 1 --shapes dsv3,t8192,t512,t128 \
    --systems mok,mok_fp8 --out $R/bench > $R/bench.log 2>&1
  echo "[suite mok / mok_fp8, W=1] rc=$?"; grep -A12 "^SUMMARY" $R/bench.log; grep "prob gradients only" $R/bench.log
  timeout -k 5 150 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    -k "world_size_1 or (loopback_matches_reference and 3]) or loopback_static_shape or loopback_cached or loopback_graph or (loopback_ring_wraps and 3-) or loopback_expert_alignment or loopback_rows_per_expert" \
    > $R/cuda_regression.log 2>&1
  echo "[CUDA regression sample] rc=$?"; grep -cE " PASSED" $R/cuda_regression.log; grep -E " FAILED| ERROR" $R/cuda_regression.log | head -20; tail -2 $R/cuda_regression.log
elif [ "$PART" = ab ]; then
  timeout -k 5 60 python3 scripts/profile_kernels_1gpu.py --fp8 --tokens 4096,512,128 > $R/fp8_kernels.log 2>&1
  echo "[fp8 kernels, W=1, calls waited for] rc=$?"; grep -E "^T=|^  " $R/fp8_kernels.log | head -80
  MOK_PDL=0 timeout -k 5 60 python3 scripts/profile_kernels_1gpu.py --fp8 --tokens 4096 > $R/fp8_kernels_nopdl.log 2>&1
  echo "[fp8 kernels, W=1, MOK_PDL=0] rc=$?"; grep -E "^T=|^  " $R/fp8_kernels_nopdl.log | head -30
  timeout -k 5 150 python3 benchmarks/bench_dispatch_combine.py --nproc 1 --shapes dsv3,h4096,t8192,t512,t128 \
    --systems mok,mok_fp8 --out $R/bench > $R/bench.log 2>&1
  echo "[suite mok / mok_fp8, W=1] rc=$?"; grep -A14 "^SUMMARY" $R/bench.log; grep "mok_fp8 dispatch bwd" $R/bench.log
elif [ "$PART" = final ]; then
  for mode in bf16 fp8; do
    flag=; [ $mode = fp8 ] && flag=--fp8
    timeout -k 5 90 python3 benchmarks/bench_small_batch.py --out $R/small_$mode --tokens 128,512 \
      --worlds 1 --iters 50 --warmup 10 $flag > $R/small_$mode.log 2>&1
    echo "[small batch $mode] rc=$?"; grep -E "^\| " $R/small_$mode.log
  done
  install_wheels .whl /tmp/site19 || exit 1
  PYTHONPATH=/tmp/site19 timeout -k 5 ${3:-280} python3 -m pytest -q -p no:cacheprovider tests/megatron -rs \
    > $R/megatron_tests_019.log 2>&1
  echo "[tests/megatron 0.19.2] rc=$?"; tail -2 $R/megatron_tests_019.log
  grep -E "^(FAILED|ERROR)|Error:" $R/megatron_tests_019.log | head
elif [ "$PART" = cached ]; then
  BASE_LIB=$PWD/.base_lib/libmok_cuda.so
  timeout -k 5 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py tests/test_cuda_library_abi.py > $R/fp8_tests.log 2>&1
  echo "[fp8 GPU tests] rc=$?"; grep -cE " PASSED" $R/fp8_tests.log; grep -E " FAILED| ERROR" $R/fp8_tests.log | head -20
  grep -E "one_rank_only" $R/fp8_tests.log | head; grep -E "^E " $R/fp8_tests.log | head -20; tail -2 $R/fp8_tests.log
  MOK_TEST_SHARED_GPU=1 timeout -k 5 120 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py -k "test_cuda_fp8 and not world_size_1" > $R/fp8_shared.log 2>&1
  echo "[fp8 W=2 shared GPU] rc=$?"; grep -E " PASSED| FAILED| ERROR|SKIPPED \[" $R/fp8_shared.log | head; grep -E "^E " $R/fp8_shared.log | head
  timeout -k 5 150 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    -k "world_size_1 or (loopback_matches_reference and 3]) or loopback_static_shape or loopback_cached or loopback_graph or (loopback_ring_wraps and 3-) or loopback_expert_alignment or loopback_rows_per_expert" \
    > $R/cuda_regression.log 2>&1
  echo "[CUDA regression sample] rc=$?"; grep -cE " PASSED" $R/cuda_regression.log; grep -E " FAILED| ERROR" $R/cuda_regression.log | head -20; tail -2 $R/cuda_regression.log
  for i in 1 2; do
    for v in base new; do
      with_lib $v timeout -k 5 60 python3 benchmarks/bench_small_batch.py --out $R/small_${v}_$i --tokens 4096 \
        --worlds 2 --iters 50 --warmup 10 > $R/small_${v}_$i.log 2>&1
      echo "[small batch W=2 loopback, $v lib, round $i] rc=$?"; grep -E "^\| 2 " $R/small_${v}_$i.log
    done
  done
fi
cd $OUT && tar czf r.tgz r && rm -rf r

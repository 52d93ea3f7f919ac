#!/usr/bin/env bash
# Runs s22-1, s22-4..s22-8 (benchmarks/results/README.md): the FP8 dispatch (megatron_mok/fp8.py,
# C ABI 11, 12 with the pack kernel) on one H200, in calls that fit the 10-minute limit:
#
#   bash scripts/device_runs/s22_fp8_1gpu.sh COMMIT fp8          # s22-1, s22-4, s22-6, s22-8 (a)
#   bash scripts/device_runs/s22_fp8_1gpu.sh COMMIT regression   # s22-5
#   bash scripts/device_runs/s22_fp8_1gpu.sh COMMIT graphs       # s22-7, s22-8 (b)
#
# fp8: its GPU tests (world size 1, loopback ranks 2-4, each dispatch schedule, ring
# wrap-arounds; W = 2 as processes sharing the GPU), then the suite's mok and mok_fp8 rows at
# W = 1 (NOTES #55's prediction: the transfer scales with the bytes) and (from s22-6) the kernels and
# host ops of bf16 vs FP8 dispatches (scripts/profile_kernels_1gpu.py --fp8). regression: a sample of
# the CUDA tests, since every dispatch now passes its row size to the library, after the FP8
# kernel profile (scripts/profile_kernels_1gpu.py --fp8) and the suite's rows again. graphs:
# bench_small_batch.py with bf16 and FP8 dispatches at 128, 512, 4096 tokens, W = 1 and 2
# loopback ranks: host-inclusive eager / static calls and device-only graph replays.
C=${1:?commit}; PART=${2:?fp8, regression or graphs}; LIMIT=${3:-330}
. "$(dirname "$0")/common.sh"
if [ "$PART" = graphs ]; then   # device-only times (CUDA-graph replays) of bf16 vs FP8
  for mode in bf16 fp8; do
    flag=; [ $mode = fp8 ] && flag=--fp8
    timeout -k 5 140 python3 benchmarks/bench_small_batch.py --out $R/small_$mode --tokens 128,512,4096 \
      --worlds 1,2 --iters 50 --warmup 10 $flag > $R/small_$mode.log 2>&1
    echo "[small batch $mode] rc=$?"; grep -E "^\| " $R/small_$mode.log
  done
elif [ "$PART" = fp8 ]; then
  timeout -k 5 220 python3 -m pytest -v -p no:cacheprovider -rs --tb=short --durations=5 \
    tests/test_fp8_dispatch.py tests/test_cuda_library_abi.py > $R/fp8_tests.log 2>&1
  echo "[fp8 GPU tests] rc=$?"; grep -cE " PASSED" $R/fp8_tests.log; grep -E " FAILED| ERROR|SKIPPED \[" $R/fp8_tests.log | head -20
  grep -E "^E " $R/fp8_tests.log | head -20; tail -2 $R/fp8_tests.log
  MOK_TEST_SHARED_GPU=1 timeout -k 5 90 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py -k "test_cuda_fp8_dispatch and not world_size_1" > $R/fp8_shared.log 2>&1
  echo "[fp8 W=2 shared GPU] rc=$?"; grep -E " PASSED| FAILED| ERROR|SKIPPED \[" $R/fp8_shared.log | head; grep -E "^E " $R/fp8_shared.log | head
  timeout -k 5 230 python3 benchmarks/bench_dispatch_combine.py --nproc 1 --shapes dsv3,h4096,t8192,t512,t128 \
    --systems mok,mok_fp8 --sm-sweep 24 --out $R/bench > $R/bench.log 2>&1
  echo "[suite mok / mok_fp8, W=1] rc=$?"; grep -A16 "^SUMMARY" $R/bench.log
  timeout -k 5 60 python3 scripts/profile_kernels_1gpu.py --fp8 --tokens 4096,128 --host > $R/fp8_kernels.log 2>&1
  echo "[fp8 kernels, W=1] rc=$?"; grep -E "^T=|^  |aten::|Function" $R/fp8_kernels.log | head -60
else
  timeout -k 5 60 python3 scripts/profile_kernels_1gpu.py --fp8 --tokens 4096,128 --host > $R/fp8_kernels.log 2>&1
  echo "[fp8 kernels, W=1] rc=$?"; grep -E "^T=|^  " $R/fp8_kernels.log | head -80
  timeout -k 5 100 python3 benchmarks/bench_dispatch_combine.py --nproc 1 --shapes dsv3,h4096,t8192,t512,t128 \
    --systems mok,mok_fp8 --sm-sweep 24 --out $R/bench > $R/bench.log 2>&1
  echo "[suite mok / mok_fp8, W=1, after the host-path cleanup] rc=$?"; grep -A16 "^SUMMARY" $R/bench.log
  timeout -k 5 $LIMIT python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    -k "world_size_1 or (loopback_matches_reference and 3]) or loopback_static_shape or loopback_cached or loopback_graph or (loopback_ring_wraps and 3-) or loopback_expert_alignment or loopback_rows_per_expert" \
    > $R/cuda_regression.log 2>&1
  echo "[CUDA regression sample] rc=$?"; grep -cE " PASSED" $R/cuda_regression.log; grep -E " FAILED| ERROR" $R/cuda_regression.log | head -20; tail -2 $R/cuda_regression.log
fi
cd $OUT && tar czf r.tgz r && rm -rf r

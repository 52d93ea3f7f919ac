#!/usr/bin/env bash
# Session 24 on one H200 (benchmarks/results/README.md, "Session 24"):
#
#   bash scripts/device_runs/s24_1gpu.sh COMMIT first    # s24-1
#   bash scripts/device_runs/s24_1gpu.sh COMMIT host     # s24-2, s24-3
#   bash scripts/device_runs/s24_1gpu.sh COMMIT fp8src   # s24-4
#   bash scripts/device_runs/s24_1gpu.sh COMMIT fuzz [SECONDS]
#   bash scripts/device_runs/s24_1gpu.sh COMMIT recheck  # s24-5
#   bash scripts/device_runs/s24_1gpu.sh COMMIT fp8tests # s24-6
#
# first: (a) branch wip/cached-row-check (NOTES item 23 after session 23): the row size carried
# in each dispatch ring slot's ready value. Carry megatron_mok/_lib (the branch's build) and
# .base_lib/ (main's build: `make -C csrc -s OUT=../.base_lib` on a checkout of main): the FP8
# tests with the one-rank-only tests (routed and cached, loopback and W = 2 processes sharing the
# GPU), the CUDA regression sample, then loopback W = 2 dispatches at 4096 tokens with main's
# library and the branch's alternating twice (prediction: no measurable cost).
# (b) NOTES item 18: bf16 and FP8 small calls alternating in one process (--fp8-ab).
# (c) NOTES item 22: the prob-gradient-only combine under MOK_COMBINE_STREAM_OWN=0 and
# MOK_COMBINE_TOKEN_RUNS=0 beside the default (prediction: STREAM_OWN=0 84 -> 45-60 us).
# host: where a small FP8 (and bf16) static dispatch's host time goes (scripts/profile_fp8_host.py:
# each part timed alone in alternating blocks, then cProfile), W = 1, 128 and 512 tokens.
# fp8src: NOTES #57 (the FP8 pair read in place from two sources, no pack; C ABI 15): the FP8 GPU
# tests (in place vs packed bitwise, the one-source / two-source mismatch), shared-GPU W = 2, the
# CUDA regression sample (the bf16 path through the changed kernel); then the A/B: the kernel
# profile and bench_small_batch.py --fp8 (W = 1, 128 / 512 / 4096 tokens) with MOK_FP8_PACK=1
# (the pack, as before) and without, alternating; profile_fp8_host.py's split once more.
# recheck: after s24-4's fix (a rank without tokens tagged its ring slots as one source): the FP8
# GPU tests and shared-GPU W = 2 again, profile_fp8_host.py with the in-place variants, and a
# short fuzz run (120 s).
# fuzz: scripts/fuzz_dispatch.py, the CUDA backend against the reference on random configurations.
C=${1:?commit}; PART=${2:?first, host, fp8src, fuzz, recheck or fp8tests}
. "$(dirname "$0")/common.sh"
if [ "$PART" = first ]; then
  BASE_LIB=$PWD/.base_lib/libmok_cuda.so
  timeout -k 5 150 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py tests/test_cuda_library_abi.py > $R/fp8_tests.log 2>&1
  echo "[fp8 GPU tests] rc=$?"; grep -cE " PASSED" $R/fp8_tests.log; grep -E " FAILED| ERROR" $R/fp8_tests.log | head -20
  grep -E "one_rank_only" $R/fp8_tests.log | head; grep -E "^E " $R/fp8_tests.log | head -20; tail -2 $R/fp8_tests.log
  MOK_TEST_SHARED_GPU=1 timeout -k 5 80 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py -k "test_cuda_fp8 and not world_size_1" > $R/fp8_shared.log 2>&1
  echo "[fp8 W=2 shared GPU] rc=$?"; grep -E " PASSED| FAILED| ERROR|SKIPPED \[" $R/fp8_shared.log | head; grep -E "^E " $R/fp8_shared.log | head
  timeout -k 5 90 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    -k "world_size_1 or (loopback_matches_reference and 3]) or loopback_static_shape or loopback_cached or loopback_graph or (loopback_ring_wraps and 3-) or loopback_expert_alignment or loopback_rows_per_expert" \
    > $R/cuda_regression.log 2>&1
  echo "[CUDA regression sample] rc=$?"; grep -cE " PASSED" $R/cuda_regression.log; grep -E " FAILED| ERROR" $R/cuda_regression.log | head -20; tail -2 $R/cuda_regression.log
  for i in 1 2; do
    for v in base new; do
      with_lib $v timeout -k 5 45 python3 benchmarks/bench_small_batch.py --out $R/small_${v}_$i --tokens 4096 \
        --worlds 2 --iters 50 --warmup 10 > $R/small_${v}_$i.log 2>&1
      echo "[small batch W=2 loopback 4096, $v lib, round $i] rc=$?"; grep -E "^\| 2 " $R/small_${v}_$i.log
    done
  done
  timeout -k 5 100 python3 benchmarks/bench_small_batch.py --fp8-ab --out $R/fp8_ab --tokens 128,512 \
    --worlds 1,2 --iters 50 --warmup 10 > $R/fp8_ab.log 2>&1
  echo "[small batch --fp8-ab] rc=$?"; grep -E "^\| |^#" $R/fp8_ab.log | head -40; tail -3 $R/fp8_ab.log
  for env in "" MOK_COMBINE_STREAM_OWN=0 MOK_COMBINE_TOKEN_RUNS=0 "MOK_COMBINE_STREAM_OWN=0 MOK_COMBINE_TOKEN_RUNS=0"; do
    tag=$(echo "${env:-default}" | tr ' =' '__')
    env $env timeout -k 5 40 python3 scripts/profile_kernels_1gpu.py --fp8 --tokens 4096 > $R/narrow_$tag.log 2>&1
    echo "[fp8 kernels 4096, $env] rc=$?"; grep -E "^T=|^  " $R/narrow_$tag.log | head -24
  done
elif [ "$PART" = host ]; then
  timeout -k 5 240 python3 scripts/profile_fp8_host.py --out $R/fp8_host --tokens 128 --commit $C \
    > $R/fp8_host.log 2>&1
  echo "[fp8 host profile] rc=$?"; cat $R/fp8_host.log | cut -c1-150 | head -150
elif [ "$PART" = fp8src ]; then
  timeout -k 5 150 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py tests/test_cuda_library_abi.py > $R/fp8_tests.log 2>&1
  echo "[fp8 GPU tests] rc=$?"; grep -cE " PASSED" $R/fp8_tests.log; grep -E " FAILED| ERROR" $R/fp8_tests.log | head -20
  grep -E "in_place|sources|one_rank_only" $R/fp8_tests.log | head -20; grep -E "^E " $R/fp8_tests.log | head -20; tail -2 $R/fp8_tests.log
  MOK_TEST_SHARED_GPU=1 timeout -k 5 60 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py -k "test_cuda_fp8 and not world_size_1" > $R/fp8_shared.log 2>&1
  echo "[fp8 W=2 shared GPU] rc=$?"; grep -E " PASSED| FAILED| ERROR|SKIPPED \[" $R/fp8_shared.log | head; grep -E "^E " $R/fp8_shared.log | head
  timeout -k 5 90 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    -k "world_size_1 or (loopback_matches_reference and 3]) or loopback_static_shape or loopback_cached or loopback_graph or (loopback_ring_wraps and 3-) or loopback_expert_alignment or loopback_rows_per_expert or launch_launches_nothing or one_call_dispatch" \
    > $R/cuda_regression.log 2>&1
  echo "[CUDA regression sample] rc=$?"; grep -cE " PASSED" $R/cuda_regression.log; grep -E " FAILED| ERROR" $R/cuda_regression.log | head -20; tail -2 $R/cuda_regression.log
  for v in pack src; do
    e=; [ $v = pack ] && e=MOK_FP8_PACK=1
    env $e timeout -k 5 40 python3 scripts/profile_kernels_1gpu.py --fp8 --tokens 4096 > $R/kernels_$v.log 2>&1
    echo "[fp8 kernels 4096, $v] rc=$?"; grep -E "^T=|^  " $R/kernels_$v.log | grep -A3 "fp8 cached\|fp8 eager" | head -14
  done
  for i in 1 2; do
    for v in pack src; do
      e=; [ $v = pack ] && e=MOK_FP8_PACK=1
      env $e timeout -k 5 50 python3 benchmarks/bench_small_batch.py --fp8 --out $R/small_${v}_$i --tokens 128,512,4096 \
        --worlds 1 --iters 50 --warmup 10 > $R/small_${v}_$i.log 2>&1
      echo "[small batch fp8 W=1, $v, round $i] rc=$?"; grep -E "^\| 1 " $R/small_${v}_$i.log
    done
  done
  timeout -k 5 60 python3 scripts/profile_fp8_host.py --out $R/fp8_host --tokens 128 --commit $C > $R/fp8_host.log 2>&1
  echo "[fp8 host profile] rc=$?"; grep -E "^  |^T=" $R/fp8_host.log | head -20
elif [ "$PART" = recheck ]; then
  timeout -k 5 170 python3 -m pytest -v -p no:cacheprovider -rs --tb=short -x \
    tests/test_fp8_dispatch.py tests/test_cuda_library_abi.py > $R/fp8_tests.log 2>&1
  echo "[fp8 GPU tests] rc=$?"; grep -cE " PASSED" $R/fp8_tests.log; grep -E " FAILED| ERROR" $R/fp8_tests.log | head -20
  grep -E "in_place|sources" $R/fp8_tests.log | head -20; grep -E "^E " $R/fp8_tests.log | head -20; tail -2 $R/fp8_tests.log
  MOK_TEST_SHARED_GPU=1 timeout -k 5 70 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py -k "test_cuda_fp8 and not world_size_1" > $R/fp8_shared.log 2>&1
  echo "[fp8 W=2 shared GPU] rc=$?"; grep -E " PASSED| FAILED| ERROR|SKIPPED \[" $R/fp8_shared.log | head; grep -E "^E " $R/fp8_shared.log | head
  timeout -k 5 50 python3 scripts/profile_fp8_host.py --out $R/fp8_host --tokens 128 --commit $C > $R/fp8_host.log 2>&1
  echo "[fp8 host profile] rc=$?"; grep -E "^  |^T=" $R/fp8_host.log | head -20
  timeout -k 10 200 python3 scripts/fuzz_dispatch.py --device cuda --seconds 110 --max-world 4 \
    --out $R/fuzz --seed 24 > $R/fuzz.log 2>&1
  echo "[fuzz] rc=$?"; tail -6 $R/fuzz.log
elif [ "$PART" = fp8tests ]; then  # every FP8 GPU test (s24-5 stopped at its first failure, a test's own bug)
  timeout -k 5 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py tests/test_cuda_library_abi.py > $R/fp8_tests.log 2>&1
  echo "[fp8 GPU tests] rc=$?"; grep -cE " PASSED" $R/fp8_tests.log; grep -E " FAILED| ERROR" $R/fp8_tests.log | head -20
  grep -E "in_place|wraps|schedules" $R/fp8_tests.log | head -20; grep -E "^E " $R/fp8_tests.log | head -20; tail -2 $R/fp8_tests.log
elif [ "$PART" = fuzz ]; then
  timeout -k 10 $((${3:-240} + 90)) python3 scripts/fuzz_dispatch.py --device cuda --seconds ${3:-240} --max-world 4 \
    --out $R/fuzz --seed 24 > $R/fuzz.log 2>&1
  echo "[fuzz] rc=$?"; grep -E "cases|fail|FAIL" $R/fuzz.log | tail -20; tail -5 $R/fuzz.log
fi
cd $OUT && tar czf r.tgz r && rm -rf r

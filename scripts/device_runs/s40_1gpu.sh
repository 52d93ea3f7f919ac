#!/usr/bin/env bash
# Session 40's one-GPU calls (benchmarks/NOTES.md, items 65, 66 and 68).
#
#   bash scripts/device_runs/s40_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#     PARTS: any of alloc exit stopnote sample megatron regress isolated hostprof
#
# alloc     item 66: a rank short of memory stops every rank in the same words (2 processes sharing
#           the GPU, rank 1's allocator capped), then both make a Buffer and dispatch; item 65: ranks
#           with different staging settings refuse together before allocating; item 63's layout
#           agreement tests.
# exit      item 68: a rank whose process exits with an uncaught exception stops its peer (two real
#           processes sharing the GPU, tests/test_exit_stop.py).
# stopnote  the CUDA stop tests (common.sh): the backend's creation changed around the workspace.
# sample    the CUDA sample of the regression selections (the mutation audit's).
# megatron  the Megatron T_max twins (common.sh; megatron-core 0.19.2 from the carried .whl).
# regress   the one-GPU regression selections (common.sh).
# isolated  item 69's worker as a dry run at world size 1 (CUDA_VISIBLE_DEVICES=0): the script runs,
#           the CUDA backend bitwise the reference (the isolated 2-GPU case needs two GPUs).
# hostprof  where a small eager / static call's host time goes: profile_host_calls.py at 128 and
#           512 tokens under cProfile (functions by own time, and by cumulative time).
# Then the fuzzer for FUZZ_S seconds (default 30; 0: none).
# Carry: megatron_mok/_lib; .whl (megatron).
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-30}
. "$(dirname "$0")/common.sh"
part() {
case $1 in
alloc)
  MOK_TEST_SHARED_GPU=1 run_pytest alloc 180 tests/test_workspace_allocation.py tests/test_layout_agreement.py \
    "tests/test_cuda_backend.py::test_cuda_ranks_with_different_staging_settings_are_refused" ;;
exit)
  MOK_TEST_SHARED_GPU=1 run_pytest exit 240 tests/test_exit_stop.py ;;
stopnote)
  stop_tests ;;
sample)
  cuda_sample 150 ;;
megatron)
  megatron_t_max_twins ;;
regress)
  regress_selections ;;
isolated)
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 tests/isolated_gpu_worker.py 0 1 29533 $R/isolated_w1.json \
    > $R/isolated.log 2>&1; echo "[isolated] rc=$?"; cat $R/isolated_w1.json; echo ;;
hostprof)
  timeout 240 python3 -m cProfile -o $R/host.prof scripts/profile_host_calls.py --out $R/host \
    --tokens 128,512 --calls 300 --commit $C > $R/hostprof.log 2>&1; echo "[hostprof] rc=$?"
  python3 -c "
import pstats, sys
for key in ('tottime', 'cumulative'):
    print('==== by', key)
    pstats.Stats('$R/host.prof', stream=sys.stdout).strip_dirs().sort_stats(key).print_stats(45)
" > $R/hostprof_stats.txt 2>&1
  head -60 $R/hostprof_stats.txt | cut -c1-160 ;;
*) echo "unknown part $1"; exit 2 ;;
esac
}
run_parts "$PARTS" $FUZZ

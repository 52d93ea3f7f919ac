#!/usr/bin/env bash
# Session 46's one-GPU calls (benchmarks/NOTES.md item 80): the library built by CUDA 12.4's own
# nvcc (scripts/nvcc12_build_check.py) on a GPU, against this tree's nvcc 13 build.
#
#   here:  python3 scripts/nvcc12_build_check.py --keep .carry/nvcc12
#   there: bash scripts/device_runs/s46_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#          carry megatron_mok/_lib/libmok_cuda.so and .carry/nvcc12 (the 12.4 library, 7 MB, and
#          its libcudart.so.12; the nvcc 13 build links cudart statically, so the .so.12 on
#          LD_LIBRARY_PATH is the 12.4 library's alone)
#     PARTS: any of tests12 chain12 bench12 fuzz12 fat
#
# tests12  with the 12.4 library: the C ABI tests, the CUDA sample of the mutation audit, the
#          error-path selection (its timeouts and device flags), the narrow-combine and FP8 tests
# chain12  profile_graph_chain.py (W = 1; 128, 512, 4096 tokens; device time of graph replays),
#          alternating processes: 12.4 build (base), nvcc 13 build (new), twice each (item 80's
#          prediction: the 12.4 dispatch transfer kernel spills 508/804 B against 332/400 B)
# bench12  bench_dispatch_combine.py at t128 and dsv3 (eager, W = 1), base then new, twice
# fuzz12   the fuzzer for FUZZ12_S seconds (default 60) with the 12.4 library
# fat      a library of MOK_CUDA_ARCH="90a 100a" (built there, ~80 s): mok_kernel_arch says the
#          H200 runs its sm_90a cubin, then the CUDA sample with it
# Then the fuzzer for FUZZ_S seconds (default 0) with this tree's library.
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-0}
. "$(dirname "$0")/common.sh"
BASE_LIB=$PWD/.carry/nvcc12/libmok_cuda.so
[ -f "$BASE_LIB" ] || { echo "no $BASE_LIB: carry .carry/nvcc12 (scripts/nvcc12_build_check.py --keep)"; exit 2; }
export LD_LIBRARY_PATH=$PWD/.carry/nvcc12${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
host_ops_build
MOK_CUDA_LIB=$BASE_LIB python3 -c "
from megatron_mok.cuda import library
print('[12.4 library] loads:', library.is_available(), library._load_error, 'arch on GPU 0:', library.kernel_arch(0))
" 2>&1 | tail -2
part() {
case $1 in
tests12)
  MOK_CUDA_LIB=$BASE_LIB run_pytest abi12 60 tests/test_cuda_library_abi.py
  MOK_CUDA_LIB=$BASE_LIB cuda_sample 150
  MOK_CUDA_LIB=$BASE_LIB errors_selection 100
  MOK_CUDA_LIB=$BASE_LIB narrow_fp8_selection 90 ;;
chain12)
  for i in 1 2; do for v in base new; do graph_chain $v $i 110; done; done ;;
bench12)
  for i in 1 2; do for v in base new; do
    with_lib $v timeout -k 10 100 python3 benchmarks/bench_dispatch_combine.py --nproc 1 \
      --shapes t128,dsv3 --systems mok --sm-sweep "" --no-bwd --iters 100 --budget-s 60 \
      --out $R/eager_${v}_$i --commit $C > $R/eager_${v}_$i.log 2>&1
    echo "[eager $v $i] rc=$?"; grep -E "^(t128|dsv3) +mok" $R/eager_${v}_$i.log | head -4
  done; done ;;
fuzz12)
  MOK_CUDA_LIB=$BASE_LIB fuzz ${FUZZ12_S:-60} fuzz12 ;;
fat)
  t0=$SECONDS
  make -C csrc -s -B ARCH="90a 100a" OUT=$PWD/build/fat > $R/fat_build.log 2>&1
  echo "[fat build] rc=$? $((SECONDS - t0)) s"; tail -3 $R/fat_build.log
  MOK_CUDA_LIB=$PWD/build/fat/libmok_cuda.so python3 -c "
from megatron_mok.cuda import library
print('[fat library] arch on GPU 0:', library.kernel_arch(0))"
  MOK_CUDA_LIB=$PWD/build/fat/libmok_cuda.so cuda_sample 150 ;;
*) echo "unknown part $1"; exit 2 ;;
esac
}
run_parts "$PARTS" $FUZZ

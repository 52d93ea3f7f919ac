#!/usr/bin/env bash
# Run s12-4 (benchmarks/results/README.md): #47 (the dispatch pull splits small calls over
# warps) against the 0240f04 library (#45 alone, same C ABI 6, carried as
# .carry/lib_0240f04/libmok_cuda.so and swapped in with MOK_CUDA_LIB): per-kernel profile at
# 128, 512 and 4096 tokens twice and bench_small_batch.py once, alternating, then every CUDA
# test one GPU can run.
C=${1:?commit}
BASE_LIB=${BASE_LIB:-.carry/lib_0240f04/libmok_cuda.so}
. "$(dirname "$0")/common.sh"
for round in 1 2; do for v in base new; do
  with_lib $v timeout -k 5 90 python3 scripts/profile_kernels_1gpu.py --tokens 128,512,4096 --iters 20 > $R/kernels_${v}_$round.log 2>&1
  echo "[kernels $v $round] rc=$?"; grep -E "T=|dispatch_transfer|combine_transfer" $R/kernels_${v}_$round.log | cut -c1-80
done; done
for round in 1; do for v in base new; do
  with_lib $v timeout -k 5 80 python3 benchmarks/bench_small_batch.py --out $R/ab_${v}_$round --commit $C > $R/ab_${v}_$round.log 2>&1
  echo "[small $v $round] rc=$?"; grep "^| [12] " $R/ab_${v}_$round.log
done; done
timeout -k 5 340 python3 -m pytest -q tests/test_cuda_library_abi.py tests/test_cuda_loopback.py tests/test_cuda_backend.py -p no:cacheprovider -x > $R/tests.log 2>&1; echo "tests rc=$?"; tail -4 $R/tests.log
cd $OUT && tar czf r.tgz r && rm -rf r

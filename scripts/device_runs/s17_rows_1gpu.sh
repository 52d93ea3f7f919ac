#!/usr/bin/env bash
# Run s17-1 (benchmarks/results/README.md, NOTES (RR)): dispatch(rows_per_expert=N) on ONE GPU
# (C ABI 10): its tests first (W=1, loopback ranks, overflow), then every other CUDA test one
# GPU runs (nothing else may change with the new layout argument).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
CUDA_SET="tests/test_cuda_library_abi.py tests/test_cuda_loopback.py tests/test_cuda_backend.py tests/test_backend_pointers.py tests/test_bindings_constants.py"
timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider $CUDA_SET tests/test_rows_per_expert.py \
  -k "rows_per_expert" -rs > $R/rows_tests.log 2>&1
echo "[rows tests] rc=$?"; tail -2 $R/rows_tests.log; grep -E "^(FAILED|ERROR)|Error|assert" $R/rows_tests.log | head -30
timeout -k 5 360 python3 -m pytest -q -p no:cacheprovider $CUDA_SET tests/test_expert_alignment.py \
  -k "not rows_per_expert" -x -rs > $R/cuda_tests.log 2>&1
echo "[cuda tests] rc=$?"; tail -2 $R/cuda_tests.log; grep -E "^(FAILED|ERROR)" $R/cuda_tests.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

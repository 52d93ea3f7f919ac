#!/usr/bin/env bash
# Run s17-5 (benchmarks/results/README.md): the example with drop-and-pad on ONE GPU
# (run_gpu_ab.sh ab_drop_and_pad, NPROC=1: alltoall and mok each train 60 steps with capacity
# factor 1.0 padded to capacity), then every one-GPU CUDA test at the session's final commit.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
PYTHONPATH=/tmp/site19 PYTHON=python3 NPROC=1 timeout -k 5 200 bash examples/run_gpu_ab.sh $R/ab ab_drop_and_pad > $R/ab_drop_and_pad.log 2>&1
echo "[ab_drop_and_pad] rc=$?"; tail -8 $R/ab_drop_and_pad.log
CUDA_SET="tests/test_cuda_library_abi.py tests/test_cuda_loopback.py tests/test_cuda_backend.py tests/test_backend_pointers.py tests/test_bindings_constants.py"
timeout -k 5 330 python3 -m pytest -q -p no:cacheprovider $CUDA_SET tests/test_expert_alignment.py tests/test_rows_per_expert.py \
  -k "not rows_per_expert and not graph" -x -rs > $R/cuda_tests.log 2>&1
echo "[cuda tests] rc=$?"; tail -2 $R/cuda_tests.log; grep -E "^(FAILED|ERROR)" $R/cuda_tests.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

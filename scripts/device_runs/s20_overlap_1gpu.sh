#!/usr/bin/env bash
# Run s20-1 (benchmarks/results/README.md): the first half of shared_next_1gpu.sh within one
# call's limit, plus the one-GPU CUDA tests (session 19's CudaBackend._layout refactor had not
# run on a GPU): 1. tests/megatron -k ep_overlap on 0.19.2 in shared-GPU mode (the GPU test at
# EP = 2 and the CPU tests); 2. test_cuda_ipc_workspaces_return_to_the_gpu (W = 2, 4);
# 3. tests/test_cuda_backend.py's world-size-1 tests (not multigpu).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
MOK_TEST_SHARED_GPU=1 PYTHONPATH=/tmp/site19 timeout -k 5 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
  tests/megatron -k "ep_overlap" > $R/ep_overlap_019.log 2>&1
echo "[ep_overlap, megatron-core 0.19.2] rc=$?"; grep -E " PASSED| FAILED| ERROR| SKIPPED" $R/ep_overlap_019.log | grep "::"
grep -E "^E " $R/ep_overlap_019.log | grep -v CudaIPC | head -20
MOK_TEST_SHARED_GPU=1 timeout -k 5 120 python3 -m pytest -v -p no:cacheprovider --tb=short \
  "tests/test_cuda_backend.py::test_cuda_ipc_workspaces_return_to_the_gpu" > $R/ipc_workspaces.log 2>&1
echo "[ipc workspaces] rc=$?"; grep -E " PASSED| FAILED| SKIPPED" $R/ipc_workspaces.log | grep "::"; grep -E "^E " $R/ipc_workspaces.log | head
timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -m "not multigpu" tests/test_cuda_backend.py -rs > $R/cuda_w1.log 2>&1
echo "[CUDA tests, world size 1] rc=$?"; tail -3 $R/cuda_w1.log; grep -E "^(FAILED|ERROR)" $R/cuda_w1.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# For the next ONE-GPU call (written in session 19, not yet run): what session 19 left
# unrun in shared-GPU mode (MOK_TEST_SHARED_GPU=1: ranks as processes on one GPU, gloo between
# them, CUDA IPC between their workspaces; tests/harness.py), in the order of its value:
#   1. Megatron's 1F1B EP overlap with mok (NOTES item 15): tests/megatron -k ep_overlap on
#      0.19.2 (the GPU test at EP = 2 and the CPU tests) and on 0.16.1;
#   2. test_cuda_ipc_workspaces_return_to_the_gpu (W = 2, 4);
#   3. the W = 4 1000-call ring wrap alone, with a limit of its own (s19-8 cut it).
#   bash scripts/device_runs/shared_next_1gpu.sh COMMIT        (.whl/ and .whl16/ carried)
C=${1:?commit}
. "$(dirname "$0")/common.sh"
export MOK_TEST_SHARED_GPU=1
install_wheels .whl /tmp/site19 || exit 1
install_wheels .whl16 /tmp/site16 || exit 1
for v in 19 16; do
  PYTHONPATH=/tmp/site$v timeout -k 5 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/megatron -k "ep_overlap" > $R/ep_overlap_0$v.log 2>&1
  echo "[ep_overlap, megatron-core 0.$v] rc=$?"; grep -E " PASSED| FAILED| ERROR| SKIPPED" $R/ep_overlap_0$v.log | grep "::"
  grep -E "^E " $R/ep_overlap_0$v.log | grep -v CudaIPC | head -12
done
timeout -k 5 120 python3 -m pytest -v -p no:cacheprovider --tb=short \
  "tests/test_cuda_backend.py::test_cuda_ipc_workspaces_return_to_the_gpu" > $R/ipc_workspaces.log 2>&1
echo "[ipc workspaces] rc=$?"; grep -E " PASSED| FAILED| SKIPPED" $R/ipc_workspaces.log | grep "::"; grep -E "^E " $R/ipc_workspaces.log | head
timeout -k 10 240 python3 -m pytest -v -p no:cacheprovider --tb=short --durations=1 \
  "tests/test_cuda_backend.py::test_cuda_ring_wraps_1000_calls[4]" > $R/ring_w4.log 2>&1
echo "[W=4 ring wrap] rc=$?"; grep -E "PASSED|FAILED|s call" $R/ring_w4.log | head -3
cd $OUT && tar czf r.tgz r && rm -rf r

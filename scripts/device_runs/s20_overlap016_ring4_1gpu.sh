#!/usr/bin/env bash
# Run s20-2 (benchmarks/results/README.md): the second half of shared_next_1gpu.sh (run s20-2
# ran these exact lines, passed inline on the machine s20-1 left warm): tests/megatron -k
# ep_overlap on 0.16.1 in shared-GPU mode, then the W = 4 1000-call ring wrap alone.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
export MOK_TEST_SHARED_GPU=1
install_wheels .whl16 /tmp/site16 || exit 1
PYTHONPATH=/tmp/site16 timeout -k 5 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short tests/megatron -k ep_overlap > $R/ep_overlap_016.log 2>&1
echo "[ep_overlap 0.16.1] rc=$?"; grep -E " PASSED| FAILED| ERROR| SKIPPED" $R/ep_overlap_016.log | grep "::"; grep -E "^E " $R/ep_overlap_016.log | head
timeout -k 10 330 python3 -m pytest -v -p no:cacheprovider --tb=short --durations=1 "tests/test_cuda_backend.py::test_cuda_ring_wraps_1000_calls[4]" > $R/ring_w4.log 2>&1
echo "[W=4 ring wrap] rc=$?"; grep -E "PASSED|FAILED|s call" $R/ring_w4.log | head -3
cd $OUT && tar czf r.tgz r && rm -rf r

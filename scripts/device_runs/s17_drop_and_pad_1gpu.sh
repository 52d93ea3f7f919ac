#!/usr/bin/env bash
# Run s17-2 (benchmarks/results/README.md): rows_per_expert's loopback tests after the s17-1
# test fixes, then Megatron drop-and-pad on ONE GPU: every test in tests/megatron on
# megatron-core 0.19.2 (.whl/; first run of the drop-and-pad tests on 0.19 and on a GPU), then
# the one-GPU tests on 0.16.1 (.whl16/).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
install_wheels .whl16 /tmp/site16 || exit 1
timeout -k 5 110 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_loopback.py -k "rows_per_expert" -rs > $R/rows_loopback.log 2>&1
echo "[rows loopback] rc=$?"; tail -2 $R/rows_loopback.log; grep -E "^(FAILED|ERROR)|Error:" $R/rows_loopback.log | head -20
PYTHONPATH=/tmp/site19 timeout -k 5 310 python3 -m pytest -q -p no:cacheprovider tests/megatron -rs > $R/megatron_0192_tests.log 2>&1
echo "[0.19.2 tests] rc=$?"; tail -3 $R/megatron_0192_tests.log; grep -E "^(FAILED|ERROR)|Error:" $R/megatron_0192_tests.log | head -20
PYTHONPATH=/tmp/site16 timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/megatron -k "one_gpu" -rs > $R/megatron_0161_tests.log 2>&1
echo "[0.16.1 tests] rc=$?"; tail -3 $R/megatron_0161_tests.log; grep -E "^(FAILED|ERROR)|Error:" $R/megatron_0161_tests.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

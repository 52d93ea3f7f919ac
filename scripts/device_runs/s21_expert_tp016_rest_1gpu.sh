#!/usr/bin/env bash
# Run s21-2 (benchmarks/results/README.md): the expert-TP GPU tests on megatron-core 0.16.1
# (shared-GPU mode), then what s21-1's limit left of tests/megatron on 0.19.2 in shared-GPU
# mode (the 1F1B EP overlap on a GPU, the examples and benchmarks after session 20's harness
# refactor). Run s21-2 ran these lines inline on the machine s21-1 left warm; the script was
# committed after.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl16 /tmp/site16 || exit 1
PYTHONPATH=/tmp/site16 MOK_TEST_SHARED_GPU=1 timeout -k 5 150 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
  tests/megatron/test_megatron_dispatcher.py -k "expert_tensor_parallel_gpu" > $R/expert_tp_016.log 2>&1
echo "[expert TP GPU, 0.16.1] rc=$?"; grep -E " PASSED| FAILED| ERROR|SKIPPED \[" $R/expert_tp_016.log
install_wheels .whl /tmp/site19 || exit 1
PYTHONPATH=/tmp/site19 MOK_TEST_SHARED_GPU=1 timeout -k 10 330 python3 -m pytest -v -p no:cacheprovider -rs --tb=short --durations=5 \
  tests/megatron/test_megatron_dispatcher.py tests/megatron/test_megatron_examples.py \
  -k "(ep_overlap and not cpu) or examples or example" > $R/megatron_rest2_019.log 2>&1
echo "[tests/megatron rest 2, 0.19.2, shared GPU] rc=$?"; grep -E " PASSED| FAILED| ERROR|SKIPPED \[" $R/megatron_rest2_019.log | head -40
tail -3 $R/megatron_rest2_019.log
cd $OUT && tar czf r.tgz r && rm -rf r

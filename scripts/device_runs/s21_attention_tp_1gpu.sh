#!/usr/bin/env bash
# Run s21-3 (benchmarks/results/README.md): the expert-TP GPU tests again on the final tree,
# with the new case under attention TP 2 + sequence parallelism (W = 4: TP 2, ETP 2, EP 2),
# and the attention-TP CPU tests, on megatron-core 0.19.2 in shared-GPU mode (ranks as
# processes on one GPU, CUDA backend, bf16).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
PYTHONPATH=/tmp/site19 MOK_TEST_SHARED_GPU=1 timeout -k 5 300 python3 -m pytest -v -p no:cacheprovider -rs --tb=short --durations=5 \
  tests/megatron/test_megatron_dispatcher.py -k "expert_tensor_parallel_gpu or attention_tensor" > $R/attention_tp_019.log 2>&1
echo "[expert TP GPU + attention TP, 0.19.2, shared GPU] rc=$?"; grep -E " PASSED| FAILED| ERROR|SKIPPED \[|s call" $R/attention_tp_019.log
grep -E "^E " $R/attention_tp_019.log | head -20
cd $OUT && tar czf r.tgz r && rm -rf r

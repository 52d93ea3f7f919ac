#!/usr/bin/env bash
# Run s21-1 (benchmarks/results/README.md): expert tensor parallelism through mok on
# megatron-core 0.19.2 (carried wheel): its CPU tests and its GPU tests in shared-GPU mode
# (W = 2: EP 1 x ETP 2; W = 4: EP 2 x ETP 2, dropless and drop-and-pad; ranks as processes on
# one GPU, CUDA backend); NOTES item 15 after session 20 (the 0.19 Megatron-LM patch with the
# EP overlap: entrypoint and install tests); then every other tests/megatron test in
# shared-GPU mode (the harness refactor of session 20 ran on CPU only), under a time limit.
C=${1:?commit}; LIMIT=${2:-300}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
export PYTHONPATH=/tmp/site19
MOK_TEST_SHARED_GPU=1 timeout -k 5 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short --durations=5 \
  tests/megatron/test_megatron_dispatcher.py tests/megatron/test_megatron_install.py -k "expert_tensor or expert_tp" > $R/expert_tp_019.log 2>&1
echo "[expert TP, 0.19.2, shared GPU] rc=$?"; grep -E " PASSED| FAILED| ERROR| SKIPPED|s call" $R/expert_tp_019.log; grep -E "^E " $R/expert_tp_019.log | head -20
timeout -k 5 150 python3 -m pytest -v -p no:cacheprovider -rs tests/megatron/test_megatron_entrypoints.py \
  tests/megatron/test_megatron_install.py > $R/entry_install_019.log 2>&1
echo "[entrypoints + install, 0.19.2] rc=$?"; tail -2 $R/entry_install_019.log; grep -E " FAILED|SKIPPED \[" $R/entry_install_019.log | head
MOK_TEST_SHARED_GPU=1 timeout -k 10 $LIMIT python3 -m pytest -v -p no:cacheprovider -rs --tb=short --durations=5 \
  tests/megatron/test_megatron_dispatcher.py tests/megatron/test_megatron_examples.py -k "not expert_tensor" > $R/megatron_rest_019.log 2>&1
echo "[tests/megatron rest, 0.19.2, shared GPU, limit $LIMIT s] rc=$?"; grep -cE " PASSED" $R/megatron_rest_019.log
grep -E " FAILED| ERROR" $R/megatron_rest_019.log | head -20; tail -3 $R/megatron_rest_019.log
cd $OUT && tar czf r.tgz r && rm -rf r

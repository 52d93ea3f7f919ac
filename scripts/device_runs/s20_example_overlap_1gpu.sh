#!/usr/bin/env bash
# Run s20-5 (benchmarks/results/README.md): the example's micro-batch and 1F1B EP overlap
# tests on megatron-core 0.19.2, the GPU one (test_example_ep_overlap_gpu: EP = 2, bf16,
# 3 micro-batches, mok vs mok overlapped vs alltoall overlapped) in shared-GPU mode. Run s20-5
# ran these lines inline; the script was committed after.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
MOK_TEST_SHARED_GPU=1 PYTHONPATH=/tmp/site19 timeout -k 5 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short --durations=3 \
  tests/megatron/test_megatron_examples.py -k "ep_overlap_gpu or micro or argument" > $R/example_overlap_019.log 2>&1
echo "[example EP overlap, 0.19.2, shared GPU] rc=$?"; grep -E " PASSED| FAILED| ERROR| SKIPPED|s call" $R/example_overlap_019.log
grep -E "^E " $R/example_overlap_019.log | head -20
cd $OUT && tar czf r.tgz r && rm -rf r

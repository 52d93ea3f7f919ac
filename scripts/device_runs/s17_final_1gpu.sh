#!/usr/bin/env bash
# Run s17-4 (benchmarks/results/README.md): the session's final rows_per_expert code on ONE GPU:
# the graph tests (a captured eager-Buffer dispatch with rows_per_expert reads nothing), every
# rows_per_expert test (W=1, loopback, overflow), the main job, and the Megatron drop-and-pad /
# one-GPU tests on 0.19.2.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
CUDA_SET="tests/test_cuda_library_abi.py tests/test_cuda_loopback.py tests/test_cuda_backend.py tests/test_backend_pointers.py tests/test_bindings_constants.py"
timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider $CUDA_SET tests/test_rows_per_expert.py \
  -k "rows_per_expert or graph" -rs > $R/rows_graph_tests.log 2>&1
echo "[rows + graph tests] rc=$?"; tail -2 $R/rows_graph_tests.log; grep -E "^(FAILED|ERROR)|Error:" $R/rows_graph_tests.log | head -20
timeout -k 5 60 python3 -m megatron_mok.bench --json $R/main_job.json > $R/main_job.log 2>&1
echo "[main job] rc=$?"; tail -4 $R/main_job.log
PYTHONPATH=/tmp/site19 timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider tests/megatron -k "drop_and_pad or one_gpu" -rs > $R/megatron_tests.log 2>&1
echo "[megatron tests] rc=$?"; tail -2 $R/megatron_tests.log; grep -E "^(FAILED|ERROR)|Error:" $R/megatron_tests.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

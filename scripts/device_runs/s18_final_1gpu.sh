#!/usr/bin/env bash
# Run s18-6 (benchmarks/results/README.md): the session's final tree on ONE GPU: every
# tests/megatron test one GPU runs, on megatron-core 0.19.2 (the partial CUDA graphs, the
# harness and bench_layer changes of session 18 among them).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
PYTHONPATH=/tmp/site19 timeout -k 5 320 python3 -m pytest -q -p no:cacheprovider tests/megatron -rs > $R/megatron_tests_019.log 2>&1
echo "[tests/megatron 0.19.2] rc=$?"; tail -2 $R/megatron_tests_019.log
grep -E "^(FAILED|ERROR)|Error:" $R/megatron_tests_019.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

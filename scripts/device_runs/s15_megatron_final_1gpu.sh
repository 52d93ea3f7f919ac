#!/usr/bin/env bash
# Run s15-4 (benchmarks/results/README.md): the session's final Megatron adapter on ONE GPU:
# every test in tests/megatron on megatron-core 0.19.2 (.whl/), then the one-GPU and
# shared-expert tests on megatron-core 0.16.1 (.whl16/: its SharedExpertMLP has no
# wait_current_stream, the other branch of the dispatcher's stream wait).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
install_wheels .whl16 /tmp/site16 || exit 1
PYTHONPATH=/tmp/site19 timeout -k 5 290 python3 -m pytest -q -p no:cacheprovider tests/megatron -rs > $R/megatron_0192_tests.log 2>&1
echo "[0.19.2 tests] rc=$?"; tail -3 $R/megatron_0192_tests.log; grep -E "^(FAILED|ERROR)" $R/megatron_0192_tests.log | head
PYTHONPATH=/tmp/site16 python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" | tee $R/megatron_0161_version.txt
PYTHONPATH=/tmp/site16 timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider tests/megatron -k "one_gpu or shared or install" -rs > $R/megatron_0161_tests.log 2>&1
echo "[0.16.1 tests] rc=$?"; tail -3 $R/megatron_0161_tests.log; grep -E "^(FAILED|ERROR)|Error" $R/megatron_0161_tests.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# Run s19-3 (benchmarks/results/README.md): shared-GPU mode continued on ONE GPU
# (MOK_TEST_SHARED_GPU=1): the alternative schedules and their ring wraps at W=2
# (x2_tests.sh "schedules" and "rings"), every "core" test at W=4 (four processes on one
# GPU), then tests/megatron's one-GPU tests on 0.19.2 (s19-1's full run hit its time limit).
C=${1:?commit}; L2=${2:-200}; L4=${3:-200}; LM=${4:-150}
. "$(dirname "$0")/common.sh"
export MOK_TEST_SHARED_GPU=1
run_ids() {  # run_ids NAME LIMIT: the node ids in $R/NAME_ids.txt, as far as LIMIT allows
    timeout -k 10 $2 python3 -m pytest -v -p no:cacheprovider --durations=8 $(cat $R/$1_ids.txt) > $R/$1.log 2>&1
    echo "[$1] rc=$? of $(wc -l < $R/$1_ids.txt)"
    grep -E "PASSED|FAILED|ERROR|SKIPPED" $R/$1.log | grep "::" | sed 's/ .*//' > $R/$1_done.txt
    grep -v -x -F -f $R/$1_done.txt $R/$1_ids.txt > $R/$1_not_run.txt
    grep -cE " PASSED" $R/$1.log | sed 's/^/passed: /'; grep -E " FAILED| ERROR" $R/$1.log | head -10
    echo "not run (time limit): $(wc -l < $R/$1_not_run.txt)"; tail -1 $R/$1.log
}
collect() { python3 -m pytest --collect-only -q -m multigpu -k "$1" tests/test_cuda_backend.py -p no:cacheprovider 2>/dev/null | grep "::"; }
collect "alternative_schedules" | grep -E -- "-2\]$|\[2\]$" > $R/w2_schedules_ids.txt
collect "not alternative_schedules" | grep -E -- "-4\]$|\[4\]$" > $R/w4_core_ids.txt
run_ids w2_schedules $L2
run_ids w4_core $L4
install_wheels .whl /tmp/site19 || exit 1
PYTHONPATH=/tmp/site19 timeout -k 5 $LM python3 -m pytest -v -p no:cacheprovider -m "gpu and not multigpu" tests/megatron -rs > $R/megatron_1gpu_019.log 2>&1
echo "[tests/megatron one-GPU, 0.19.2] rc=$?"; grep -cE " PASSED" $R/megatron_1gpu_019.log | sed 's/^/passed: /'
grep -E " FAILED| ERROR" $R/megatron_1gpu_019.log | head; tail -1 $R/megatron_1gpu_019.log
cd $OUT && tar czf r.tgz r && rm -rf r

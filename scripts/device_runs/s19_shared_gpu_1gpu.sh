#!/usr/bin/env bash
# Run s19-2 (benchmarks/results/README.md): the 2-GPU tests on ONE GPU in shared-GPU mode
# (tests/harness.py: MOK_TEST_SHARED_GPU=1, two processes on one GPU joined by gloo, peers
# mapped with CUDA IPC, kernels time-sliced by the driver). Order: the peer-mapping tests
# (W = 2 and 4), then the contract cases, the ring, graphs, static/cached, timeouts and the
# rest of x2_tests.sh's "core" selection, as far as LIMIT allows (not_run.txt lists the rest);
# then tests/megatron's multi-GPU tests on 0.19.2.
C=${1:?commit}; LIMIT=${2:-270}; MLIMIT=${3:-150}
. "$(dirname "$0")/common.sh"
export MOK_TEST_SHARED_GPU=1
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/test_peer_memory.py "tests/test_cuda_backend.py::test_cuda_peer_mapping" -rs > $R/mapping.log 2>&1
echo "[peer mapping] rc=$?"; tail -3 $R/mapping.log; grep -E "^(FAILED|ERROR)|Error" $R/mapping.log | head
python3 -m pytest --collect-only -q -m multigpu -k "not alternative_schedules" tests/test_cuda_backend.py -p no:cacheprovider 2>/dev/null \
  | grep "::" | grep -E -- "-2\]$|\[2\]$" | grep -v peer_mapping > $R/all_ids.txt
{ grep -E "matches_reference\[|ring_wraps|missing_peer|graph_static|static_shape\[|cached_dispatch" $R/all_ids.txt
  grep -v -E "matches_reference\[|ring_wraps|missing_peer|graph_static|static_shape\[|cached_dispatch" $R/all_ids.txt; } > $R/ids.txt
echo "$(wc -l < $R/ids.txt) selected"
timeout -k 10 $LIMIT python3 -m pytest -v -p no:cacheprovider --durations=15 $(cat $R/ids.txt) > $R/tests.log 2>&1
echo "[shared-GPU W=2 tests] rc=$?"
grep -E "PASSED|FAILED|ERROR|SKIPPED" $R/tests.log | grep "::" | sed 's/ .*//' > $R/done.txt
grep -v -x -F -f $R/done.txt $R/ids.txt > $R/not_run.txt
grep -cE " PASSED" $R/tests.log | sed 's/^/passed: /'; grep -E " FAILED| ERROR" $R/tests.log | head -20
echo "not run (time limit): $(wc -l < $R/not_run.txt)"; tail -3 $R/tests.log
install_wheels .whl /tmp/site19 || exit 1
PYTHONPATH=/tmp/site19 timeout -k 5 $MLIMIT python3 -m pytest -v -p no:cacheprovider -m multigpu tests/megatron -rs > $R/megatron_shared.log 2>&1
echo "[tests/megatron multigpu, shared GPU] rc=$?"; grep -E "PASSED|FAILED|ERROR" $R/megatron_shared.log | grep "::" | head -20
grep -E "^E .*(Error|error)" $R/megatron_shared.log | sort | uniq -c | head -10
cd $OUT && tar czf r.tgz r && rm -rf r

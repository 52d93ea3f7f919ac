#!/usr/bin/env bash
# Run s13-1 (benchmarks/results/README.md): #48, programmatic dependent launch, at W=1 on one
# GPU. Same library, MOK_PDL=1 against MOK_PDL=0 Buffers side by side in one process
# (scripts/profile_graph_chain.py: chains of 10 dispatch+combine pairs per graph, single-call
# graphs, kernel gaps from a trace), bench_small_batch.py at W=1 once per setting, then the new
# PDL tests and the world-size-1 tests.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
timeout -k 5 200 python3 scripts/profile_graph_chain.py --out $R/chain --tokens 128,512,4096 --rounds 3 --commit $C > $R/chain.log 2>&1
echo "[chain] rc=$?"; grep -E "round|medians|^  T=|rc=|Error|error" $R/chain.log | head -40; sed -n '/kernel boundaries/,$p' $R/chain.log | head -60
for v in 1 0; do
  MOK_PDL=$v timeout -k 5 90 python3 benchmarks/bench_small_batch.py --worlds 1 --out $R/small_pdl$v --commit $C > $R/small_pdl$v.log 2>&1
  echo "[small pdl=$v] rc=$?"; grep "^| 1 " $R/small_pdl$v.log
done
timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_library_abi.py "tests/test_cuda_loopback.py::test_loopback_world_size_1_with_and_without_pdl" "tests/test_cuda_loopback.py::test_pdl_is_off_for_ranks_sharing_a_gpu_unless_forced" tests/test_cuda_backend.py::test_cuda_world_size_1 tests/test_cuda_backend.py::test_cuda_dispatch_outputs_are_plain_tensors > $R/tests.log 2>&1
echo "tests rc=$?"; tail -5 $R/tests.log
cd $OUT && tar czf r.tgz r && rm -rf r

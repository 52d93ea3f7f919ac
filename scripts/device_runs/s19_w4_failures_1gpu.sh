#!/usr/bin/env bash
# Run s19-4 (benchmarks/results/README.md): the four W=4 tests that failed in shared-GPU mode
# in s19-3 (four processes on one GPU), again, with their tracebacks (s19-3's log was cut by
# its time limit before pytest printed them).
C=${1:?commit}; LIMIT=${2:-300}
. "$(dirname "$0")/common.sh"
export MOK_TEST_SHARED_GPU=1
timeout -k 10 $LIMIT python3 -m pytest -v -p no:cacheprovider --tb=short -rf \
  "tests/test_cuda_backend.py::test_cuda_matches_reference[all_to_one_expert-4]" \
  "tests/test_cuda_backend.py::test_cuda_expert_alignment[e_equals_w_duplicates-16-4]" \
  "tests/test_cuda_backend.py::test_cuda_rows_per_expert[t0_on_rank0-A=16,N=max+5-4]" \
  "tests/test_cuda_backend.py::test_cuda_rows_per_expert[e_equals_w_duplicates-A=16,N=max+5-4]" > $R/w4_failed.log 2>&1
echo "rc=$?"; grep -E "PASSED|FAILED" $R/w4_failed.log | grep "::" ; grep -E "^E |rank [0-9]|Error" $R/w4_failed.log | grep -v CudaIPC | head -60
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# Run s17-7 (benchmarks/results/README.md): the final review's mends on ONE GPU: pad_experts
# serving both expert_alignment and rows_per_expert (one function instead of two), the backend's
# known R computed once, one rank-0-only data-error test helper: every alignment and
# rows_per_expert test (W=1, loopback) and the rank-0-only error tests.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_loopback.py tests/test_cuda_backend.py \
  -k "rows_per_expert or alignment or on_one_rank" -rs > $R/review_tests.log 2>&1
echo "[review tests] rc=$?"; tail -2 $R/review_tests.log; grep -E "^(FAILED|ERROR)|Error:" $R/review_tests.log | head -20
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# Run s16-8 (benchmarks/results/README.md): the final-review mends on ONE GPU (the shared
# zero-row helper in the fill and the transfer, the backend's one handle builder): the alignment
# tests, world size 1, static shape and cached dispatch at W=1, and the speculative loopback path.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_backend.py tests/test_cuda_loopback.py \
  -k "alignment or world_size_1 or speculative" -x -rs > $R/tests.log 2>&1
echo "tests rc=$?"; tail -2 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

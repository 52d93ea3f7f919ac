#!/usr/bin/env bash
# Run s16-7 (benchmarks/results/README.md): the one-GPU alignment tests again after d69e4a1
# (MOK_EAGER_SPECULATIVE=1 with expert_alignment: a warning, then read-R-first dispatches).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_backend.py -k "alignment" -rs > $R/tests.log 2>&1
echo "tests rc=$?"; tail -2 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# Run s19-5 (benchmarks/results/README.md): s19-3's W=4 shared-GPU sequence again up to its
# last failure (the ids in s19_w4_sequence_ids.txt, in s19-3's order), with tracebacks: the
# four failures passed when run alone (s19-4), so the order (a reused pool of four ranks)
# or chance made them.
C=${1:?commit}; LIMIT=${2:-280}
. "$(dirname "$0")/common.sh"
export MOK_TEST_SHARED_GPU=1
timeout -k 10 $LIMIT python3 -m pytest -v -p no:cacheprovider --tb=short -rf \
  $(cat scripts/device_runs/s19_w4_sequence_ids.txt) > $R/w4_sequence.log 2>&1
echo "rc=$?"; grep -cE " PASSED" $R/w4_sequence.log; grep -E " FAILED" $R/w4_sequence.log | grep "::"
grep -E "^E |^FAILED|rank [0-9]" $R/w4_sequence.log | grep -v CudaIPC | head -80
cd $OUT && tar czf r.tgz r && rm -rf r

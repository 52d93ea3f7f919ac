#!/usr/bin/env bash
# Session 40's one-GPU calls (benchmarks/NOTES.md, items 65 and 66).
#
#   bash scripts/device_runs/s40_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#     PARTS: any of alloc stopnote regress
#
# alloc     item 66: a rank short of memory stops every rank in the same words (2 processes sharing
#           the GPU, rank 1's allocator capped), then both make a Buffer and dispatch; item 65: ranks
#           with different staging settings refuse together before allocating; item 63's layout
#           agreement tests.
# stopnote  the CUDA stop tests (common.sh): the backend's creation changed around the workspace.
# regress   the one-GPU regression selections (common.sh).
# Then the fuzzer for FUZZ_S seconds (default 30; 0: none).
# Carry: megatron_mok/_lib.
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-30}
. "$(dirname "$0")/common.sh"
for PART in $PARTS; do
t0=$SECONDS
case $PART in
alloc)
  MOK_TEST_SHARED_GPU=1 run_pytest alloc 180 tests/test_workspace_allocation.py tests/test_layout_agreement.py \
    "tests/test_cuda_backend.py::test_cuda_ranks_with_different_staging_settings_are_refused" ;;
stopnote)
  stop_tests ;;
regress)
  regress_selections ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
echo "[$PART] $((SECONDS - t0)) s"
done
fuzz $FUZZ fuzz
cd $OUT && tar czf r.tgz r && rm -rf r

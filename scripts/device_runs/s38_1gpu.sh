#!/usr/bin/env bash
# Session 38's one-GPU calls (benchmarks/NOTES.md, item 57).
#
#   bash scripts/device_runs/s38_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#     PARTS: any of stopnote regress mutants refstop chains megatron
#
# stopnote  item 57 (the CUDA peers quote the stopping rank's reason, C ABI 18): the CUDA stop
#           tests (tests/test_stop_rank.py: loopback ranks, and processes sharing the GPU), the
#           C ABI tests, the device-error message tests.
# regress   the one-GPU regression selections (common.sh).
# mutants   the stop note's two CUDA mutants (scripts/mutation_audit_cuda.py; the libraries
#           built here into .mutants38: carried).
# refstop   the reference backend's stop twins (tests/test_reference_stop.py: 2 processes
#           sharing the GPU; comm.py now takes its reason size from cuda/errors.py).
# chains    the 3- and 4-process stop twins, CHAIN_REPEATS times (default 10) with -s: how often a
#           peer finds another peer's poison before rank 1's (a chain of stops; a race), and
#           that such a peer still names rank 1 and its words ("rank r stopped after rank 1's
#           error (...)").
# megatron  the Megatron T_max twins (tests/megatron/test_megatron_eval.py -k over_t_max: the CPU
#           reference and 2 processes on the GPU, megatron-core 0.19.2 from the carried .whl): the
#           CUDA peer's error is now a MokDevicePeerStopped quoting the adapter's message.
# Then the fuzzer for FUZZ_S seconds (default 30; 0: none).
# Carry: megatron_mok/_lib, .mutants38 (mutants), .whl (megatron).
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-30}
. "$(dirname "$0")/common.sh"
for PART in $PARTS; do
t0=$SECONDS
case $PART in
stopnote)
  stop_tests ;;
regress)
  regress_selections ;;
mutants)
  cuda_mutants .mutants38 stop_note_not_written,stop_note_read_from_self 0 ;;
refstop)
  MOK_TEST_SHARED_GPU=1 run_pytest refstop 240 -m "gpu or multigpu" tests/test_reference_stop.py ;;
chains)
  stop_chains ${CHAIN_REPEATS:-10} ;;
megatron)
  megatron_t_max_twins ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
echo "[$PART] $((SECONDS - t0)) s"
done
fuzz $FUZZ fuzz
cd $OUT && tar czf r.tgz r && rm -rf r

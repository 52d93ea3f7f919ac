#!/usr/bin/env bash
# Session 35's one-GPU calls (benchmarks/NOTES.md, item 53: a rank that raises stops its peers).
#
#   bash scripts/device_runs/s35_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#     PARTS: any of stop regress audit megatron
#
# stop      tests/test_stop_rank.py on the GPU: loopback ranks (threads) and the two-process
#           twins (MOK_TEST_SHARED_GPU=1: two processes on the one GPU, CUDA IPC peers).
# regress   the kernels around the new waits (routing wait, three combine waits, the narrow
#           combine) and the stop in _raise_if_error: the CUDA regression sample of the audit,
#           the narrow / FP8 selections (FP8 also covers session 34's rows.py mend on the GPU),
#           the error paths (data errors on one rank, missing peer, lagging reader) and the
#           alternative schedules at world size 4.
# audit     item 53's CUDA mutants (.mutants35, carried, built from this tree).
# megatron  tests/megatron's GPU tests of the eval file (the two-process T_max test is new) and
#           of the aux-loss file if present, on megatron-core 0.19.2 (the carried .whl).
# Then the fuzzer for FUZZ_S seconds (default 30; 0: none).
# Carry: megatron_mok/_lib, .whl (megatron-core 0.19.2), .mutants35 (for audit).
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-30}
. "$(dirname "$0")/common.sh"
SITE=/tmp/site
for PART in $PARTS; do
t0=$SECONDS
case $PART in
stop)
  MOK_TEST_SHARED_GPU=1 run_pytest stop ${STOP_LIMIT_S:-240} -m "gpu or multigpu" --durations=12 \
    tests/test_stop_rank.py ;;
regress)
  regress_selections ;;
audit)
  # --only the carried mutants: without it the audit runs every mutant's baseline selection
  # first (s35-3 spent its 540 s there).
  ONLY=$(python3 -c "import json; print(','.join(json.load(open('.mutants35/manifest.json'))['mutants']))")
  timeout -k 10 ${AUDIT_LIMIT_S:-420} python3 scripts/mutation_audit_cuda.py run --libs .mutants35 --out $R/audit \
    --only "$ONLY" --fuzz-seconds 0 > $R/audit.log 2>&1
  echo "[audit] rc=$?"; tail -12 $R/audit.log ;;
megatron)
  [ -d $SITE/megatron ] || install_wheels .whl $SITE
  M=tests/megatron; FILES="$M/test_megatron_eval.py"
  [ -f $M/test_megatron_aux_loss.py ] && FILES="$M/test_megatron_aux_loss.py $FILES"
  PYTHONPATH=$SITE:$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=4 MOK_TEST_SHARED_GPU=1 \
    run_pytest megatron ${MEGATRON_LIMIT_S:-240} -m "gpu or multigpu" --durations=10 $FILES ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
echo "[$PART] $((SECONDS - t0)) s"
done
fuzz $FUZZ fuzz
cd $OUT && tar czf r.tgz r && rm -rf r

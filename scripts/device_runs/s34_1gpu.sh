#!/usr/bin/env bash
# Session 34's one-GPU calls (benchmarks/NOTES.md, items 47 and 48).
#
#   bash scripts/device_runs/s34_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#     PARTS: any of errors megatron new
#
# errors    (item 48) report_error's escalation loop without its redundant `prev != 0`: the
#           timeout-after-an-unread-data-error test three times on this tree's library, its
#           mutant data_error_hides_timeout (.mutants34, carried, built from this tree) through
#           the audit, then the error-path selection of session 33.
# megatron  (item 47's s33-3, items 49-51) The GPU tests of tests/megatron on megatron-core
#           0.19.2 (the carried .whl) with the per-step device-error check in place, session
#           34's new test files first: one GPU, so the `multigpu` tests run as two processes on
#           it (MOK_TEST_SHARED_GPU=1), as s29's step3. Stopped at MEGATRON_LIMIT_S (500).
# new       (items 49, 50, after s34-1's mends) the GPU tests of session 34's new files only:
#           recompute, features, full-iteration graph, eval (0.19.2). Stopped at NEW_LIMIT_S (360).
# Then the fuzzer for FUZZ_S seconds (default 30; 0: none).
# Carry: megatron_mok/_lib, .whl (megatron-core 0.19.2), .mutants34 (for errors).
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-30}
. "$(dirname "$0")/common.sh"
SITE=/tmp/site
mcore() {  # mcore NAME LIMIT_S PYTEST ARGS...: pytest on megatron-core 0.19.2 into $R/NAME.log
    local name=$1 limit=$2; shift 2
    [ -d $SITE/megatron ] || install_wheels .whl $SITE || return
    PYTHONPATH=$SITE:$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=4 timeout -s INT -k 30 $limit \
      python3 -m pytest -q -rfE -p no:cacheprovider "$@" --junitxml=$R/$name.xml > $R/$name.log 2>&1
    echo "[$name] rc=$?"; tail -2 $R/$name.log; grep -E "FAILED|ERROR" $R/$name.log | head -20
}
for PART in $PARTS; do
t0=$SECONDS
case $PART in
errors)
  T="tests/test_cuda_loopback.py::test_loopback_timeout_after_an_unread_data_error_still_aborts"
  for i in 1 2 3; do
    timeout -k 10 120 python3 -m pytest -q -rfE "$T" > $R/abort_$i.log 2>&1
    echo "[timeout after data error $i] rc=$?"; grep -E "passed|failed|Error" $R/abort_$i.log | cut -c1-240 | head -3
  done
  timeout -k 10 150 python3 scripts/mutation_audit_cuda.py run --libs .mutants34 --out $R/audit \
    --only data_error_hides_timeout --fuzz-seconds 0 > $R/audit.log 2>&1
  echo "[audit] rc=$? in $((SECONDS - t0)) s"; tail -4 $R/audit.log
  t0=$SECONDS
  timeout -k 10 200 python3 -m pytest -q -rfE -m "gpu and not multigpu" tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    -k "missing_peer or overflow or bad_expert or lagging or past_its_waits or hang or timeout" \
    --junitxml=$R/errors.xml > $R/errors.log 2>&1
  echo "[error paths] rc=$? in $((SECONDS - t0)) s"; tail -2 $R/errors.log; grep -E "FAILED|ERROR" $R/errors.log | head ;;
megatron)
  # Session 34's new files first (stopped with SIGINT at the limit, pytest still reports).
  M=tests/megatron
  MOK_TEST_SHARED_GPU=1 mcore megatron ${MEGATRON_LIMIT_S:-500} -m "gpu or multigpu" --durations=15 \
    $M/test_megatron_full_graph.py $M/test_megatron_features.py $M/test_megatron_recompute.py \
    $M/test_megatron_dispatcher.py $M ;;
new)
  M=tests/megatron
  MOK_TEST_SHARED_GPU=1 mcore new ${NEW_LIMIT_S:-360} -m "gpu or multigpu" --durations=10 \
    $M/test_megatron_recompute.py $M/test_megatron_features.py $M/test_megatron_full_graph.py \
    $M/test_megatron_eval.py ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
echo "[$PART] $((SECONDS - t0)) s"
done
fuzz $FUZZ fuzz
cd $OUT && tar czf r.tgz r && rm -rf r

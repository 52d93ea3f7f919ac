#!/usr/bin/env bash
# Session 33's one-GPU calls (benchmarks/NOTES.md, items 45 and 46, and the host review's fixes).
#
#   bash scripts/device_runs/s33_1gpu.sh COMMIT "PARTS" [FUZZ_S]     PARTS: any of errors combine host
#
# errors  (item 46) The timeout-after-an-unread-data-error test three times on this tree's
#         library; the mutant data_error_hides_timeout (.mutants33, carried, built from this tree)
#         through the audit; the error-path selection (missing peer, overflow, bad expert id,
#         lagging reader, past_its_waits, rows_per_expert overflow).
# combine (item 45) Every one-GPU combine test (W = 1 and loopback: ids naming combine, narrow,
#         split, phased, own_staged, or the reference comparisons) on a library built from the
#         split csrc/kernels/combine/ files.
# host    The host review's fixes (session 33: handles, devices, aligned rows, clamped overflow
#         counts): every one-GPU test of the CUDA and FP8 files, the host-side test files whole,
#         the fixes' loopback tests; their two library mutants (.mutants33b, carried).
# Then the fuzzer for FUZZ_S seconds (default 60; 0: none).
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-60}
. "$(dirname "$0")/common.sh"
for PART in $PARTS; do
t0=$SECONDS
case $PART in
errors)
  T="tests/test_cuda_loopback.py::test_loopback_timeout_after_an_unread_data_error_still_aborts"
  for i in 1 2 3; do
    timeout -k 10 120 python3 -m pytest -q -rfE "$T" > $R/abort_$i.log 2>&1
    echo "[timeout after data error $i] rc=$?"; grep -E "passed|failed|Error" $R/abort_$i.log | cut -c1-240 | head -3
  done
  timeout -k 10 150 python3 scripts/mutation_audit_cuda.py run --libs .mutants33 --out $R/audit \
    --only data_error_hides_timeout --fuzz-seconds 0 > $R/audit.log 2>&1
  echo "[audit] rc=$? in $((SECONDS - t0)) s"; tail -4 $R/audit.log
  t0=$SECONDS
  timeout -k 10 200 python3 -m pytest -q -rfE -m "gpu and not multigpu" tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    -k "missing_peer or overflow or bad_expert or lagging or past_its_waits or hang or timeout" \
    --junitxml=$R/errors.xml > $R/errors.log 2>&1
  echo "[error paths] rc=$? in $((SECONDS - t0)) s"; tail -2 $R/errors.log; grep -E "FAILED|ERROR" $R/errors.log | head ;;
combine)
  timeout -k 10 330 python3 -m pytest -q -rfE -m "gpu and not multigpu" tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    -k "combine or narrow or split or phased or own_staged or (matches_reference and not dsv3)" \
    --junitxml=$R/combine.xml > $R/combine.log 2>&1
  echo "[combine tests] rc=$? in $((SECONDS - t0)) s"; tail -2 $R/combine.log; grep -E "FAILED|ERROR" $R/combine.log | head ;;
host)
  # Every one-GPU test of the CUDA and FP8 files (the host review's fixes touch every call's
  # entry: the device check, the aligned-rows copy, the handle's serial), the loopback ones of
  # the fixes, and the host-side files whole; then the fixes' two kernel/API mutants (.mutants33b).
  timeout -k 10 330 python3 -m pytest -q -rfE -p no:cacheprovider \
    tests/test_handle_safety.py tests/test_input_checks.py tests/test_autograd.py tests/test_static_shape.py \
    tests/test_cached_dispatch.py "tests/test_cuda_loopback.py::test_loopback_static_overflow_counts_match_written_rows" \
    tests/test_cuda_loopback.py::test_loopback_misaligned_rows_are_copied \
    $(python3 -m pytest --collect-only -q -m "gpu and not multigpu" tests/test_cuda_backend.py tests/test_fp8_dispatch.py \
        -p no:cacheprovider 2>/dev/null | grep "::") \
    --junitxml=$R/host.xml > $R/host.log 2>&1
  echo "[host review tests] rc=$? in $((SECONDS - t0)) s"; tail -2 $R/host.log; grep -E "FAILED|ERROR" $R/host.log | head
  t0=$SECONDS
  timeout -k 10 200 python3 scripts/mutation_audit_cuda.py run --libs .mutants33b --out $R/audit_host \
    --only scan_overflow_counts_not_clamped,api_combine_alignment_unchecked --fuzz-seconds 0 > $R/audit_host.log 2>&1
  echo "[audit host] rc=$? in $((SECONDS - t0)) s"; tail -5 $R/audit_host.log ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
done
fuzz $FUZZ fuzz
cd $OUT && tar czf r.tgz r && rm -rf r

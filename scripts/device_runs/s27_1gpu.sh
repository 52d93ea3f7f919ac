#!/usr/bin/env bash
# Session 27's one-GPU calls (benchmarks/NOTES.md, "Session 27").
#
#   bash scripts/device_runs/s27_1gpu.sh COMMIT refactor [FUZZ_SECONDS]
#
# refactor: (1) the mutation audit of the FP8 pack's padding (NOTES item 30: it survived s27-1,
# as no package path pads on the kernel's path; the new direct C-ABI test on dirty memory must
# kill it), (2) the single-GPU and loopback CUDA test files whole over the combine kernel's
# refactor (one helper counts a chunk's arrivals and publishes it, for three produce paths),
# listing what the time limit cut off, (3) the fuzzer over the refactored library.
C=${1:?commit}; PART=${2:?refactor}
. "$(dirname "$0")/common.sh"
if [ "$PART" = refactor ]; then
  F=${3:-60}
  timeout -k 10 200 python3 scripts/mutation_audit_cuda.py run --libs .mutants --out $R/audit \
    --only pack_padding_not_zeroed --fuzz-seconds 20 > $R/audit.log 2>&1
  echo "[mutation audit] rc=$?"; grep -E "^\[|^==" $R/audit.log | cut -c1-260
  timeout -k 5 $((540 - SECONDS - F - 40)) python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_cuda_backend.py tests/test_cuda_loopback.py > $R/cuda_tests.log 2>&1
  echo "[CUDA test files, 1 GPU] rc=$? in ${SECONDS}s so far"; grep -cE " PASSED" $R/cuda_tests.log
  grep -E " FAILED| ERROR" $R/cuda_tests.log | head -20; grep -E "^E " $R/cuda_tests.log | head -10; tail -2 $R/cuda_tests.log
  grep -oE "^tests/\S+::\S+" $R/cuda_tests.log | sort -u > $R/done.txt
  python3 -m pytest --collect-only -q tests/test_cuda_backend.py tests/test_cuda_loopback.py -p no:cacheprovider 2>/dev/null \
    | grep "::" | sort -u > $R/ids.txt
  grep -v -x -F -f $R/done.txt $R/ids.txt > $R/not_run.txt
  echo "collected $(wc -l < $R/ids.txt), not run (time limit): $(wc -l < $R/not_run.txt)"
  timeout -k 10 $((F + 60)) python3 scripts/fuzz_dispatch.py --device cuda --seconds $F --max-world 4 \
    --out $R/fuzz --seed 27 > $R/fuzz.log 2>&1
  echo "[fuzz] rc=$?"; grep -E "^-- " $R/fuzz.log | tail -2; tail -3 $R/fuzz.log | cut -c1-300
fi
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# Session 26's one-GPU calls: the mutation audit of the CUDA library (scripts/mutation_audit_cuda.py;
# benchmarks/NOTES.md item 30). The mutant libraries are built on the CPU machine
# (`python scripts/mutation_audit_cuda.py build --out .mutants`) and carried (`.mutants`, ~1 MB each,
# git-ignored), with `megatron_mok/_lib` (the unmutated library: the baseline).
#
#   bash scripts/device_runs/s26_1gpu.sh COMMIT audit MUTANTS [FUZZ_SECONDS]
#
# audit: every test selection the listed mutants use, with the unmutated library (must pass), then
# each mutant against its selection (-x) and, when the tests miss it, the fuzzer for FUZZ_SECONDS
# (default 30). MUTANTS: a comma-separated list of names, or "all".
C=${1:?commit}; PART=${2:?audit}
. "$(dirname "$0")/common.sh"
if [ "$PART" = audit ]; then
  M=${3:?mutants}; F=${4:-30}
  only=(--only "$M"); [ "$M" = all ] && only=()
  timeout -k 10 570 python3 scripts/mutation_audit_cuda.py run --libs .mutants --out $R/audit \
    "${only[@]}" --fuzz-seconds $F > $R/audit.log 2>&1
  echo "[mutation audit] rc=$?"; grep -E "^\[|^==" $R/audit.log | cut -c1-260
fi
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# Run s21-7 (benchmarks/results/README.md): the new Megatron-LM patches for 0.17 and 0.18
# (patches/megatron-lm-core_r0.17.0.patch, ..._r0.18.0.patch, made by make_patches.py from
# core_v0.17.1 / core_v0.18.2) applied to the 0.17.1 / 0.18.2 wheels' sources: the patched
# tree builds mok without install() (and keeps the EP-overlap inputs), and Megatron-LM's
# argument parser of the patched tree takes --moe-token-dispatcher-type mok.
C=${1:?commit}; LIMIT=${2:-110}
. "$(dirname "$0")/common.sh"
for v in 17 18; do
  install_wheels .whl$v /tmp/site$v || exit 1
  PYTHONPATH=/tmp/site$v timeout -k 10 $LIMIT python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/megatron/test_megatron_entrypoints.py -k "patch" > $R/patches_0$v.log 2>&1
  echo "[patch tests, 0.$v, limit $LIMIT s] rc=$? passed=$(grep -cE ' PASSED' $R/patches_0$v.log)"
  grep -E " FAILED| ERROR|SKIPPED \[|^E " $R/patches_0$v.log | head -10; tail -1 $R/patches_0$v.log
done
cd $OUT && tar czf r.tgz r && rm -rf r

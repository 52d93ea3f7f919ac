#!/usr/bin/env bash
# Session 25's first one-GPU call, written at the end of session 24 (benchmarks/NOTES.md, "Next
# experiments after session 24"):
#
#   bash scripts/device_runs/s25_1gpu.sh COMMIT first [FUZZ_SECONDS]
#
# first: NOTES item 24, the fuzzer with the MOK_* schedule settings and CUDA-graph replays that
# were added after session 24's last device call (never run on a GPU; prediction: 0 failures in
# ~1500 cases), then #57's process twins in shared-GPU mode (in place vs packed, packed on one rank
# only: written after the last device call) with the other FP8 process tests.
C=${1:?commit}; PART=${2:?first}
. "$(dirname "$0")/common.sh"
if [ "$PART" = first ]; then
  S=${3:-240}
  timeout -k 10 $((S + 120)) python3 scripts/fuzz_dispatch.py --device cuda --seconds $S --max-world 4 \
    --out $R/fuzz --seed 25 > $R/fuzz.log 2>&1
  echo "[fuzz, schedules and graphs] rc=$?"; grep -E "^-- " $R/fuzz.log | tail -3; tail -4 $R/fuzz.log | cut -c1-300
  python3 - "$R/fuzz/fuzz.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
f = d.get("feature_counts") or {}
print("[fuzz features]", {k: v for k, v in sorted(f.items()) if k.startswith(("schedule", "cuda_graph"))})
for x in (d.get("failures") or [])[:5]:
    print("[fuzz failure]", x.get("case_seed"), x.get("kind"), str(x.get("message"))[:300])
PY
  MOK_TEST_SHARED_GPU=1 timeout -k 5 150 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py -k "test_cuda_fp8 and not world_size_1" > $R/fp8_shared.log 2>&1
  echo "[fp8 W=2 shared GPU] rc=$?"; grep -E " PASSED| FAILED| ERROR|SKIPPED \[" $R/fp8_shared.log | head -12; grep -E "^E " $R/fp8_shared.log | head
fi
cd $OUT && tar czf r.tgz r && rm -rf r

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
#
#   bash scripts/device_runs/s25_1gpu.sh COMMIT second
#
# second: the whole FP8 and C ABI test files (single process, loopback W = 2, 3) and the CUDA
# regression sample over session 24's last two review commits (6472be5: resolve_source resolves
# the row size itself; 4507db0: the row-format mismatch tests share their setup), which were
# never GPU-run.
#
#   bash scripts/device_runs/s25_1gpu.sh COMMIT narrow [FUZZ_SECONDS]
#
# narrow: NOTES item 22, the lane-per-item combine for rows of one vector (hidden 8: the FP8
# dispatch's prob-gradient call). Its tests (narrow vs full combine bitwise, the narrow_rows
# contract case with and without MOK_COMBINE_NARROW, one block for calls larger than its lanes),
# the regression sample (the combine kernel changed), the kernel's time at 128 / 512 / 4096
# tokens with and without the narrow path (prediction: 84 -> 12-25 us at 4096), then the fuzzer.
#
#   bash scripts/device_runs/s25_1gpu.sh COMMIT host
#
# host: NOTES item 25 (PairRows without byte views, MOK_FP8_PACK read once per Buffer): the FP8
# GPU tests over it, the host profile at 128 tokens (dispatch_rows vs session 24's build in one
# process; prediction -2..-4 us), the fuzzer 60 s.
#
#   bash scripts/device_runs/s25_1gpu.sh COMMIT recheck
#
# recheck: the narrow path's tests and the fuzzer (90 s) over the final review's refactor.
C=${1:?commit}; PART=${2:?first|second|narrow|host|recheck}
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
elif [ "$PART" = second ]; then
  timeout -k 5 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py tests/test_cuda_library_abi.py > $R/fp8_tests.log 2>&1
  echo "[fp8 + ABI GPU tests] rc=$?"; grep -cE " PASSED" $R/fp8_tests.log; grep -E " FAILED| ERROR" $R/fp8_tests.log | head -20
  grep -E "mismatch|in_place" $R/fp8_tests.log | head -20; grep -E "^E " $R/fp8_tests.log | head -20; tail -2 $R/fp8_tests.log
  timeout -k 5 120 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    -k "world_size_1 or (loopback_matches_reference and 3]) or loopback_static_shape or loopback_cached or loopback_graph or (loopback_ring_wraps and 3-) or loopback_expert_alignment or loopback_rows_per_expert or launch_launches_nothing or one_call_dispatch" \
    > $R/cuda_regression.log 2>&1
  echo "[CUDA regression sample] rc=$?"; grep -cE " PASSED" $R/cuda_regression.log; grep -E " FAILED| ERROR" $R/cuda_regression.log | head -20; tail -2 $R/cuda_regression.log
elif [ "$PART" = narrow ]; then
  timeout -k 5 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py tests/test_cuda_loopback.py tests/test_cuda_backend.py \
    -k "prob_grads_only or narrow_rows" > $R/narrow_tests.log 2>&1
  echo "[narrow tests] rc=$?"; grep -cE " PASSED" $R/narrow_tests.log; grep -E " FAILED| ERROR" $R/narrow_tests.log | head -20
  grep -E "^E " $R/narrow_tests.log | head -20; tail -2 $R/narrow_tests.log
  timeout -k 5 120 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    -k "world_size_1 or (loopback_matches_reference and 3]) or loopback_static_shape or loopback_cached or loopback_graph or (loopback_ring_wraps and 3-) or loopback_expert_alignment or loopback_rows_per_expert or launch_launches_nothing or one_call_dispatch" \
    > $R/cuda_regression.log 2>&1
  echo "[CUDA regression sample] rc=$?"; grep -cE " PASSED" $R/cuda_regression.log; grep -E " FAILED| ERROR" $R/cuda_regression.log | head -20; tail -2 $R/cuda_regression.log
  for v in narrow wide narrow2; do
    e=; [ $v = wide ] && e=MOK_COMBINE_NARROW=0
    env $e timeout -k 5 90 python3 scripts/profile_kernels_1gpu.py --fp8 --tokens 128,512,4096 --iters 30 \
      > $R/kernels_$v.log 2>&1
    echo "[kernels, $v ${e:-default}] rc=$?"; grep -A3 -E "prob grads only|full zero-rows" $R/kernels_$v.log | grep -vE "^--" | head -24
  done
  S=${3:-120}
  timeout -k 10 $((S + 120)) python3 scripts/fuzz_dispatch.py --device cuda --seconds $S --max-world 4 \
    --out $R/fuzz --seed 26 > $R/fuzz.log 2>&1
  echo "[fuzz] rc=$?"; tail -1 $R/fuzz.log | cut -c1-300
  python3 - "$R/fuzz/fuzz.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
f = d.get("feature_counts") or {}
print("[fuzz features]", {k: v for k, v in sorted(f.items()) if k in ("fp8", "schedule_combine_narrow_off", "cuda_graph_fp8")})
for x in (d.get("failures") or [])[:5]:
    print("[fuzz failure]", x.get("case_seed"), x.get("kind"), str(x.get("message"))[:300])
PY
elif [ "$PART" = host ]; then
  timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py tests/test_cuda_library_abi.py > $R/fp8_tests.log 2>&1
  echo "[fp8 + ABI GPU tests] rc=$?"; grep -E " FAILED| ERROR|^E " $R/fp8_tests.log | head -20; tail -1 $R/fp8_tests.log
  timeout -k 5 200 python3 scripts/profile_fp8_host.py --out $R/fp8_host --tokens 128 --commit $C \
    --profile-calls 50 > $R/fp8_host.log 2>&1
  echo "[fp8 host profile] rc=$?"; grep -E "^T=|^  " $R/fp8_host.log | head -24
  timeout -k 10 150 python3 scripts/fuzz_dispatch.py --device cuda --seconds 60 --max-world 4 \
    --out $R/fuzz --seed 27 > $R/fuzz.log 2>&1
  echo "[fuzz] rc=$?"; tail -1 $R/fuzz.log | cut -c1-300
elif [ "$PART" = recheck ]; then
  timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -rs --tb=short \
    tests/test_fp8_dispatch.py tests/test_cuda_loopback.py tests/test_cuda_backend.py \
    -k "prob_grads_only or narrow_rows" > $R/narrow_tests.log 2>&1
  echo "[narrow tests] rc=$?"; grep -E " FAILED| ERROR|^E " $R/narrow_tests.log | head -20; tail -1 $R/narrow_tests.log
  timeout -k 10 200 python3 scripts/fuzz_dispatch.py --device cuda --seconds 90 --max-world 4 \
    --out $R/fuzz --seed 28 > $R/fuzz.log 2>&1
  echo "[fuzz] rc=$?"; tail -1 $R/fuzz.log | cut -c1-300
fi
cd $OUT && tar czf r.tgz r && rm -rf r

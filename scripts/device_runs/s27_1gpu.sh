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
#
#   bash scripts/device_runs/s27_1gpu.sh COMMIT dryrun
#
# dryrun: what one GPU can say before the first 2-GPU call. (1) The W=2 process tests of the
# combine's produce paths (refactored: chunk_rows_arrived) in shared-GPU mode (two processes on
# one GPU, CUDA IPC); (2) the 2-GPU suite's code paths as a shared-GPU dry run
# (bench_dispatch_combine.py --shared-gpu under torchrun, 2 ranks: mok, mok_fp8, alltoall over
# gloo; correctness checks, no timing claims); (3) bench_small_batch.py --shared-gpu under
# torchrun (the multi-process path of x2_suite.sh's small batches).
C=${1:?commit}; PART=${2:?refactor|dryrun}
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
elif [ "$PART" = dryrun ]; then
  MOK_TEST_SHARED_GPU=1 timeout -k 10 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/test_cuda_backend.py -k "(test_cuda_matches_reference or combine_split or streamed_produce or ring_wraps_1000 or repeats_and_sm) and 2]" \
    > $R/shared_tests.log 2>&1
  echo "[shared-GPU W=2 combine tests] rc=$? in ${SECONDS}s so far"; grep -cE " PASSED" $R/shared_tests.log
  grep -E " FAILED| ERROR" $R/shared_tests.log | head -20; grep -E "^E " $R/shared_tests.log | head -10; tail -2 $R/shared_tests.log
  t0=$SECONDS
  timeout -k 10 230 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_dispatch_combine.py \
    --shared-gpu --shapes t128,dsv3 --systems mok,mok_fp8,alltoall --iters 5 --warmup 2 --sm-sweep 24 \
    --budget-s 170 --out $R/suite --commit $C > $R/suite.log 2>&1
  echo "[suite, shared-GPU dry run] rc=$? in $((SECONDS - t0)) s"; grep -E "^\||SKIP|FAIL|Traceback|Error" $R/suite.log | head -30
  tail -14 $R/suite.log | cut -c1-200
  t0=$SECONDS
  timeout -k 10 100 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_small_batch.py \
    --shared-gpu --tokens 128,512 --iters 10 --warmup 3 --out $R/small --commit $C > $R/small.log 2>&1
  echo "[small batch, shared-GPU dry run] rc=$? in $((SECONDS - t0)) s"; grep -E "^\||Traceback|Error" $R/small.log | head -20
fi
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# Session 30's one-GPU calls (benchmarks/NOTES.md, item 37 and "Session 30").
#
#   bash scripts/device_runs/s30_1gpu.sh COMMIT b1 [FUZZ_S]
#   bash scripts/device_runs/s30_1gpu.sh COMMIT timing
#   bash scripts/device_runs/s30_1gpu.sh COMMIT variant NAME [FUZZ_S]
#   bash scripts/device_runs/s30_1gpu.sh COMMIT stages
#   bash scripts/device_runs/s30_1gpu.sh COMMIT kernels
#
# b1: validation of the B1 fix (NOTES item 37: a copy-engine staging that runs after a failed
#   or aborted slot check poisons its slots; a later reader reports kPeerStopped): item 37's
#   pytest selection (the lagging reader, the missing-peer tests, the regression sample), the
#   audit's narrow and FP8 selections, then the fuzzer for FUZZ_S seconds (default 180; world
#   sizes up to 4, a seed from the clock, recorded in its JSON).
# timing: device time with and without the fix, main's library before it (.base_lib, carried)
#   against this tree's, one process each, alternating twice: scripts/profile_graph_chain.py
#   (W = 1, graph-replayed static calls at 128, 512 and 4096 tokens: the reader's one more
#   compare) and the eager full call of bench_dispatch_combine.py (W = 1, mok only, 128 and
#   4096 tokens). Written to time the staging's slot check too, but a world of one rank stages
#   nothing (backend.py _stage_copy; found in s30-4), so at W = 1 neither half runs it.
# stages: the same A/B as timing's eager half, by stage (scripts/profile_stages.py under
#   torchrun at W = 1, all SMs, 128 and 4096 tokens, base and new alternating twice): its
#   "transfer only" is the cached eager dispatch, CUDA-event timed over 50 calls in one process
#   (at W = 1 without any staging: see timing).
# kernels: the same A/B by kernel (scripts/profile_kernels_1gpu.py --fp8: each kernel's median
#   device time from the torch profiler over 50 calls, bf16 and FP8 dispatches, cached and eager,
#   128 and 4096 tokens, W = 1), base and new alternating twice: the reader's kernel
#   (dispatch_transfer_kernel) without host noise; it showed that W = 1 runs no staging check.
# variant: the regression sample and the fuzzer on a library built with a build knob
#   (.variants/NAME/libmok_cuda.so, carried; e.g. B4's MOK_POLL_RELAXED=1).
C=${1:?commit}; PART=${2:?b1|timing|stages|kernels|variant}
. "$(dirname "$0")/common.sh"
B1_K="lagging or missing_peer or one_rank or world_size_1 or (loopback_matches_reference and 3]) or loopback_static_shape or loopback_cached or (loopback_ring_wraps and 3-)"
BASE_LIB=$PWD/.base_lib/libmok_cuda.so   # the base side of timing, stages and kernels (with_lib)
selection() {  # selection NAME: item 37's pytest selection into $R/NAME.{log,xml}
  local t0=$SECONDS
  timeout -k 10 300 python3 -m pytest -q -rfE tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    tests/test_fp8_dispatch.py -k "$B1_K" --junitxml=$R/$1.xml > $R/$1.log 2>&1
  echo "[$1 selection] rc=$? in $((SECONDS - t0)) s"; tail -3 $R/$1.log; grep -E "FAILED|ERROR" $R/$1.log | head
}
case "$PART" in
  b1)
    FUZZ=${3:-180}
    selection b1
    grep -A3 "lagging" $R/b1.log | head -8
    t0=$SECONDS
    timeout -k 10 200 python3 -m pytest -q -rfE tests/test_fp8_dispatch.py tests/test_cuda_loopback.py \
      tests/test_cuda_backend.py -k "prob_grads_only or narrow_rows or (fp8 and (cuda or loopback))" \
      --junitxml=$R/narrow_fp8.xml > $R/narrow_fp8.log 2>&1
    echo "[narrow + fp8] rc=$? in $((SECONDS - t0)) s"; tail -2 $R/narrow_fp8.log; grep -E "FAILED|ERROR" $R/narrow_fp8.log | head
    fuzz $FUZZ fuzz
    ;;
  timing)
    for i in 1 2; do for v in base new; do
      graph_chain $v $i 120
      with_lib $v timeout -k 10 120 python3 benchmarks/bench_dispatch_combine.py --nproc 1 \
        --shapes t128,dsv3 --systems mok --sm-sweep "" --no-bwd --iters 100 --budget-s 60 \
        --out $R/eager_${v}_$i --commit $C > $R/eager_${v}_$i.log 2>&1
      echo "[eager $v $i] rc=$?"; grep -E "^(t128|dsv3) +mok" $R/eager_${v}_$i.log | head -4
    done; done
    ;;
  stages)
    for i in 1 2; do for t in 128 4096; do for v in base new; do
      with_lib $v timeout -k 10 90 python3 -m torch.distributed.run --nproc-per-node 1 \
        scripts/profile_stages.py --tokens $t --sms 132 --iters 50 \
        --out $R/stages_${v}_t${t}_$i > $R/stages_${v}_t${t}_$i.log 2>&1
      echo "[stages $v t$t $i] rc=$?"; grep -E "^\| 132 " $R/stages_${v}_t${t}_$i.log | head -2
    done; done; done
    ;;
  kernels)
    for i in 1 2; do for v in base new; do
      with_lib $v timeout -k 10 120 python3 scripts/profile_kernels_1gpu.py --fp8 --tokens 128,4096 \
        --iters 50 > $R/kernels_${v}_$i.log 2>&1
      echo "[kernels $v $i] rc=$?"; grep -E "median us|stage_acquire|dispatch_transfer|Memcpy" $R/kernels_${v}_$i.log | head -40
    done; done
    ;;
  variant)
    NAME=${3:?variant name}; FUZZ=${4:-120}
    export MOK_CUDA_LIB=$PWD/.variants/$NAME/libmok_cuda.so
    selection $NAME
    fuzz $FUZZ fuzz_$NAME
    ;;
esac
cd $OUT && tar czf r_$PART.tgz r && rm -rf r

#!/usr/bin/env bash
# Session 42's one-GPU calls (benchmarks/NOTES.md, item 75: the C++ host ops), also session 43's
# (item 77: the backward's calls through them).
#
#   bash scripts/device_runs/s42_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#     PARTS: any of hostops layers eager replay lagging overflow sample sample_py regress megatron
#            mdispatcher mrest rpe_overflow backward77 schedules stall_hunt
#
# Every call first builds the C++ host ops for this machine's torch (common.sh host_ops_build),
# so every part below runs with them on (the default once built) unless it says otherwise.
# hostops   item 75's GPU tests: the op against the Python path bitwise (loopback W = 1, 2), and
#           the one-call / separate-launches and no-gradient bitwise tests (their static calls
#           now go through the op).
# layers    profile_host_layers.py, twice (two processes): every layer with the op, and the
#           backend and Buffer layers with the op off (``*_py``), paired in blocks; since session
#           43 also the backward's cached dispatch and prob-gradient combine, and a whole
#           dispatch + combine + backward (item 77).
# eager     item 76: profile_host_calls.py --ab, eager Buffers with the op off and on
#           (MOK_HOST_OPS=0 / 1) in one process, alternating blocks, twice (two processes).
# replay    s42-2's fuzzer failure (case seed 144314762776580: a static rows_per_expert call on
#           the side-stream schedule sent to the eager ops), op on and off, after its fix.
# sample    the CUDA sample of the regression selections (the mutation audit's), op on.
# sample_py the same with MOK_HOST_OPS=0 (the Python path, whose allocations moved).
# regress   the one-GPU regression selections (common.sh), op on.
# schedules regress's alternative-schedule selection alone (session 44).
# stall_hunt s43-3's stalled loopback test, hunted (session 44): the host-read guard's GPU test
#           (loopback.settle_host_reads), the errors selection STALL_ERRORS_N times (default 3),
#           then the test's worker repeated by scripts/repeat_loopback.py (REPEAT_S seconds each
#           for its own seed and for fresh seeds).
# lagging   the lagging-reader test (its stall now hooks the op's dispatch_rows) three times, and
#           the error-path selection.
# overflow  the loopback static-overflow tests (s42-4: a rank's side-stream creation waited for
#           its peers' kernels to time out; the stream is now made before the workspace) three times.
# mdispatcher tests/megatron/test_megatron_dispatcher.py's GPU tests on 0.19.2 (the dispatcher's
#           eager calls now go through the op).
# mrest     the GPU tests of tests/megatron's full-graph, features and recompute files on 0.19.2
#           (CUDA-graph capture of the drop-and-pad dispatch through the op among them; not run in
#           session 42), under MREST_LIMIT_S (default 480).
# megatron  the Megatron T_max twins (common.sh; megatron-core 0.19.2 from the carried .whl).
# Then the fuzzer for FUZZ_S seconds (default 30; 0: none), op on.
# Carry: megatron_mok/_lib/libmok_cuda.so (not the whole _lib: that would replace the device's
# host_ops build); .whl (megatron).
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-30}
. "$(dirname "$0")/common.sh"
host_ops_build
part() {
case $1 in
hostops)
  run_pytest hostops 300 -m "gpu and not multigpu" tests/test_cuda_loopback.py \
    -k "host_ops or separate_launches or without_gradients" ;;
layers)   # LAYERS_N: the processes' numbers (default "1 2": two)
  for i in ${LAYERS_N:-1 2}; do
    timeout 200 python3 scripts/profile_host_layers.py --out $R/layers$i --tokens 128,512 --commit $C \
      > $R/layers$i.log 2>&1
    echo "[layers $i] rc=$?"; grep -vE "^wrote|busy_host_(dispatch|combine)" $R/layers$i.log \
      | grep -E "host ops|probes|_py|buffer_us|backend_us|library_us|backward_us|waited|^T=" | head -110
  done ;;
eager)
  for i in 1 2; do
    timeout 150 python3 scripts/profile_host_calls.py --out $R/eager$i --ab \
      --settings "MOK_HOST_OPS=0;MOK_HOST_OPS=1" --tokens 128,512 --commit $C > $R/eager$i.log 2>&1
    echo "[eager $i] rc=$?"; grep -E "^T=|probes" $R/eager$i.log | cut -c1-600
  done ;;
replay)
  for v in 1 0; do
    MOK_HOST_OPS=$v timeout 120 python3 scripts/fuzz_dispatch.py --device cuda --replay 144314762776580 \
      --out $R/replay$v > $R/replay$v.log 2>&1
    echo "[replay MOK_HOST_OPS=$v] rc=$?"; tail -2 $R/replay$v.log | cut -c1-400
  done ;;
sample)
  cuda_sample 150 ;;
sample_py)
  MOK_HOST_OPS=0 cuda_sample 150 ;;
regress)
  regress_selections ;;
schedules)   # regress's last selection alone (the part of it s43-3 lost)
  schedules_selection 180 ;;
megatron)
  megatron_t_max_twins ;;
lagging)
  for i in 1 2 3; do
    run_pytest lagging$i 120 -m "gpu and not multigpu" tests/test_cuda_loopback.py -k lagging_reader
  done
  errors_selection 120 ;;
overflow)
  for i in 1 2 3; do
    run_pytest overflow$i 150 -m "gpu and not multigpu" tests/test_cuda_loopback.py -k "static_overflow"
  done ;;
mrest)
  mcore_pytest mrest ${MREST_LIMIT_S:-480} -m "gpu or multigpu" --durations=8 \
    tests/megatron/test_megatron_full_graph.py tests/megatron/test_megatron_features.py \
    tests/megatron/test_megatron_recompute.py ;;
mdispatcher)
  mcore_pytest mdispatcher ${MDISPATCHER_LIMIT_S:-240} -m "gpu or multigpu" --durations=8 \
    tests/megatron/test_megatron_dispatcher.py ;;
rpe_overflow)   # s43-3: the W = 3 loopback rows_per_expert overflow test ran past its 120 s selection
  run_pytest rpe_overflow 60 -m "gpu and not multigpu" --durations=6 tests/test_cuda_loopback.py \
    tests/test_cuda_backend.py -k "rows_per_expert_overflow" ;;
stall_hunt)     # session 44: s43-3's stall of the W = 3 rows_per_expert overflow test, hunted: the
  # errors selection it stalled in (STALL_ERRORS_N times), then the test's worker alone, repeated
  # (scripts/repeat_loopback.py; its seed, then fresh seeds); a stall of 5+ s lands in *.stalls
  run_pytest host_reads 60 -m "gpu and not multigpu" tests/test_cuda_loopback.py -k "host_read"
  for i in $(seq ${STALL_ERRORS_N:-3}); do errors_selection 100; mv $R/errors.log $R/errors$i.log; done
  for seeds in fixed fresh; do
    MOK_LOOPBACK_STALL_LOG=$R/repeat_$seeds.stalls timeout -k 10 ${REPEAT_LIMIT_S:-$((${REPEAT_S:-60} + 80))} python3 \
      scripts/repeat_loopback.py tests/test_cuda_backend.py:_rows_overflow --world 3 --args '[78]' \
      $([ $seeds = fresh ] && echo --fresh-seeds) --seconds ${REPEAT_S:-60} --timeout-s 150 \
      --out $R/repeat_$seeds.json > $R/repeat_$seeds.log 2>&1
    echo "[repeat $seeds] rc=$?"; grep -vE "^\[[0-9]+ runs\]" $R/repeat_$seeds.log | tail -6 | cut -c1-600
  done ;;
backward77)     # item 77's regression selections in one part, under shorter limits than regress's
  narrow_fp8_selection 90
  cuda_sample 120
  errors_selection 80 "($ERRORS_K) and not rows_per_expert_overflow" ;;
*) echo "unknown part $1"; exit 2 ;;
esac
}
run_parts "$PARTS" $FUZZ

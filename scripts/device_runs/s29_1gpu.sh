#!/usr/bin/env bash
# Session 29's one-GPU calls (benchmarks/NOTES.md, "Session 29").
#
#   bash scripts/device_runs/s29_1gpu.sh COMMIT step3 [LIMIT_S]
#   bash scripts/device_runs/s29_1gpu.sh COMMIT audit ONLY [LIMIT_S] [FUZZ_S]
#   bash scripts/device_runs/s29_1gpu.sh COMMIT chain
#
# step3: step 3 of the first 2-GPU call exactly as scripts/device_runs/README.md writes it
#   (`PYTEST_ADDOPTS='-m "gpu or multigpu"' bash examples/run_gpu_ab.sh OUT tests`: the GPU
#   tests of tests/megatron, megatron-core installed from the carried .whl), as a shared-GPU dry
#   run (MOK_TEST_SHARED_GPU=1), stopped with SIGINT at LIMIT_S (default 480). New since s28-4:
#   the exit watchdog (tests/exit_watchdog.py, 60 s): a pytest that does not exit lists its live
#   children and thread stacks and exits 86. Carry .whl and megatron_mok/_lib.
# audit: the CUDA mutation audit (scripts/mutation_audit_cuda.py run) of the mutants named in
#   ONLY (comma-separated; built on the CPU machine into .mutants, carried), baseline first;
#   then the fuzzer on the unmutated library for FUZZ_S seconds (default 0: none), world sizes
#   up to 4, a seed from the clock (recorded in its JSON).
# chain: device time of item 37's two changes (NOTES): scripts/profile_graph_chain.py (W = 1,
#   graph-replayed static calls at 128, 512 and 4096 tokens) with the session's starting library
#   (.base_lib, built from 661cd20's csrc and carried) and this tree's, one process each,
#   alternating twice.
C=${1:?commit}; PART=${2:?step3|audit|chain}
. "$(dirname "$0")/common.sh"
case "$PART" in
  step3)
    LIMIT=${3:-480}; t0=$SECONDS
    MOK_TEST_SHARED_GPU=1 MOK_TESTS_LIMIT_S=$LIMIT MOK_TEST_LOG_GPU_MEMORY=$R/gpu_memory.tsv \
      PYTEST_ADDOPTS='-m "gpu or multigpu" --durations=30' \
      bash examples/run_gpu_ab.sh $R/ab tests > $R/step3.log 2>&1
    echo "[step 3, shared-GPU] rc=$? in $((SECONDS - t0)) s"
    grep -E "passed|failed|exit watchdog|Interrupted" $R/step3.log | tail -6
    grep -E "FAILED|ERROR" $R/step3.log | head -20
    grep -A12 "exit watchdog\] [0-9]* child" $R/step3.log | head -30
    ps -eo pid,etimes,args | grep -E "python" | grep -v grep | cut -c1-200 > $R/ps_after.txt
    echo "python processes left: $(wc -l < $R/ps_after.txt)"
    echo "GPU memory after each test (MiB, all processes), largest:"
    sort -t$'\t' -k3 -n -r $R/gpu_memory.tsv 2>/dev/null | cut -f1,3 | sed 's/.*:://' | head -5
    ;;
  audit)
    ONLY=${3:?mutant names}; LIMIT=${4:-560}; FUZZ=${5:-0}
    timeout -k 10 $LIMIT python3 scripts/mutation_audit_cuda.py run --libs .mutants --out $R/audit \
      --only "$ONLY" --fuzz-seconds 30 > $R/audit.log 2>&1
    echo "[mutation audit] rc=$?"; grep -E "^\[|^==" $R/audit.log | cut -c1-260
    fuzz $FUZZ fuzz
    ;;
  chain)
    BASE_LIB=$PWD/.base_lib/libmok_cuda.so
    for i in 1 2; do for v in base new; do
      graph_chain $v $i 200
    done; done
    ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# Session 36's one-GPU calls (benchmarks/NOTES.md, item 54: the receive budget).
#
#   bash scripts/device_runs/s36_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#     PARTS: any of budget regress megatron replay pdl fix
#
# budget    tests/test_recv_budget.py's GPU tests (world 1, and 2 processes sharing the GPU:
#           MOK_TEST_SHARED_GPU=1), the CUDA-graph replay with a budget, the static-shape and
#           rows_per_expert overflow tests (their error path shares the layout's changed
#           lines), the C ABI tests and the failed-launch test (ABI 17).
# regress   the CUDA regression sample of the mutation audit, the narrow / FP8 selections, the
#           error paths and the alternative schedules at world size 4 (every dispatch runs the
#           changed layout scan).
# megatron  tests/megatron's GPU tests of the budget file(s) (test_megatron_*budget*.py), on
#           megatron-core 0.19.2 (the carried .whl).
# replay    s36-1's one fuzzer failure (case seed 57587769775781: a W=1 graph capture
#           invalidated): the case alone three times, then s36-1's whole sequence up to it
#           (master seed 1003114137, 142 cases), each on this tree and on .base_tree (80a5465,
#           session 35's main, its own library: carried), to see whether the change caused it.
# pdl       the two tests s36-1 failed on a test-side return value (_graph's).
# fix       after s36-2's two fuzzer mismatches (a rank with a budget of 0 left its side values
#           unwritten): the two cases replayed, then tests/test_recv_budget.py's GPU tests
#           (with the new ring-reuse test at 2 and 3 processes sharing the GPU).
# Then the fuzzer for FUZZ_S seconds (default 30; 0: none).
# Carry: megatron_mok/_lib, .whl (megatron-core 0.19.2), .base_tree (replay).
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-30}
. "$(dirname "$0")/common.sh"
SITE=/tmp/site
for PART in $PARTS; do
t0=$SECONDS
case $PART in
budget)
  budget_selection ;;
regress)
  regress_selections ;;
megatron)
  [ -d $SITE/megatron ] || install_wheels .whl $SITE
  FILES=$(ls tests/megatron/test_megatron_*budget*.py 2>/dev/null)
  PYTHONPATH=$SITE:$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=4 MOK_TEST_SHARED_GPU=1 \
    run_pytest megatron ${MEGATRON_LIMIT_S:-240} -m "gpu or multigpu" --durations=10 $FILES ;;
replay)
  # This tree runs s36-1's fuzzer (scripts/fuzz_dispatch_s36r1.py, untracked, made with
  # `git show db4f94c:scripts/fuzz_dispatch.py`: the merged fuzzer draws budgets, so its cases
  # differ); .base_tree (git archive 80a5465, its library built) runs its own, the same file.
  for TREE in . .base_tree; do
    FZ=scripts/fuzz_dispatch.py; [ $TREE = . ] && FZ=scripts/fuzz_dispatch_s36r1.py
    for i in 1 2 3; do
      (cd $TREE && timeout -k 10 120 python3 $FZ --device cuda --replay 57587769775781 \
        --max-world 4 --max-tokens 600 --out $R/replay_${TREE#.}_$i > $R/replay_${TREE#.}_$i.log 2>&1)
      echo "[replay $TREE $i] rc=$?"; tail -1 $R/replay_${TREE#.}_$i.log
    done
    (cd $TREE && timeout -k 10 150 python3 $FZ --device cuda --seed 1003114137 --cases 142 \
      --max-world 4 --max-tokens 600 --out $R/seq_${TREE#.} > $R/seq_${TREE#.}.log 2>&1)
    echo "[sequence $TREE] rc=$?"; tail -1 $R/seq_${TREE#.}.log; grep -E "FAILED" $R/seq_${TREE#.}.log | cut -c1-200
  done ;;
fix)
  for SEED in 211296326008252 174311080010849; do
    timeout -k 10 120 python3 scripts/fuzz_dispatch.py --device cuda --replay $SEED --max-world 4 \
      --max-tokens 600 --out $R/fix_$SEED > $R/fix_$SEED.log 2>&1
    echo "[replay $SEED] rc=$?"; tail -1 $R/fix_$SEED.log
  done
  MOK_TEST_SHARED_GPU=1 run_pytest fix_budget 240 -m "gpu or multigpu" --durations=8 tests/test_recv_budget.py ;;
pdl)
  run_pytest pdl 120 -m "gpu and not multigpu" tests/test_cuda_loopback.py -k "world_size_1_with_and_without_pdl" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
echo "[$PART] $((SECONDS - t0)) s"
done
fuzz $FUZZ fuzz
cd $OUT && tar czf r.tgz r && rm -rf r

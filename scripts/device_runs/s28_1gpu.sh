#!/usr/bin/env bash
# Session 28's one-GPU calls (benchmarks/NOTES.md, "Session 28", item 33).
#
#   bash scripts/device_runs/s28_1gpu.sh COMMIT megatron [LIMIT_S] [K]
#
# megatron: step 3 of the first 2-GPU call (`examples/run_gpu_ab.sh OUT tests`: tests/megatron
# whole, megatron-core from the carried .whl) as a shared-GPU dry run, verbose, with a JUnit file
# and the slowest tests; pytest is interrupted (SIGINT, so it still prints its summary) at
# LIMIT_S, and the Python processes still alive then are listed (s28-2 reached 100% and then
# did not exit). K: a pytest -k expression (default: every test). The GPU memory each process
# holds after each test goes to r/gpu_memory.tsv (MOK_TEST_LOG_GPU_MEMORY, tests/conftest.py).
C=${1:?commit}; PART=${2:?megatron}; LIMIT=${3:-430}; K=${4:-}
. "$(dirname "$0")/common.sh"
if [ "$PART" = megatron ]; then
  mkdir -p /tmp/site19 && install_wheels .whl /tmp/site19 || exit 1
  export PYTHONPATH=/tmp/site19 MOK_TEST_SHARED_GPU=1 MOK_TEST_TIMEOUT=240 PYTHONFAULTHANDLER=1 \
    MOK_TEST_LOG_GPU_MEMORY=$R/gpu_memory.tsv
  t0=$SECONDS
  timeout -s INT -k 30 $LIMIT python3 -m pytest tests/megatron -v -rfEs --tb=short -p no:cacheprovider \
    --durations=25 --junitxml $R/megatron.xml ${K:+-k "$K"} > $R/megatron.log 2>&1
  echo "[tests/megatron, shared-GPU] rc=$? in $((SECONDS - t0)) s"
  grep -cE " PASSED" $R/megatron.log | sed 's/^/passed: /'
  grep -E " FAILED| ERROR" $R/megatron.log | head -20
  grep -E "^E  " $R/megatron.log | head -30 | cut -c1-250
  grep -E "passed|failed" $R/megatron.log | tail -2
  ps -eo pid,etimes,args | grep -E "python" | grep -v grep | cut -c1-200 > $R/ps_after.txt
  echo "python processes left: $(wc -l < $R/ps_after.txt)"; head -8 $R/ps_after.txt
  echo "GPU memory after each test (MiB, all processes):"; cut -f1,2,3 $R/gpu_memory.tsv | sed 's/.*:://' | tail -40
fi
cd $OUT && tar czf r.tgz r && rm -rf r

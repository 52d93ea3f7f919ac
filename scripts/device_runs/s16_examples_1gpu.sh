#!/usr/bin/env bash
# Run s16-6 (benchmarks/results/README.md): first GPU runs, on ONE GPU, of what session 15 left
# CPU-tested only: the example's --moe-shared-expert-overlap flags through run_gpu_ab.sh's
# ab_shared stage (NPROC=1: alltoall and mok each train 60 steps with an overlapped shared
# expert), and bench_layer.py's :overlap / :high variants in its interleaved schedule.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
export PYTHONPATH=/tmp/site19 PYTHON=python3 NPROC=1
timeout -k 5 240 bash examples/run_gpu_ab.sh $R/ab ab_shared > $R/ab_shared.log 2>&1
echo "[ab_shared] rc=$?"; tail -8 $R/ab_shared.log
timeout -k 5 100 python3 benchmarks/bench_layer.py --dispatchers alltoall,alltoall:overlap,mok,mok:overlap,mok:overlap:high \
  --shared-ffn 1024 --tokens 4096 --iters 20 --warmup 3 --out-dir $R/layer --tag s16_overlap > $R/bench_layer.log 2>&1
echo "[bench_layer] rc=$?"; grep -E "median|rror" $R/bench_layer.log | tail -7
cd $OUT && tar czf r.tgz r && rm -rf r

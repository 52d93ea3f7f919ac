#!/usr/bin/env bash
# Run s17-3 (benchmarks/results/README.md, NOTES (RR)): CUDA-graph capture of a static-shape
# dispatch with rows_per_expert (W=1, 3 loopback ranks), then the Megatron layer with
# drop-and-pad at W=1: alltoall and mok interleaved, and the same pair dropless.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_backend.py tests/test_cuda_loopback.py \
  -k "graph" -rs > $R/graph_tests.log 2>&1
echo "[graph tests] rc=$?"; tail -2 $R/graph_tests.log; grep -E "^(FAILED|ERROR)|Error:" $R/graph_tests.log | head -20
for mode in dropandpad dropless; do
  extra=""; [ $mode = dropandpad ] && extra="--drop-and-pad 1.0"
  PYTHONPATH=/tmp/site19 timeout -k 5 150 python3 benchmarks/bench_layer.py --dispatchers alltoall,mok $extra \
    --tokens 4096 --hidden 2048 --num-experts 16 --topk 4 --iters 40 --warmup 5 --out-dir $R/layer --tag s17_$mode \
    > $R/bench_layer_$mode.log 2>&1
  echo "[bench_layer $mode] rc=$?"; tail -3 $R/bench_layer_$mode.log
done
cd $OUT && tar czf r.tgz r && rm -rf r

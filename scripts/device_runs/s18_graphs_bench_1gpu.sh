#!/usr/bin/env bash
# Run s18-5 (benchmarks/results/README.md): NOTES (SS): a layer under Megatron's partial CUDA
# graphs (moe_router + moe_preprocess, local impl) against the same layer eager, for alltoall and
# mok, interleaved, ONE GPU, megatron-core 0.19.2, at a host-bound and the default size; then the
# partial-graph tests at this commit (0.19.2 and 0.16.1).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
install_wheels .whl16 /tmp/site16 || exit 1
D=alltoall,alltoall:graphs,mok,mok:graphs
for shape in "--tokens 1024 --hidden 1024 --ffn-hidden 512 --tag small" "--tokens 4096 --hidden 2048 --tag default"; do
  PYTHONPATH=/tmp/site19 timeout -k 5 150 python3 benchmarks/bench_layer.py --dispatchers $D $shape \
    --iters 40 --warmup 5 --out-dir $R >> $R/bench_graphs.log 2>&1
  echo "[bench $shape] rc=$?"
done
grep -E "median|Error" $R/bench_graphs.log | head -20
for v in 19 16; do
  PYTHONPATH=/tmp/site$v timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider \
    tests/megatron/test_megatron_dispatcher.py tests/megatron/test_megatron_examples.py -k "partial or bench" -rs > $R/partial_graphs_0$v.log 2>&1
  echo "[partial graphs + bench tests, 0.$v] rc=$?"; tail -1 $R/partial_graphs_0$v.log
  grep -E "^(FAILED|ERROR)|Error|assert" $R/partial_graphs_0$v.log | head -10
done
cd $OUT && tar czf r.tgz r && rm -rf r

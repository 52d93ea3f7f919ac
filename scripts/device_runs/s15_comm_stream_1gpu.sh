#!/usr/bin/env bash
# Run s15-3 (benchmarks/results/README.md): MoK's kernels on a high-priority stream beside an
# overlapped shared expert (MOK_COMM_STREAM, NOTES (NN)), ONE GPU, megatron-core 0.19.2 (the
# carried wheel): bench_layer.py at world size 1, MOK_COMM_STREAM=current vs auto (high with
# the overlap) vs high, alternating processes, 2 rounds; then the one-GPU Megatron tests.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site && export PYTHONPATH=/tmp/site || exit 1
for i in 1 2; do
  for cs in current auto high; do
    for shape in large small; do
      if [ $shape = large ]; then A="--tokens 16384 --hidden 4096 --ffn-hidden 2048 --shared-ffn 4096"; else A="--tokens 4096 --hidden 2048 --shared-ffn 2048"; fi
      MOK_COMM_STREAM=$cs timeout -k 5 90 torchrun --nproc-per-node 1 benchmarks/bench_layer.py --dispatchers mok,mok:overlap \
        $A --iters 30 --out-dir $R/layer --tag s15_${shape}_${cs}_$i > $R/layer_${shape}_${cs}_$i.log 2>&1
      echo "[$shape $cs $i] rc=$? $(grep -E 'median' $R/layer_${shape}_${cs}_$i.log | awk '{print $1, $4}' | tr '\n' ' ')"
    done
  done
done
timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider tests/megatron -k "one_gpu or shared" -rs > $R/megatron_tests.log 2>&1
echo "[megatron tests] rc=$?"; tail -3 $R/megatron_tests.log; grep -E "^(FAILED|ERROR)|Error:" $R/megatron_tests.log | head -20
cd $OUT && tar czf r.tgz r && rm -rf r

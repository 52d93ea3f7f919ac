#!/usr/bin/env bash
# Run s15-2 (benchmarks/results/README.md): moe_shared_expert_overlap through the mok dispatcher
# on ONE GPU with megatron-core 0.19.2 (the carried wheel, .whl/): bench_layer.py at world size
# 1 with a shared expert (NOTES (MM)), then every test in tests/megatron (the new one-GPU
# overlap tests among them).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site && export PYTHONPATH=/tmp/site || exit 1
python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" | tee $R/megatron_version.txt
D=alltoall,alltoall:overlap,mok,mok:overlap
timeout -k 5 100 torchrun --nproc-per-node 1 benchmarks/bench_layer.py --dispatchers $D --tokens 4096 \
  --hidden 2048 --shared-ffn 2048 --iters 30 --out-dir $R/layer --tag s15_shared_small > $R/layer_small.log 2>&1
echo "[bench_layer small] rc=$?"; grep -E "median|Error" $R/layer_small.log
timeout -k 5 150 torchrun --nproc-per-node 1 benchmarks/bench_layer.py --dispatchers $D --tokens 16384 \
  --hidden 4096 --ffn-hidden 2048 --shared-ffn 4096 --iters 30 --out-dir $R/layer --tag s15_shared_large > $R/layer_large.log 2>&1
echo "[bench_layer large] rc=$?"; grep -E "median|Error" $R/layer_large.log
timeout -k 5 330 python3 -m pytest -q -p no:cacheprovider tests/megatron -rs > $R/megatron_tests.log 2>&1
echo "[megatron tests] rc=$?"; tail -8 $R/megatron_tests.log; grep -E "^(FAILED|ERROR)|Error:" $R/megatron_tests.log | head -20
cd $OUT && tar czf r.tgz r && rm -rf r

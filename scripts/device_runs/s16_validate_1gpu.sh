#!/usr/bin/env bash
# Run s16-1 (benchmarks/results/README.md): main at the start of session 16 on ONE GPU: the
# Megatron tests on megatron-core 0.19.2 and 0.16.1 (s15_megatron_final_1gpu.sh: first GPU run
# of routing_map_to_topk's 4-op form and of _assert_runs_bitwise in the GPU workers), then
# bench_layer.py's interleaved schedule with its :overlap / :high variants (first GPU run).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
bash "$(dirname "$0")/s15_megatron_final_1gpu.sh" "$C" || true
mkdir -p $R && cd $OUT && tar xzf r.tgz && rm r.tgz && cd - > /dev/null
PYTHONPATH=/tmp/site19 timeout -k 5 120 python3 benchmarks/bench_layer.py --dispatchers alltoall,mok,mok:high,mok:overlap,mok:overlap:high \
  --shared-ffn 1024 --tokens 4096 --iters 20 --warmup 3 --out-dir $R/layer --tag s16 > $R/bench_layer.log 2>&1
echo "[bench_layer] rc=$?"; tail -12 $R/bench_layer.log
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# Run s16-2 (benchmarks/results/README.md, NOTES (OO)): the Megatron dispatcher's SM budget on
# ONE GPU. (1) op level, W=1, dsv3: bench_dispatch_combine.py's mok SM sweep 24..96;
# (2) layer level, W=1: bench_layer.py interleaved, mok (the new default: 48 SMs) against
# mok:sms=24 (the old default) and mok:sms=64, alltoall beside, two processes in turn;
# (3) the one-GPU Megatron tests on 0.19.2 (their layers now run on 48 SMs).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
timeout -k 5 200 python3 -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_dispatch_combine.py \
  --out $R/suite --commit $C --systems mok --shapes dsv3 --sm-sweep 24,32,48,64,96 > $R/suite.log 2>&1
echo "[suite] rc=$?"; grep -E "SM sweep|num_sms|dsv3|checks" $R/suite.log | tail -14
for round in 1 2; do
  PYTHONPATH=/tmp/site19 timeout -k 5 150 python3 benchmarks/bench_layer.py --dispatchers alltoall,mok,mok:sms=24,mok:sms=64 \
    --hidden 7168 --ffn-hidden 512 --num-experts 16 --topk 8 --tokens 4096 --iters 40 --warmup 5 \
    --out-dir $R/layer --tag s16_sms_r$round > $R/bench_layer_r$round.log 2>&1
  echo "[bench_layer round $round] rc=$?"; grep -E "median|Error|error" $R/bench_layer_r$round.log | tail -6
done
PYTHONPATH=/tmp/site19 timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider tests/megatron -k "one_gpu or num_sms" -rs > $R/megatron_0192_tests.log 2>&1
echo "[0.19.2 one-GPU tests] rc=$?"; tail -2 $R/megatron_0192_tests.log; grep -E "^(FAILED|ERROR)" $R/megatron_0192_tests.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

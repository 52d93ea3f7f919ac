#!/usr/bin/env bash
# Run s12-6 (benchmarks/results/README.md): the small-call SM budget with the dispatch split:
# per-kernel profile at W=1 (128, 512 tokens) with the default 24 SMs and with
# MOK_SMALL_CALL_SMS=48, alternating twice, then bench_small_batch.py once each.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
for round in 1 2; do for v in sms24 small48; do
  e=MOK_X=1; [ $v = small48 ] && e=MOK_SMALL_CALL_SMS=48
  env $e timeout -k 5 60 python3 scripts/profile_kernels_1gpu.py --tokens 128,512 --iters 20 > $R/kernels_${v}_$round.log 2>&1
  echo "[kernels $v $round] rc=$?"; grep -E "T=|dispatch_transfer|combine_transfer" $R/kernels_${v}_$round.log | cut -c1-80
done; done
for v in sms24 small48; do
  e=MOK_X=1; [ $v = small48 ] && e=MOK_SMALL_CALL_SMS=48
  env $e timeout -k 5 80 python3 benchmarks/bench_small_batch.py --out $R/ab_$v --commit $C --worlds 1 > $R/ab_$v.log 2>&1
  echo "[small $v] rc=$?"; grep "^| 1 " $R/ab_$v.log
done
cd $OUT && tar czf r.tgz r && rm -rf r

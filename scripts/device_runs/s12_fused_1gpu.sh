#!/usr/bin/env bash
# Run s12-2 (benchmarks/results/README.md): #45 fused layout on one GPU: A/B (fused vs three kernels), then tests
C=${1:?commit}
. "$(dirname "$0")/common.sh"
python3 -c "from megatron_mok.cuda import library; print('abi', library.get().mok_abi_version())"
for round in 1 2; do for v in fused three; do
  f=1; [ $v = three ] && f=0
  MOK_LAYOUT_FUSED=$f timeout -k 5 90 python3 benchmarks/bench_small_batch.py --out $R/ab_${v}_$round --commit $C > $R/ab_${v}_$round.log 2>&1
  echo "[$v round $round] rc=$?"; grep "^| [12] " $R/ab_${v}_$round.log
done; done
for v in fused three; do
  f=1; [ $v = three ] && f=0
  MOK_LAYOUT_FUSED=$f timeout -k 5 60 python3 scripts/profile_kernels_1gpu.py --tokens 128,512 --iters 20 > $R/kernels_$v.log 2>&1
  echo "[kernels $v] rc=$?"; grep -E "T=|kernel" $R/kernels_$v.log | cut -c1-90
done
timeout -k 5 360 python3 -m pytest -q tests/test_cuda_library_abi.py tests/test_cuda_loopback.py tests/test_cuda_backend.py -p no:cacheprovider -x > $R/tests.log 2>&1; echo "tests rc=$?"; tail -4 $R/tests.log
timeout -k 5 60 python3 -m megatron_mok.bench --json $R/main_job.json > $R/main_job.log 2>&1; echo "main rc=$?"; grep "^| 4096" $R/main_job.log
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# Run s13-5 (benchmarks/results/README.md): main with #48 (PDL) and #49 (64 SMs for small calls
# by default): every CUDA test one GPU can run, the small-batch tool at its defaults (W=1 and a
# 2-rank loopback group), the main job.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
timeout -k 5 380 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_library_abi.py tests/test_cuda_loopback.py tests/test_cuda_backend.py -x > $R/tests.log 2>&1
echo "tests rc=$?"; tail -3 $R/tests.log
timeout -k 5 100 python3 benchmarks/bench_small_batch.py --out $R/small --commit $C > $R/small.log 2>&1
echo "[small] rc=$?"; grep "^| " $R/small.log
timeout -k 5 80 python3 -m megatron_mok.bench --json $R/main_job.json > $R/main_job.log 2>&1
echo "[main] rc=$?"; grep -E "correctness|\| 4096" $R/main_job.log
cd $OUT && tar czf r.tgz r && rm -rf r

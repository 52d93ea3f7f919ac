#!/usr/bin/env bash
# Run s14-4 (benchmarks/results/README.md): #51 against its own separate launches in ONE process
# (scripts/profile_host_calls.py --ab: alternating blocks, so the host's drift seen in s14-2 and
# s14-3 hits both alike), twice; then every CUDA test one GPU can run.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
for i in 1 2; do
  timeout -k 5 120 python3 scripts/profile_host_calls.py --ab --out $R/ab_$i --commit $C --tokens 128,512 \
    --calls 2000 --blocks 50 > $R/ab_$i.log 2>&1
  echo "[ab $i] rc=$?"; grep -E "^T=|probes|Error" $R/ab_$i.log
done
timeout -k 5 330 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_library_abi.py tests/test_cuda_loopback.py tests/test_cuda_backend.py -x > $R/tests.log 2>&1
echo "tests rc=$?"; tail -3 $R/tests.log
cd $OUT && tar czf r.tgz r && rm -rf r

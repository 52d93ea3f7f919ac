#!/usr/bin/env bash
# Run s14-1 (benchmarks/results/README.md): #51 (one library call per static dispatch, one for
# an eager dispatch's fill + transfer, cached smem grants) against the tree before it, whose
# checkout (with its own ABI-7 library) is carried at BASE_ROOT: scripts/profile_host_calls.py
# from each tree in turn, 3 alternating rounds (host time per call, latency, back-to-back pairs,
# graph replays with and without the graph's launch). Then every CUDA test one GPU can run.
C=${1:?commit}
BASE_ROOT=${2:-.carry/base}
. "$(dirname "$0")/common.sh"
for i in 1 2 3; do
  for v in base new; do
    root=.; [ $v = base ] && root=$BASE_ROOT
    timeout -k 5 90 python3 scripts/profile_host_calls.py --out $R/host_${v}_$i --root $root --tag $v \
      --commit $C --tokens 128,512 > $R/host_${v}_$i.log 2>&1
    echo "[host $v $i] rc=$?"; grep -E "^T=|megatron_mok from|Error" $R/host_${v}_$i.log
  done
done
timeout -k 5 100 python3 benchmarks/bench_small_batch.py --out $R/small --commit $C --tokens 128,512 --worlds 1 > $R/small.log 2>&1
echo "[small] rc=$?"; grep "^| " $R/small.log
timeout -k 5 330 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_library_abi.py tests/test_cuda_loopback.py tests/test_cuda_backend.py -x > $R/tests.log 2>&1
echo "tests rc=$?"; tail -3 $R/tests.log
cd $OUT && tar czf r.tgz r && rm -rf r

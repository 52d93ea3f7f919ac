#!/usr/bin/env bash
# Run s12-5 (benchmarks/results/README.md): where a small dispatch pull's time goes at W=1:
# scripts/profile_stages.py (per-block start/end traces) with this tree's library, then with
# a MOK_DISPATCH_CLOCKS=1 build of it (carried as .carry/lib_dclocks/libmok_cuda.so: the
# pulling warps' cycles by kind), split (default) and unsplit (MOK_DISPATCH_SPLIT=0).
C=${1:?commit}
CLK=${CLK_LIB:-.carry/lib_dclocks/libmok_cuda.so}
. "$(dirname "$0")/common.sh"
stages() {  # stages NAME TOKENS [ENV=VALUE ...]
    local name=$1 t=$2; shift 2
    env "$@" timeout -k 5 90 python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((20000 + RANDOM % 20000)) \
        scripts/profile_stages.py --tokens $t --sms 24 --iters 30 --out $R/$name > $R/$name.log 2>&1
    echo "[$name] rc=$?"; grep -E "^\| 24 |\[trace\].*dispatch|\[dclocks\]" $R/$name.log | cut -c1-230
}
for t in 128 512; do
  stages plain_t$t $t MOK_X=1
  stages clocks_t$t $t MOK_CUDA_LIB=$CLK
  stages clocks_unsplit_t$t $t MOK_CUDA_LIB=$CLK MOK_DISPATCH_SPLIT=0
done
cd $OUT && tar czf r.tgz r && rm -rf r

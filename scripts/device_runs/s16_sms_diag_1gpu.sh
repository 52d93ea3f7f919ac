#!/usr/bin/env bash
# Run s16-3 (benchmarks/results/README.md, NOTES (OO)): why a W=1 dsv3 dispatch is slower at
# 64 and 96 SMs than at 48 (run s16-2) while combine keeps gaining: profile_stages.py (eager,
# static, transfer-only, combine) over SM counts, with and without PDL, with and without
# copy-engine staging; per-kernel device times at 48, 64 and 96 SMs.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
timeout -k 5 200 python3 -m torch.distributed.run --nproc-per-node 1 scripts/profile_stages.py \
  --sms 32,48,56,64,80,96,132 --kernels --kernel-sms 48,64,96 --env-sweep MOK_PDL=1,0 --out $R/pdl > $R/pdl.log 2>&1
echo "[pdl sweep] rc=$?"; grep -E "^\|" $R/pdl.log
timeout -k 5 150 python3 -m torch.distributed.run --nproc-per-node 1 scripts/profile_stages.py \
  --sms 48,64,96 --env-sweep MOK_DISPATCH_CE_STAGE=1,0 --out $R/ce > $R/ce.log 2>&1
echo "[ce sweep] rc=$?"; grep -E "^\|" $R/ce.log
grep -E "^sms=|mok_|Self CUDA time total" $R/pdl/kernels.txt | cut -c1-160 | head -40
cd $OUT && tar czf r.tgz r && rm -rf r

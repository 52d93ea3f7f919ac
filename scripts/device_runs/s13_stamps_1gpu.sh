#!/usr/bin/env bash
# Run s13-6 (benchmarks/results/README.md): where a small dispatch's layout and fill spend their
# time at W=1 (a MOK_LAYOUT_STAMPS=1 build, carried as .carry/lib_stamps/libmok_cuda.so:
# scripts/profile_layout_stamps.py), then NOTES (FF): a MOK_POLL_SLEEP_MAX_NS=128 build
# (.carry/lib_poll128) against this tree's library, chains of dispatch + combine pairs
# (scripts/profile_graph_chain.py at the defaults), alternating twice.
C=${1:?commit}
BASE_LIB=${POLL_LIB:-.carry/lib_poll128/libmok_cuda.so}   # with_lib base = the poll build here
. "$(dirname "$0")/common.sh"
for pdl in 1 0; do
  MOK_PDL=$pdl MOK_CUDA_LIB=.carry/lib_stamps/libmok_cuda.so timeout -k 5 90 python3 scripts/profile_layout_stamps.py --tokens 128,512 --out $R/stamps_pdl$pdl > $R/stamps_pdl$pdl.log 2>&1
  echo "[stamps pdl=$pdl] rc=$?"; cat $R/stamps_pdl$pdl.log
done
for i in 1 2; do for v in new base; do
  with_lib $v timeout -k 5 90 python3 scripts/profile_graph_chain.py --out $R/chain_${v}_$i --tokens 128,512 --rounds 1 --settings "" --commit $C > $R/chain_${v}_$i.log 2>&1
  echo "[chain $v $i] rc=$?"; grep -A3 "medians over rounds" $R/chain_${v}_$i.log | tail -2
done; done
cd $OUT && tar czf r.tgz r && rm -rf r

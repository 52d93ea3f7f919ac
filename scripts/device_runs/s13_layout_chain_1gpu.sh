#!/usr/bin/env bash
# Runs s13-7 and s13-8 (benchmarks/results/README.md): NOTES (GG), (HH), (II) at W=1. Stamps of a
# MOK_LAYOUT_STAMPS=1 build of this tree (.carry/lib_stamps; run s13-6 has the stamps before),
# then chains of dispatch + combine pairs: this tree's library against the library before (HH)
# (.carry/lib_pre_hh, same C ABI), alternating twice, 128 / 512 / 4096 tokens; then every CUDA
# test one GPU can run.
C=${1:?commit}
BASE_LIB=${BASE_LIB:-.carry/lib_pre_hh/libmok_cuda.so}
. "$(dirname "$0")/common.sh"
MOK_CUDA_LIB=.carry/lib_stamps/libmok_cuda.so timeout -k 5 90 python3 scripts/profile_layout_stamps.py --tokens 128,512 --out $R/stamps > $R/stamps.log 2>&1
echo "[stamps] rc=$?"; cat $R/stamps.log | grep -E "T=|block  [01]:"
for i in 1 2; do for v in base new; do
  with_lib $v timeout -k 5 90 python3 scripts/profile_graph_chain.py --out $R/chain_${v}_$i --tokens ${CHAIN_TOKENS:-128,512,4096} --rounds 1 --settings "" --commit $C > $R/chain_${v}_$i.log 2>&1
  echo "[chain $v $i] rc=$?"; grep -A4 "medians over rounds" $R/chain_${v}_$i.log | tail -3
done; done
timeout -k 5 330 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_library_abi.py tests/test_cuda_loopback.py tests/test_cuda_backend.py -x > $R/tests.log 2>&1
echo "tests rc=$?"; tail -3 $R/tests.log
cd $OUT && tar czf r.tgz r && rm -rf r

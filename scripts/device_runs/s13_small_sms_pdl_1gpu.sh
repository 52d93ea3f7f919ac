#!/usr/bin/env bash
# Run s13-3 (benchmarks/results/README.md): MOK_SMALL_CALL_SMS (32, 48, 64) with and without
# programmatic dependent launch at W=1, all settings' Buffers side by side in one process
# (scripts/profile_graph_chain.py), 128 and 512 tokens, 3 alternating rounds (NOTES (EE)).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
S="MOK_PDL=1;MOK_PDL=1,MOK_SMALL_CALL_SMS=32;MOK_PDL=1,MOK_SMALL_CALL_SMS=48;MOK_PDL=1,MOK_SMALL_CALL_SMS=64;MOK_PDL=0;MOK_PDL=0,MOK_SMALL_CALL_SMS=48"
timeout -k 5 240 python3 scripts/profile_graph_chain.py --out $R/chain --tokens 128,512 --rounds 3 --settings "$S" --commit $C > $R/chain.log 2>&1
echo "[chain] rc=$?"; sed -n '/medians over rounds/,/kernel boundaries/p' $R/chain.log | head -20; grep -E "Error|error" $R/chain.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

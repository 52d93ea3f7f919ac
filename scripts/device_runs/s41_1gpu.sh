#!/usr/bin/env bash
# Session 41's one-GPU calls (benchmarks/NOTES.md, item 71).
#
#   bash scripts/device_runs/s41_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#     PARTS: any of flags ab host sample regress megatron
#
# flags     the dispatch with the backend's diagnostic flags off and on, bitwise (loopback W = 1:
#           eager, static, rows_per_expert, a dropping receive budget): separate_launches (#51)
#           and separate_allocations (item 71).
# ab        item 71's A/B: profile_host_calls.py --ab --toggle separate_allocations at 128 and
#           512 tokens (one process, alternating blocks), twice (two processes).
# host      profile_host_calls.py's absolute host / latency / graph columns (no profiler).
# sample    the CUDA sample of the regression selections (the mutation audit's).
# regress   the one-GPU regression selections (common.sh).
# megatron  the Megatron T_max twins (common.sh; megatron-core 0.19.2 from the carried .whl).
# Then the fuzzer for FUZZ_S seconds (default 30; 0: none).
# Carry: megatron_mok/_lib; .whl (megatron).
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-30}
. "$(dirname "$0")/common.sh"
for PART in $PARTS; do
t0=$SECONDS
case $PART in
flags)
  run_pytest flags 200 -m "gpu and not multigpu" tests/test_cuda_loopback.py -k "diagnostic_flag" ;;
ab)
  for i in 1 2; do
    timeout 150 python3 scripts/profile_host_calls.py --out $R/ab$i --ab --toggle separate_allocations \
      --tokens 128,512 --blocks 40 --calls 2000 --commit $C > $R/ab$i.log 2>&1
    echo "[ab $i] rc=$?"; grep -E "^T=" $R/ab$i.log | tr ',' '\n' | grep -E "T=|paired|host_" | head -24
  done ;;
host)
  timeout 150 python3 scripts/profile_host_calls.py --out $R/host --tokens 128,512 --calls 500 \
    --commit $C > $R/host.log 2>&1
  echo "[host] rc=$?"; grep -E "^T=|probes" $R/host.log | cut -c1-600 ;;
sample)
  cuda_sample 150 ;;
regress)
  regress_selections ;;
megatron)
  megatron_t_max_twins ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
echo "[$PART] $((SECONDS - t0)) s"
done
fuzz $FUZZ fuzz
cd $OUT && tar czf r.tgz r && rm -rf r

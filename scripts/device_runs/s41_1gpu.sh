#!/usr/bin/env bash
# Session 41's one-GPU calls (benchmarks/NOTES.md, items 71-74).
#
#   bash scripts/device_runs/s41_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#     PARTS: any of flags host layers layerprof tensorops fp8host sample regress megatron
#
# flags     item 73 on the CUDA backend (no-gradient calls bitwise the Functions' path), and the
#           dispatch queued by one library call and by separate launches, bitwise (loopback
#           W = 1: eager, static, rows_per_expert, a dropping receive budget).
#           (At 06f5ac4, run s41-2, also item 71's separate_allocations flag and its A/B part
#           "ab": profile_host_calls.py --ab --toggle separate_allocations; both removed with
#           the change, which gained nothing.)
# host      profile_host_calls.py's absolute host / latency / graph columns (no profiler).
# layers    items 72-73: profile_host_layers.py (a static call's host time per layer: Buffer, autograd
#           Function, backend, library call with and without PDL, input checks; the Buffer and
#           the Function under torch.no_grad()), twice (two processes).
# layerprof the Buffer layer's host time by function: profile_host_layers.py --profile at 128 tokens.
# tensorops item 74: probe_tensor_ops.py (attribute reads and views on a CPU and a CUDA tensor).
# fp8host   profile_fp8_host.py, a short run (its preamble moved to profile_host_calls.one_gpu_setup).
# sample    the CUDA sample of the regression selections (the mutation audit's).
# regress   the one-GPU regression selections (common.sh).
# megatron  the Megatron T_max twins (common.sh; megatron-core 0.19.2 from the carried .whl).
# Then the fuzzer for FUZZ_S seconds (default 30; 0: none).
# Carry: megatron_mok/_lib; .whl (megatron).
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-30}
. "$(dirname "$0")/common.sh"
part() {
case $1 in
flags)
  run_pytest flags 200 -m "gpu and not multigpu" tests/test_cuda_loopback.py -k "separate_launches or without_gradients" ;;
host)
  timeout 150 python3 scripts/profile_host_calls.py --out $R/host --tokens 128,512 --calls 500 \
    --commit $C > $R/host.log 2>&1
  echo "[host] rc=$?"; grep -E "^T=|probes" $R/host.log | cut -c1-600 ;;
layers)
  for i in 1 2; do
    timeout 150 python3 scripts/profile_host_layers.py --out $R/layers$i --tokens 128,512 --commit $C \
      > $R/layers$i.log 2>&1
    echo "[layers $i] rc=$?"; grep -vE "^wrote" $R/layers$i.log | tail -70
  done ;;
layerprof)
  timeout 200 python3 scripts/profile_host_layers.py --out $R/layerprof --tokens 128 --blocks 10 --calls 500 \
    --profile 3000 --commit $C > $R/layerprof.log 2>&1
  echo "[layerprof] rc=$?"; grep -vE "^wrote" $R/layerprof.log | tail -30
  sed -n '/by tottime/,/by cumulative/p' $R/layerprof/profile_128.txt | cut -c1-150 | head -55 ;;
tensorops)
  timeout 120 python3 scripts/probe_tensor_ops.py --out $R/tensor_ops.json > $R/tensorops.log 2>&1
  echo "[tensorops] rc=$?"; cat $R/tensorops.log ;;
fp8host)
  timeout 150 python3 scripts/profile_fp8_host.py --out $R/fp8host --tokens 128 --blocks 4 --per-block 10 \
    --profile-calls 20 --commit $C > $R/fp8host.log 2>&1
  echo "[fp8host] rc=$?"; tail -5 $R/fp8host.log | cut -c1-300 ;;
sample)
  cuda_sample 150 ;;
regress)
  regress_selections ;;
megatron)
  megatron_t_max_twins ;;
*) echo "unknown part $1"; exit 2 ;;
esac
}
run_parts "$PARTS" $FUZZ

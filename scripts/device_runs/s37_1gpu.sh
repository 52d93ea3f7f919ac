#!/usr/bin/env bash
# Session 37's one-GPU calls (benchmarks/NOTES.md, item 55).
#
#   bash scripts/device_runs/s37_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#     PARTS: any of budget regress mutants unfixed refstop
#
# budget    as s36_1gpu.sh's: the receive budget's GPU tests (world 1, and 2-3 processes
#           sharing the GPU), its graph replay, the overflow tests, the C ABI tests; first run of
#           b0434c2's edit (CudaBackend._dispatch_static's required cap / drop) on a GPU.
# regress   the one-GPU regression selections (common.sh).
# mutants   the receive budget's two CUDA mutants (scripts/mutation_audit_cuda.py; the
#           libraries built here into .mutants37: carried).
# unfixed   does the ring-reuse test catch s36-2's bug? A copy of this tree with 85466ed's fix
#           taken out of megatron_mok/cuda/backend.py (an empty grad_probs passed as a null
#           pointer again) runs test_cuda_budget_zero_beside_peers_reusing_ring_slots at 2 and
#           3 processes sharing the GPU: it should fail there, and pass on this tree.
# refstop  item 56 (the reference backend tells its peers): tests/test_reference_stop.py's GPU
#           twins (2 processes sharing the GPU: GPU status records over gloo), the CUDA stop
#           tests (tests/test_stop_rank.py: the Buffer's changed abort path on the CUDA backend)
#           and the Megatron T_max twins (CPU reference and 2 processes on the GPU, megatron-core
#           0.19.2 from the carried .whl).
# Then the fuzzer for FUZZ_S seconds (default 30; 0: none).
# Carry: megatron_mok/_lib, .mutants37 (mutants), .whl (refstop).
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-30}
. "$(dirname "$0")/common.sh"
for PART in $PARTS; do
t0=$SECONDS
case $PART in
budget)
  budget_selection ;;
regress)
  regress_selections ;;
mutants)
  cuda_mutants .mutants37 budget_drop_reported_as_error,budget_rows_received_clamped 30 ;;
unfixed)
  rm -rf /tmp/unfixed && mkdir /tmp/unfixed && cp -a . /tmp/unfixed/
  python3 - <<'PY'
import re
p = "/tmp/unfixed/megatron_mok/cuda/backend.py"
s = open(p).read()
block = re.compile(r"\n            if grad_probs\.numel\(\) == 0:\n(?:                #[^\n]*\n)+"
                   r"                grad_probs = torch\.zeros\(1, dtype=torch\.float32, device=expert_out\.device\)")
s, n = block.subn("", s)
assert n == 1, f"the fix's block found {n} times"
open(p, "w").write(s)
print("[unfixed] 85466ed's fix taken out of the copy")
PY
  K=zero_beside_peers_reusing_ring_slots
  (cd /tmp/unfixed && MOK_TEST_SHARED_GPU=1 R=$R run_pytest unfixed 240 -m multigpu tests/test_recv_budget.py -k $K)
  MOK_TEST_SHARED_GPU=1 run_pytest fixed 240 -m multigpu tests/test_recv_budget.py -k $K ;;
refstop)
  MOK_TEST_SHARED_GPU=1 run_pytest refstop 300 -m "gpu or multigpu" --durations=6 \
    tests/test_reference_stop.py tests/test_stop_rank.py
  megatron_t_max_twins ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
echo "[$PART] $((SECONDS - t0)) s"
done
fuzz $FUZZ fuzz
cd $OUT && tar czf r.tgz r && rm -rf r

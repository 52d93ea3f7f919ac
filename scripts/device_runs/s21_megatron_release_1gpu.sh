#!/usr/bin/env bash
# Runs s21-4 / s21-5 (benchmarks/results/README.md): the Megatron integration on a
# megatron-core release that megatron_mok/megatron/versions.py lists as supported but that
# had only been read, never run (CI has 0.16.x, the GPU machine 0.19.x):
#
#   bash scripts/device_runs/s21_megatron_release_1gpu.sh COMMIT 17|18
#
# The wheel is carried in .whl17/ or .whl18/ (`pip download megatron-core==0.17.1` / `0.18.2`
# `--python-version 3.12 --only-binary=:all: --no-deps`). Three parts, each under a limit:
# 1. install / config tests and every one-GPU dispatcher test (round trip, layout, MoELayer vs
#    alltoall, shared-expert overlap, drop-and-pad, its graph capture, router padding,
#    partial CUDA graphs); 2. a CPU sample of the multi-rank dispatcher tests (gloo: round
#    trip, layout and gradients, MoELayer vs alltoall, drop-and-pad vs alltoall, expert TP,
#    attention TP + SP); 3. the launcher with Megatron-LM's argument parser.
C=${1:?commit}; V=${2:?17 or 18}
. "$(dirname "$0")/common.sh"
install_wheels .whl$V /tmp/site$V || exit 1
export PYTHONPATH=/tmp/site$V
run() {  # run NAME LIMIT PYTEST_ARGS...
  local name=$1 limit=$2; shift 2
  timeout -k 10 $limit python3 -m pytest -v -p no:cacheprovider -rs --tb=short "$@" > $R/${name}_0$V.log 2>&1
  echo "[$name, 0.$V, limit $limit s] rc=$? passed=$(grep -cE ' PASSED' $R/${name}_0$V.log)"
  grep -E " FAILED| ERROR|SKIPPED \[" $R/${name}_0$V.log | head -12; grep -E "^E " $R/${name}_0$V.log | head -10
  tail -1 $R/${name}_0$V.log
}
run gpu_and_install 130 tests/megatron/test_megatron_install.py tests/megatron/test_megatron_dispatcher.py -m "not multigpu" \
  -k "install or config or routing or expand or cuda_graphs or options or one_gpu or not cpu"
D=tests/megatron/test_megatron_dispatcher.py
run cpu_sample 100 "$D::test_dropless_roundtrip_cpu[2-2]" "$D::test_dispatcher_layout_and_grads_cpu[2-2-bf16]" \
  "$D::test_full_moe_layer_mok_vs_alltoall_cpu" "$D::test_drop_and_pad_mok_vs_alltoall_cpu[2-0.5-probs]" \
  "$D::test_expert_tensor_parallel_cpu[4-2-True]" "$D::test_attention_tensor_parallel_cpu[ETP=TP=2,EP=2]" \
  "$D::test_dropless_roundtrip_cpu[4-4]"
run launcher 150 tests/megatron/test_megatron_entrypoints.py -k "launcher"
cd $OUT && tar czf r.tgz r && rm -rf r

#!/usr/bin/env bash
# One device call on 2 GPUs (nvidia-h200-x2) after the 2-GPU tests passed: the figures the
# README table and the performance issue want, in ~7-8 minutes.
#
#   bash scripts/device_runs/x2_suite.sh COMMIT [AB]
#
# 1. the benchmark suite, every available system (mok, alltoall, torch symmetric memory, and
#    DeepEP when deep_ep is importable, e.g. built beside the project and put on PYTHONPATH),
#    every shape, the SM sweep: benchmarks/bench_dispatch_combine.py under torchrun;
# 2. the main job on both GPUs; 3. small batches on 2 processes (host vs device time);
# 4. with AB=1: same-run stage profiles (scripts/ab_libraries.sh, 24 SMs, 128 and 4096
#    tokens) of this tree against itself with the own-partials staging off
#    (MOK_COMBINE_OWN_STAGED=0, NOTES #38) and with the small layouts unfused
#    (MOK_LAYOUT_FUSED=0, NOTES #45): the 2-GPU outcomes those one-GPU changes lack.
# Everything lands in $OUT/r.tgz; assemble with scripts/results_json.py.
set -uo pipefail
C=${1:?commit}; AB=${2:-1}
. "$(dirname "$0")/common.sh"
nvidia-smi topo -m > $R/topo.txt 2>&1
python3 -c "import deep_ep" 2>/dev/null && echo "deep_ep importable" || echo "deep_ep NOT importable: the suite runs without it"
step() {  # step NAME LIMIT_S CMD...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$R/$name.log" 2>&1
    echo "[$name] rc=$? in $((SECONDS - t0)) s"
}
step suite 200 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_dispatch_combine.py --out $R/suite --commit $C
grep -E "^\|" $R/suite.log | head -40
step main_job 60 python3 -m megatron_mok.bench --json $R/main_job.json
grep -E "^\|" $R/main_job.log
step small_batch 90 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_small_batch.py --out $R/small --commit $C --tokens 128,512
grep -E "^\|" $R/small_batch.log
if [ "$AB" = 1 ]; then
  step ab_own_staged 150 bash scripts/ab_libraries.sh $R/ab_own_staged env:MOK_COMBINE_OWN_STAGED=0 128 4096
  cat $R/ab_own_staged.log
  step ab_layout 80 bash scripts/ab_libraries.sh $R/ab_layout env:MOK_LAYOUT_FUSED=0 128
  cat $R/ab_layout.log
fi
cd $OUT && tar czf r.tgz r && rm -rf r

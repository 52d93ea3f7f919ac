#!/usr/bin/env bash
# Run s19-1 (benchmarks/results/README.md): main at the start of session 19 on ONE GPU (every
# tests/megatron test one GPU runs, on 0.19.2: the review mends 4d38aa3 / 6bec0ab / ee0fd8c
# and the TE-impl CPU test had not run on a GPU), then the shared-GPU probe: two processes as
# a 2-rank group on one GPU, over gloo and over NCCL's multi-rank-per-GPU mode.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
python3 -c "import torch; print('nccl', torch.cuda.nccl.version())"; which nvidia-cuda-mps-control
for b in nccl gloo; do
  PYTHONPATH=. PROBE_LIMIT_S=120 timeout -k 5 140 python3 scripts/device_runs/s19_shared_gpu_probe.py $b $R/probe_$b.json > $R/probe_$b.log 2>&1
  echo "[probe $b] rc=$?"; tail -c 2500 $R/probe_$b.log
done
install_wheels .whl /tmp/site19 || exit 1
PYTHONPATH=/tmp/site19 timeout -k 5 300 python3 -m pytest -q -p no:cacheprovider tests/megatron -rs > $R/megatron_tests_019.log 2>&1
echo "[tests/megatron 0.19.2] rc=$?"; tail -2 $R/megatron_tests_019.log
grep -E "^(FAILED|ERROR)|Error:" $R/megatron_tests_019.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

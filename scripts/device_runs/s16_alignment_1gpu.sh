#!/usr/bin/env bash
# Run s16-4 (benchmarks/results/README.md, NOTES (QQ)): Buffer(expert_alignment) on ONE GPU:
# every CUDA test one GPU runs (C ABI 9; the alignment tests at W=1 and on loopback ranks among
# them), the Megatron router-padding and one-GPU tests (0.19.2), then the cost of A=16 at dsv3.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
timeout -k 5 330 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_library_abi.py tests/test_cuda_loopback.py \
  tests/test_cuda_backend.py tests/test_backend_pointers.py tests/test_expert_alignment.py -x -rs > $R/cuda_tests.log 2>&1
echo "[cuda tests] rc=$?"; tail -2 $R/cuda_tests.log; grep -E "^(FAILED|ERROR)" $R/cuda_tests.log | head
PYTHONPATH=/tmp/site19 timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/megatron -k "padding or one_gpu" -rs > $R/megatron_tests.log 2>&1
echo "[megatron tests] rc=$?"; tail -2 $R/megatron_tests.log; grep -E "^(FAILED|ERROR)" $R/megatron_tests.log | head
timeout -k 5 90 python3 -m torch.distributed.run --nproc-per-node 1 scripts/profile_stages.py \
  --sms 24,48 --expert-alignment 1,16,1,16 --out $R/align > $R/align.log 2>&1
echo "[align cost] rc=$?"; grep -E "^\|" $R/align.log
cd $OUT && tar czf r.tgz r && rm -rf r

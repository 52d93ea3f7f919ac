#!/usr/bin/env bash
# Every GPU proof of the project in one go, for one node with 2 GPUs (nvidia-h200-x2):
#
#   bash scripts/run_gpu_proofs.sh OUT_DIR [COMMIT]
#
# 1. the CUDA library (built here with nvcc if the carried one does not load)
# 2. pytest tests/test_cuda_backend.py tests/test_cuda_loopback.py (CUDA vs reference,
#    bitwise; ring; graphs; timeouts; W = 2, 3, 4, 8 as loopback ranks on one GPU)
# 3. the main job, python -m megatron_mok.bench (standard shape)
# 4. benchmarks/bench_small_batch.py (one GPU: host vs device time of small calls)
# 5. benchmarks/bench_dispatch_combine.py (all systems, all shapes, SM sweep)       [2+ GPUs]
#    and benchmarks/bench_small_batch.py on 2 processes (host vs device time on NVLink) [2+ GPUs]
# 6. Megatron: 60-step A/B (alltoall vs mok), the GPU tests of tests/megatron, bench_layer [2+ GPUs]
# Everything lands in OUT_DIR/proofs.tgz plus OUT_DIR/summary.txt. Each stage has its own
# time limit, so one stuck stage cannot eat the others' time.
set -uo pipefail
OUT=${1:?usage: run_gpu_proofs.sh OUT_DIR [COMMIT]}
COMMIT=${2:-${MOK_COMMIT:-unknown}}
# Every tool below records this commit (a lent machine's .git can be a stale snapshot).
export MOK_COMMIT=$COMMIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
W="$OUT/proofs"
mkdir -p "$W"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
stage() {  # stage NAME LIMIT_S CMD...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$W/$name.log" 2>&1
    local rc=$?
    say "[$name] rc=$rc in $((SECONDS - t0)) s"
    return $rc
}

say "commit $COMMIT; $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
if ! $PYTHON -c "import ctypes; ctypes.CDLL('megatron_mok/_lib/libmok_cuda.so')" 2>/dev/null; then
    stage build 300 make -C csrc
fi
if ! $PYTHON -c "import megatron.core" 2>/dev/null && [ -d .whl ]; then
    $PYTHON -m pip install --no-index --find-links .whl -q megatron-core six regex pyyaml pydantic pytest >/dev/null 2>&1
fi

stage cuda_tests 300 $PYTHON -m pytest -q tests/test_cuda_backend.py tests/test_cuda_loopback.py -p no:cacheprovider
tail -n 3 "$W/cuda_tests.log" | tee -a "$SUMMARY"

stage main_job 60 $PYTHON -m megatron_mok.bench --json "$W/main_job.json"
grep -E "^\|" "$W/main_job.log" | tee -a "$SUMMARY"

stage small_batch 90 $PYTHON benchmarks/bench_small_batch.py --out "$W" --commit "$COMMIT"
grep -E "^\|" "$W/small_batch.log" | tee -a "$SUMMARY"

if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
    say "one GPU: the 2-rank suite and the Megatron A/B need 2 GPUs, not run"
    tar czf "$OUT/proofs.tgz" -C "$OUT" proofs && rm -rf "$W"
    say "done"
    exit 0
fi

stage bench_suite 100 $PYTHON -m torch.distributed.run --nproc-per-node 2 \
    benchmarks/bench_dispatch_combine.py --out "$W" --commit "$COMMIT"
grep -E "^(dsv3|t128|t512) .*mok|ALL PASSED|FAILED" "$W/bench_suite.log" | tail -n 12 | tee -a "$SUMMARY"

stage small_batch_2gpu 90 $PYTHON -m torch.distributed.run --nproc-per-node 2 \
    benchmarks/bench_small_batch.py --out "$W/small_batch_2gpu" --commit "$COMMIT" --tokens 128,512
grep -E "^\|" "$W/small_batch_2gpu.log" | tee -a "$SUMMARY"

stage megatron_ab 100 bash examples/run_gpu_ab.sh "$W/megatron" ab
grep -E "^(alltoall|mok|flex) " "$W/megatron_ab.log" | tee -a "$SUMMARY"
stage megatron_gpu_tests 90 $PYTHON -m pytest -q tests/megatron -m "gpu or multigpu" -p no:cacheprovider
tail -n 2 "$W/megatron_gpu_tests.log" | tee -a "$SUMMARY"
stage bench_layer 60 bash examples/run_gpu_ab.sh "$W/megatron" bench
tail -n 6 "$W/bench_layer.log" | tee -a "$SUMMARY"

tar czf "$OUT/proofs.tgz" -C "$OUT" proofs && rm -rf "$W"
say "done"

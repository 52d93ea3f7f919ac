#!/usr/bin/env bash
# Same-run A/B of two builds of the CUDA library on a 2-GPU machine (developer tool): the
# stage profile (scripts/profile_stages.py, 24 SMs) of BASE_LIB and of this tree's build, one
# after the other on the same machine, for each token count, alternating twice so that a
# drift of the machine shows up as a spread rather than as a difference.
#
#   bash scripts/ab_libraries.sh OUT_DIR BASE_LIB [TOKENS ...]     (default tokens: 128 4096)
#
# BASE_LIB is a libmok_cuda.so built from the base commit (e.g. `git worktree add` it, `make -C
# csrc` there, copy the .so under a git-ignored folder and carry it). Env switches of the tree's
# build (MOK_COMBINE_SPLIT=0, ...) can be A/B'd the same way with BASE_LIB = this tree's build.
# Writes OUT_DIR/{base,new}_t<T>_<i>/profile_stages.json and prints one table row per run.
set -uo pipefail
OUT=${1:?usage: ab_libraries.sh OUT_DIR BASE_LIB [TOKENS ...]}
BASE=${2:?usage: ab_libraries.sh OUT_DIR BASE_LIB [TOKENS ...]}
shift 2
TOKENS=("$@")
[ ${#TOKENS[@]} -eq 0 ] && TOKENS=(128 4096)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
[ -f "$BASE" ] || { echo "no library at $BASE" >&2; exit 2; }
mkdir -p "$OUT"
run() {  # run NAME TOKENS [LIB]
    local name=$1 t=$2 lib=${3:-}
    ( [ -n "$lib" ] && export MOK_CUDA_LIB=$lib
      timeout -k 5 60 $PY -m torch.distributed.run --nproc-per-node 2 "$ROOT/scripts/profile_stages.py" \
          --tokens "$t" --sms 24 --iters 30 --out "$OUT/$name" > "$OUT/$name.log" 2>&1 )
    local rc=$?
    echo "$name (rc=$rc): $(grep -E '^\| 24 ' "$OUT/$name.log" | head -n 1)"
}
echo "| run | SMs | dispatch eager | dispatch static | transfer only | layout | combine |"
for t in "${TOKENS[@]}"; do
    for i in 1 2; do
        run "base_t${t}_$i" "$t" "$BASE"
        run "new_t${t}_$i" "$t"
    done
done

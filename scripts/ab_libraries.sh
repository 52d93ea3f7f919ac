#!/usr/bin/env bash
# Same-run A/B on a 2-GPU machine (developer tool): the stage profile
# (scripts/profile_stages.py, 24 SMs) of a BASE and of this tree, one after the other on the
# same machine, for each token count, alternating AB_ROUNDS times (default 2) so that a drift
# of the machine shows up as a spread rather than as a difference.
#
#   bash scripts/ab_libraries.sh OUT_DIR BASE [TOKENS ...]      (default tokens: 128 4096)
#
# BASE is either
#   - a directory holding a checkout of the base commit with its library built
#     (`git worktree add DIR <commit> && make -C DIR/csrc`, copied under a git-ignored folder
#     and carried): the base runs from there, with its own Python and library (the C ABI
#     version check refuses a library driven by another tree's bindings); or
#   - env:NAME=VALUE[,NAME=VALUE...]: this tree with those variables set for the base runs
#     (e.g. env:MOK_COMBINE_SPLIT=0,MOK_EAGER_FILL_FIRST=1 to A/B the alternative schedules).
# Writes OUT_DIR/{base,new}_t<T>_<i>/profile_stages.json and prints one table row per run.
set -uo pipefail
OUT=${1:?usage: ab_libraries.sh OUT_DIR BASE [TOKENS ...]}
BASE=${2:?usage: ab_libraries.sh OUT_DIR BASE [TOKENS ...]}
shift 2
TOKENS=("$@")
[ ${#TOKENS[@]} -eq 0 ] && TOKENS=(128 4096)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
case "$BASE" in
    env:*) BASE_ROOT=$ROOT; BASE_ENV=${BASE#env:} ;;
    *) [ -f "$BASE/scripts/profile_stages.py" ] || { echo "no checkout at $BASE" >&2; exit 2; }
       BASE_ROOT=$(cd "$BASE" && pwd); BASE_ENV= ;;
esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)   # the base runs from another directory
run() {  # run NAME TOKENS ROOT [ENV_LIST]
    local name=$1 t=$2 root=$3 envs=${4:-}
    ( if [ -n "$envs" ]; then IFS=, read -ra kv <<< "$envs"; for e in "${kv[@]}"; do export "$e"; done; fi
      # A port of its own per run: a run killed by its timeout can leave the last one in use.
      cd "$root" && timeout -k 5 60 $PY -m torch.distributed.run --nproc-per-node 2 \
          --master-port $((20000 + RANDOM % 20000)) scripts/profile_stages.py \
          --tokens "$t" --sms 24 --iters 30 --out "$OUT/$name" > "$OUT/$name.log" 2>&1 )
    local rc=$?
    echo "$name (rc=$rc): $(grep -E '^\| 24 ' "$OUT/$name.log" | head -n 1)"
}
echo "| run | SMs | dispatch eager | dispatch static | transfer only | layout | combine |"
for t in "${TOKENS[@]}"; do
    for i in $(seq 1 "${AB_ROUNDS:-2}"); do
        run "base_t${t}_$i" "$t" "$BASE_ROOT" "$BASE_ENV"
        run "new_t${t}_$i" "$t" "$ROOT"
    done
done

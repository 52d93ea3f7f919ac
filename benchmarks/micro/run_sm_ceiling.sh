#!/usr/bin/env bash
# Build and run the SM-budget ceiling microbenchmark (sm_ceiling.cu) on this machine's GPUs
# (two with peer access add the NVLink cases). Writes OUT_DIR/sm_ceiling.json (+ .log).
#   bash benchmarks/micro/run_sm_ceiling.sh OUT_DIR [COMMIT]
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${1:?usage: run_sm_ceiling.sh OUT_DIR [COMMIT]}
COMMIT=${2:-${MOK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
nvcc -O3 -std=c++17 -I"$HERE/../../csrc/include" -gencode=arch=compute_90a,code=sm_90a \
    "$HERE/sm_ceiling.cu" -o "$OUT/sm_ceiling.bin"
"$OUT/sm_ceiling.bin" > "$OUT/sm_ceiling.raw.json" 2> "$OUT/sm_ceiling.log"
python3 - "$OUT" "$COMMIT" <<'PY'
import datetime, json, sys
out, commit = sys.argv[1], sys.argv[2]
d = json.load(open(f"{out}/sm_ceiling.raw.json"))
d.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         commit=commit, command="bash benchmarks/micro/run_sm_ceiling.sh OUT_DIR")
json.dump(d, open(f"{out}/sm_ceiling.json", "w"), indent=1)
PY
rm -f "$OUT/sm_ceiling.raw.json" "$OUT/sm_ceiling.bin"
cat "$OUT/sm_ceiling.log"

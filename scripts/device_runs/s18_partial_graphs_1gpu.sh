#!/usr/bin/env bash
# Runs s18-1, s18-2 (benchmarks/results/README.md; FULL=0: without the last step): Megatron's local CUDA graphs over the router and the
# dispatch preprocess (scopes moe_router + moe_preprocess) with mok on ONE GPU, dropless and
# drop-and-pad, replays vs an eager twin bitwise, on megatron-core 0.19.2 and 0.16.1; a
# diagnostic of the same with an overlapped shared expert (moe_shared_expert_overlap: decides
# whether the config check lets it through); then every tests/megatron test one GPU runs (0.19.2).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
install_wheels .whl16 /tmp/site16 || exit 1
for v in 19 16; do
  PYTHONPATH=/tmp/site$v timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider \
    tests/megatron/test_megatron_dispatcher.py -k "partial" -rs > $R/partial_graphs_0$v.log 2>&1
  echo "[partial graphs, 0.$v] rc=$?"; tail -2 $R/partial_graphs_0$v.log
  grep -E "^(FAILED|ERROR)|Error|assert" $R/partial_graphs_0$v.log | head -20
done
cat > /tmp/overlap_diag.py <<'PY'
import traceback
from harness import run_distributed
import mok_megatron_workers as W
if __name__ == "__main__":
    try:
        print("RESULT", run_distributed(W.layer_partial_graphs_gpu, 1, False, "overlap", backend="nccl"))
    except Exception:
        traceback.print_exc()
        print("RESULT failed")
PY
PYTHONPATH=/tmp/site19:.:tests:tests/megatron timeout -k 5 120 python3 /tmp/overlap_diag.py > $R/overlap_diag.log 2>&1
echo "[overlap diagnostic] rc=$?"; grep -E "RESULT|Error|error|assert" $R/overlap_diag.log | tail -12
if [ "${FULL:-1}" = 1 ]; then
  PYTHONPATH=/tmp/site19 timeout -k 5 300 python3 -m pytest -q -p no:cacheprovider tests/megatron -rs > $R/megatron_tests_019.log 2>&1
  echo "[tests/megatron 0.19.2] rc=$?"; tail -2 $R/megatron_tests_019.log
fi
cd $OUT && tar czf r.tgz r && rm -rf r

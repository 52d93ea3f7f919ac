#!/usr/bin/env bash
# Run s17-6 (benchmarks/results/README.md): a Megatron MoE layer with drop-and-pad through mok
# captured whole (forward + backward) in one CUDA graph on ONE GPU, replays vs eager, bitwise
# (0.19.2): the groundwork for Megatron's moe CUDA-graph scope (NOTES, after session 17, item 10).
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site19 || exit 1
PYTHONPATH=/tmp/site19 timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/megatron/test_megatron_dispatcher.py \
  -k "graph_capture" -rs > $R/layer_graph.log 2>&1
echo "[layer graph] rc=$?"; tail -3 $R/layer_graph.log; grep -E "Error|error|assert" $R/layer_graph.log | head -20
cd $OUT && tar czf r.tgz r && rm -rf r

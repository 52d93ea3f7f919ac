#!/usr/bin/env bash
# Runs s14-5, s14-6 (benchmarks/results/README.md): the Megatron adapter on megatron-core 0.19.2 (a
# carried wheel, .whl/) on ONE GPU, its first GPU run since session 4: tests/megatron (the CPU
# tests on 0.19.2, and the new world-size-1 GPU tests: dropless round trip, exact layout and
# gradients, full MoELayer mok vs alltoall), then benchmarks/bench_layer.py at world size 1.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
install_wheels .whl /tmp/site && export PYTHONPATH=/tmp/site || exit 1
python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" | tee $R/megatron_version.txt
timeout -k 5 420 python3 -m pytest -q -p no:cacheprovider tests/megatron -rs > $R/megatron_tests.log 2>&1
echo "[megatron tests] rc=$?"; tail -12 $R/megatron_tests.log
timeout -k 5 120 torchrun --nproc-per-node 1 benchmarks/bench_layer.py --dispatchers alltoall,mok --tokens 4096 \
  --hidden 2048 --iters 30 --out-dir $R/layer --tag s14_1gpu > $R/layer.log 2>&1
echo "[bench_layer W=1] rc=$?"; tail -8 $R/layer.log
cd $OUT && tar czf r.tgz r && rm -rf r

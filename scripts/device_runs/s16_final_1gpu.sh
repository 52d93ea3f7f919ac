#!/usr/bin/env bash
# Run s16-5 (benchmarks/results/README.md): the session's final kernels and backend on ONE GPU
# (the named transfer modes of d713772 replace literal mode numbers in the backend): every
# CUDA test one GPU runs, the bindings-constants test, then the main job.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
timeout -k 5 400 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_library_abi.py tests/test_cuda_loopback.py \
  tests/test_cuda_backend.py tests/test_backend_pointers.py tests/test_bindings_constants.py -x > $R/tests.log 2>&1
echo "tests rc=$?"; tail -3 $R/tests.log
timeout -k 5 80 python3 -m megatron_mok.bench --json $R/main_job.json > $R/main_job.log 2>&1
echo "[main] rc=$?"; grep -E "correctness|\| 4096" $R/main_job.log
cd $OUT && tar czf r.tgz r && rm -rf r

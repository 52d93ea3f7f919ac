#!/usr/bin/env bash
# Run s12-1 (benchmarks/results/README.md): validate main on one GPU (tests, main job, small batch)
C=${1:?commit}
. "$(dirname "$0")/common.sh"
python3 -c "import megatron_mok.cuda.library as l; print(l.__file__)" 
timeout -k 5 400 python3 -m pytest -q tests/test_cuda_library_abi.py tests/test_cuda_loopback.py tests/test_cuda_backend.py -p no:cacheprovider -x > $OUT/r/tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/r/tests.log
timeout -k 5 60 python3 -m megatron_mok.bench --json $OUT/r/main_job.json > $OUT/r/main_job.log 2>&1; echo "main rc=$?"; grep "^|" $OUT/r/main_job.log
timeout -k 5 60 python3 scripts/gpu_selftest.py > $OUT/r/selftest.log 2>&1; echo "selftest rc=$?"; tail -3 $OUT/r/selftest.log
timeout -k 5 80 python3 benchmarks/bench_small_batch.py --out $OUT/r/small --commit $C > $OUT/r/small.log 2>&1; echo "small rc=$?"; grep "^|" $OUT/r/small.log
cd $OUT && tar czf r.tgz r && rm -rf r

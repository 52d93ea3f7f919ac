#!/usr/bin/env bash
# Runs s19-6 (before the IPC memory fix) and s19-7 (after it, 72e772f) (benchmarks/results/README.md):
# s19_ipc_memory_probe.py on ONE GPU, shared-GPU mode.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
MOK_TEST_SHARED_GPU=1 timeout -k 5 200 python3 scripts/device_runs/s19_ipc_memory_probe.py $R/ipc_memory.json 2>&1 | grep -v CudaIPCTypes | tee $R/ipc_memory.log | tail -40
cd $OUT && tar czf r.tgz r && rm -rf r

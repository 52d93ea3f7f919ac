#!/usr/bin/env bash
# Session 39's one-GPU calls (benchmarks/NOTES.md, items 59 and 60).
#
#   bash scripts/device_runs/s39_1gpu.sh COMMIT "PARTS" [FUZZ_S]
#     PARTS: any of stopnote mutants chains nvlink regress ncclto megatron arch layout
#
# stopnote  item 59: the CUDA stop tests (tests/test_stop_rank.py: loopback ranks, and processes
#           sharing the GPU), now also reading back each peer's own stop note, which must pass
#           rank 1's on (origin 1, rank 1's words); the C ABI and device-error message tests.
# mutants   item 59's CUDA mutant (stop_note_origin_is_self) and item 57's two (libraries built
#           here into .mutants39: carried).
# chains    the 4-process stop twins CHAIN_REPEATS times (default 4) with -s (as s38's part).
# nvlink    item 60: what NVML says of this H200's GPU fabric (scripts/probe_nvlink_fabric.py:
#           expected "not supported" on a single-host board), and the NVLink-domain tests.
# regress   the one-GPU regression selections (common.sh).
# ncclto    item 61: an NCCL group's own timeout read as the Megatron dispatcher reads it
#           (comm.group_timeout_seconds), for the world and a new_group.
# arch      item 62 (C ABI 20): the library's C ABI tests (mok_kernel_arch on this H200: 90) and
#           the GPU-support tests.
# layout    item 63: ranks whose Buffers differ refuse together before allocating
#           (tests/test_layout_agreement.py: loopback ranks, 2 processes sharing the GPU), and the
#           CUDA sample of the regression selections.
# megatron  the Megatron T_max twins (common.sh; megatron-core 0.19.2 from the carried .whl):
#           the dispatcher's Buffers now take the EP group's timeout.
# Then the fuzzer for FUZZ_S seconds (default 30; 0: none).
# Carry: megatron_mok/_lib, .mutants39 (mutants), .whl (megatron).
C=${1:?commit}; PARTS=${2:?parts}; FUZZ=${3:-30}
. "$(dirname "$0")/common.sh"
for PART in $PARTS; do
t0=$SECONDS
case $PART in
stopnote)
  stop_tests ;;
mutants)
  cuda_mutants .mutants39 stop_note_origin_is_self,stop_note_not_written,stop_note_read_from_self 0 ;;
chains)
  stop_chains ${CHAIN_REPEATS:-4} ;;
nvlink)
  python3 scripts/probe_nvlink_fabric.py --json $R/fabric.json 2>&1 | tee $R/fabric.log
  nvidia-smi -q | grep -A8 -i "fabric" | head -20 | tee -a $R/fabric.log
  run_pytest nvlink 120 tests/test_nvlink_domain.py tests/test_peer_memory.py ;;
regress)
  regress_selections ;;
ncclto)
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29531 timeout 120 python3 -c "
import datetime, torch, torch.distributed as dist
from megatron_mok.comm import group_timeout_seconds
torch.cuda.set_device(0)
dist.init_process_group('nccl', rank=0, world_size=1, timeout=datetime.timedelta(minutes=9), device_id=torch.device('cuda', 0))
sub = dist.new_group([0], timeout=datetime.timedelta(minutes=11))
got = (group_timeout_seconds(None), group_timeout_seconds(sub))
print('nccl group timeouts', got, 'expected (540.0, 660.0)', 'OK' if got == (540.0, 660.0) else 'MISMATCH')
dist.destroy_process_group()
" 2>&1 | tee $R/ncclto.log ;;
megatron)
  megatron_t_max_twins ;;
layout)
  MOK_TEST_SHARED_GPU=1 run_pytest layout 120 tests/test_layout_agreement.py tests/test_cuda_library_abi.py \
    tests/test_gpu_support.py
  SAMPLE=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import mutation_audit_cuda as m; print(m.SAMPLE[-1])")
  run_pytest sample 120 -m "gpu and not multigpu" tests/test_cuda_backend.py tests/test_cuda_loopback.py -k "$SAMPLE" ;;
arch)
  run_pytest arch 120 tests/test_cuda_library_abi.py tests/test_gpu_support.py tests/test_bindings_constants.py ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
echo "[$PART] $((SECONDS - t0)) s"
done
fuzz $FUZZ fuzz
cd $OUT && tar czf r.tgz r && rm -rf r

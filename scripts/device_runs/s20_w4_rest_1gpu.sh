#!/usr/bin/env bash
# Run s20-4 (benchmarks/results/README.md): what s20-3's limit cut off (its not_run.txt: the
# last 11 W = 4 alternative-schedule ring wraps) in shared-GPU mode, then tests/megatron's
# launcher / patch / install tests on megatron-core 0.19.2 (session 20 changed their EP-overlap
# checks; the launcher's Megatron-LM argument parsing needs 0.19's megatron.training). Run
# s20-4 ran these lines inline on the machine s20-3 left warm; the script was committed after.
C=${1:?commit}
. "$(dirname "$0")/common.sh"
ids=""
for n in dispatch_ce_copy_beside_layout combine_release_per_token combine_own_rows_in_consume \
    combine_own_rows_in_consume_release_per_token combine_strided_produce layout_three_kernels \
    small_call_sms_mixed_ranks small_call_sms_mixed_calls plain_launches small_calls_on_num_sms \
    chunk7_padded_slots; do
  ids="$ids tests/test_cuda_backend.py::test_cuda_alternative_schedules_wrap_the_ring[$n-4]"
done
MOK_TEST_SHARED_GPU=1 timeout -k 10 330 python3 -m pytest -v -p no:cacheprovider --durations=3 $ids > $R/w4_rest.log 2>&1
echo "[W=4 ring wraps, the rest] rc=$?"; grep -cE " PASSED" $R/w4_rest.log; grep -E " FAILED| ERROR" $R/w4_rest.log | head; tail -5 $R/w4_rest.log
install_wheels .whl /tmp/site19 || exit 1
PYTHONPATH=/tmp/site19 timeout -k 5 150 python3 -m pytest -v -p no:cacheprovider -rs tests/megatron/test_megatron_entrypoints.py \
  tests/megatron/test_megatron_install.py > $R/megatron_entry_019.log 2>&1
echo "[entrypoints + install, 0.19.2] rc=$?"; tail -2 $R/megatron_entry_019.log; grep -E " FAILED|SKIPPED \[" $R/megatron_entry_019.log | head
cd $OUT && tar czf r.tgz r && rm -rf r

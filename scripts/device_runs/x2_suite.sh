#!/usr/bin/env bash
# One device call on 2 GPUs (nvidia-h200-x2) after the 2-GPU tests passed: the figures the
# README table and the performance issue want, in ~7-8 minutes.
#
#   bash scripts/device_runs/x2_suite.sh COMMIT [AB]
#
# 1. the benchmark suite, every available system (mok, alltoall, torch symmetric memory, and
#    DeepEP when deep_ep is importable, e.g. built beside the project and put on PYTHONPATH),
#    every shape, the SM sweep: benchmarks/bench_dispatch_combine.py under torchrun;
# 2. the main job on both GPUs; 3. small batches on 2 processes (host vs device time);
# 4. with AB=1: same-run stage profiles (scripts/ab_libraries.sh, 24 SMs, 128 and 4096
#    tokens) of this tree against itself with the own-partials staging off
#    (MOK_COMBINE_OWN_STAGED=0, NOTES #38) and with the small layouts unfused
#    (MOK_LAYOUT_FUSED=0, NOTES #45): the 2-GPU outcomes those one-GPU changes lack;
#    with AB=2 instead: plain launches (MOK_PDL=0, NOTES #48) and small calls on num_sms
#    (MOK_SMALL_CALL_SMS=0, NOTES #49) against the defaults; with AB=3: the host paths in one
#    process per rank (scripts/profile_host_calls.py --ab under torchrun): #51's one call
#    against separate launches, and the opt-in eager schedules against the default (NOTES (LL),
#    next experiments after session 14, item 2); with AB=4: the Megatron layer with a shared
#    expert on 2 GPUs (megatron-core wheel carried in .whl/): alltoall, alltoall:overlap, mok,
#    mok:overlap and mok:overlap:high (MOK_COMM_STREAM=high), interleaved in one process, two
#    rounds (NOTES (MM), (NN): measured at W=1 only); with AB=5: the Megatron layer's SM budget
#    (mok = 48 SMs by default, mok:sms=24, mok:sms=64, alltoall beside) and the cost of
#    expert_alignment (profile_stages.py --expert-alignment 1,16,1,16) on 2 GPUs (NOTES, next
#    experiments after session 16, items 7-8); with AB=6: the Megatron layer with drop-and-pad
#    (capacity factor 1.0) against the same pair dropless, alltoall and mok interleaved, two
#    rounds each (NOTES (RR) and item 9 after session 17: alltoall sends the padding routes
#    over NVLink, mok drops them before the exchange); with AB=7: the layer under Megatron's
#    partial CUDA graphs (moe_router + moe_preprocess, the dispatch eager) against the same layer
#    eager, alltoall and mok interleaved, two rounds at 4096 tokens (NOTES item 13, (SS): the
#    same kind of gain for both; measured at W=1 only); with AB=8: Megatron's 1F1B EP overlap
#    in training (examples/run_gpu_ab.sh ab_ep_overlap: 4 micro-batches per step through
#    Megatron's schedule without and with --overlap-moe-expert-parallel-comm, alltoall and mok,
#    flex when deep_ep imports; NOTES item 14 after session 20); with AB=9: expert tensor
#    parallelism on 2 GPUs (EP 1 x ETP 2): its GPU tests with Megatron's own expert TP compared
#    (NCCL), then the layer A/B (bench_layer.py --etp 2, alltoall / mok / flex when deep_ep
#    imports, hidden 7168, 16384 tokens, top-8, two rounds; NOTES item 16 after session 21);
#    with AB=10: the training A/B with expert TP 2 (examples/run_gpu_ab.sh ab_expert_tp).
# Everything lands in $OUT/r.tgz; assemble with scripts/results_json.py.
set -uo pipefail
C=${1:?commit}; AB=${2:-1}
. "$(dirname "$0")/common.sh"
host_ops_build   # the C++ host ops for this machine's torch (NOTES items 75-76; ~30 s)
nvidia-smi topo -m > $R/topo.txt 2>&1
python3 -c "import deep_ep" 2>/dev/null && echo "deep_ep importable" || echo "deep_ep NOT importable: the suite runs without it"
step() {  # step NAME LIMIT_S CMD...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$R/$name.log" 2>&1
    echo "[$name] rc=$? in $((SECONDS - t0)) s"
}
step suite 200 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_dispatch_combine.py --out $R/suite --commit $C
grep -E "^\|" $R/suite.log | head -40
step main_job 60 python3 -m megatron_mok.bench --json $R/main_job.json
grep -E "^\|" $R/main_job.log
step small_batch 90 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_small_batch.py --out $R/small --commit $C --tokens 128,512
grep -E "^\|" $R/small_batch.log
if [ "$AB" = 1 ]; then
  step ab_own_staged 150 bash scripts/ab_libraries.sh $R/ab_own_staged env:MOK_COMBINE_OWN_STAGED=0 128 4096
  cat $R/ab_own_staged.log
  step ab_layout 80 bash scripts/ab_libraries.sh $R/ab_layout env:MOK_LAYOUT_FUSED=0 128
  cat $R/ab_layout.log
elif [ "$AB" = 2 ]; then
  step ab_pdl 150 bash scripts/ab_libraries.sh $R/ab_pdl env:MOK_PDL=0 128 4096
  cat $R/ab_pdl.log
  # profile_stages.py passes num_sms, which turns the small-call budget off: the small-batch
  # tool (the Buffer's own num_sms) with and without it instead, alternating twice.
  for i in 1 2; do for v in default 0; do
    if [ $v = default ]; then step small_sms_${v}_$i 60 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_small_batch.py --out $R/small_sms_${v}_$i --commit $C --tokens 128,512
    else MOK_SMALL_CALL_SMS=0 step small_sms_${v}_$i 60 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_small_batch.py --out $R/small_sms_${v}_$i --commit $C --tokens 128,512; fi
    grep -E "^\| 2 " $R/small_sms_${v}_$i.log
  done; done
elif [ "$AB" = 3 ]; then
  step host_ab_launch 120 python3 -m torch.distributed.run --nproc-per-node 2 scripts/profile_host_calls.py --ab --out $R/host_ab_launch --commit $C --tokens 128,512 --calls 1600 --blocks 40
  grep -E "^T=" $R/host_ab_launch.log
  step host_ab_eager 150 python3 -m torch.distributed.run --nproc-per-node 2 scripts/profile_host_calls.py --ab --settings ";MOK_EAGER_FILL_FIRST=1;MOK_EAGER_SPECULATIVE=1" --out $R/host_ab_eager --commit $C --tokens 128,512 --calls 1600 --blocks 40
  grep -E "^T=" $R/host_ab_eager.log
elif [ "$AB" = 4 ]; then
  install_wheels .whl /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  # One process per round; the dispatchers' iterations interleave inside it (bench_layer.py).
  for i in 1 2; do
    step layer_$i 200 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_layer.py \
      --dispatchers alltoall,alltoall:overlap,mok,mok:overlap,mok:overlap:high --tokens 16384 \
      --hidden 4096 --ffn-hidden 2048 --shared-ffn 4096 --iters 30 --out-dir $R/layer --tag x2_shared_$i
    grep -E "median" $R/layer_$i.log
  done
elif [ "$AB" = 5 ]; then
  install_wheels .whl /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  for i in 1 2; do
    step layer_sms_$i 200 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_layer.py \
      --dispatchers alltoall,mok,mok:sms=24,mok:sms=64 --tokens 16384 --hidden 7168 --ffn-hidden 512 \
      --num-experts 16 --topk 8 --iters 30 --out-dir $R/layer --tag x2_sms_$i
    grep -E "median" $R/layer_sms_$i.log
  done
  step align 120 python3 -m torch.distributed.run --nproc-per-node 2 scripts/profile_stages.py \
    --sms 24,48 --expert-alignment 1,16,1,16 --out $R/align
  grep -E "^\|" $R/align.log
elif [ "$AB" = 6 ]; then
  install_wheels .whl /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  for i in 1 2; do for mode in dropandpad dropless; do
    extra=(); [ $mode = dropandpad ] && extra=(--drop-and-pad 1.0)
    step layer_${mode}_$i 150 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_layer.py \
      --dispatchers alltoall,mok ${extra[@]+"${extra[@]}"} --tokens 16384 --hidden 7168 --ffn-hidden 512 \
      --num-experts 16 --topk 8 --iters 30 --out-dir $R/layer --tag x2_${mode}_$i
    grep -E "median" $R/layer_${mode}_$i.log
  done; done
elif [ "$AB" = 7 ]; then
  install_wheels .whl /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  for i in 1 2; do
    step layer_graphs_$i 150 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_layer.py \
      --dispatchers alltoall,alltoall:graphs,mok,mok:graphs --tokens 4096 --hidden 2048 \
      --iters 40 --out-dir $R/layer --tag x2_graphs_$i
    grep -E "median" $R/layer_graphs_$i.log
  done
elif [ "$AB" = 8 ] || [ "$AB" = 10 ]; then   # training A/Bs: examples/run_gpu_ab.sh stages
  stage=ab_ep_overlap limit=420; [ "$AB" = 10 ] && stage=ab_expert_tp limit=300
  install_wheels .whl /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  PYTHON=python3 step $stage $limit bash examples/run_gpu_ab.sh $R/$stage $stage
  grep -E -A5 "^dispatcher" $R/$stage.log
elif [ "$AB" = 9 ]; then
  install_wheels .whl /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  step expert_tp_tests 200 python3 -m pytest -v -p no:cacheprovider -rs --tb=short \
    tests/megatron/test_megatron_dispatcher.py -k "expert_tensor_parallel_gpu and 2-2-"
  grep -E " PASSED| FAILED| ERROR|SKIPPED \[" $R/expert_tp_tests.log
  disp=alltoall,mok; python3 -c "import deep_ep" 2>/dev/null && disp=alltoall,flex,mok
  for i in 1 2; do
    step layer_etp_$i 180 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_layer.py \
      --etp 2 --dispatchers $disp --tokens 16384 --hidden 7168 --ffn-hidden 512 --num-experts 16 \
      --topk 8 --iters 20 --out-dir $R/layer --tag x2_etp2_$i
    grep -E "median" $R/layer_etp_$i.log
  done
fi
cd $OUT && tar czf r.tgz r && rm -rf r

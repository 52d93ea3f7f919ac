# Sourced by every script in this folder after it set C (the commit to record): the launcher
# environment (no NVLink multicast anywhere, 32 hardware queues for loopback ranks, eager
# module loading), the output folder R=$OUT/r and the GPU list R/gpu.txt that
# scripts/results_json.py reads.
export MOK_COMMIT=$C NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$R/gpu.txt"

with_lib() {  # with_lib base|new CMD...: the base runs with MOK_CUDA_LIB=$BASE_LIB (same C ABI)
    local v=$1; shift
    if [ "$v" = base ]; then MOK_CUDA_LIB=$BASE_LIB "$@"; else "$@"; fi
}

install_wheels() {  # install_wheels DIR TARGET: the wheels carried in DIR (no registry there) into TARGET
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl
}

graph_chain() {  # graph_chain base|new I LIMIT_S: profile_graph_chain.py (W = 1; 128, 512, 4096 tokens) with that library, printing its medians
    with_lib $1 timeout -k 10 $3 python3 scripts/profile_graph_chain.py --out $R/chain_$1_$2 \
      --tokens 128,512,4096 --rounds 2 --commit $C > $R/chain_$1_$2.log 2>&1
    echo "[chain $1 $2] rc=$?"; sed -n '/medians over rounds/,/^$/p' $R/chain_$1_$2.log
}

world_ids() {  # world_ids K WORLD: the multigpu test ids of tests/ (not tests/megatron: its own step) that -k K selects, at world size WORLD (tests without a parameter are 2-rank tests: WORLD 2)
    local own='$^'
    [ "$2" = 2 ] && own='::[A-Za-z0-9_]+$'
    python3 -m pytest --collect-only -q -m multigpu -k "$1" tests --ignore=tests/megatron \
      -p no:cacheprovider 2>/dev/null | grep "::" | grep -E -- "-${2}\]$|\[${2}\]$|$own"
}

fuzz() {  # fuzz SECONDS NAME: the fuzzer (world sizes up to 4, a seed from the clock) into $R/NAME; 0 seconds: nothing
    [ "$1" -gt 0 ] || return 0
    timeout -k 10 $(($1 + 60)) python3 scripts/fuzz_dispatch.py --device cuda --seconds $1 \
      --max-world 4 --out $R/$2 > $R/$2.log 2>&1
    echo "[fuzz $2] rc=$?"; tail -4 $R/$2.log
}

run_pytest() {  # run_pytest NAME LIMIT_S PYTEST ARGS...: into $R/NAME.log and .xml
    local name=$1 limit=$2; shift 2
    # MOK_LOOPBACK_STALL_LOG: a loopback rank's host stall of 5+ s, written when seen (s43-3)
    MOK_LOOPBACK_STALL_LOG=$R/$name.stalls \
    timeout -s INT -k 30 $limit python3 -m pytest -q -rfE -p no:cacheprovider "$@" \
      --junitxml=$R/$name.xml > $R/$name.log 2>&1
    echo "[$name] rc=$?"; tail -2 $R/$name.log; grep -E "^FAILED|^ERROR" $R/$name.log | cut -c1-300 | head -20
}

budget_selection() {  # the receive budget's GPU tests (sessions 36-37): world 1 and 2-3 processes
    # sharing the GPU, its graph replay, the overflow tests that share its error path, the C ABI tests
  MOK_TEST_SHARED_GPU=1 run_pytest budget ${BUDGET_LIMIT_S:-420} -m "gpu or multigpu" --durations=12 \
    tests/test_recv_budget.py tests/test_cuda_backend.py tests/test_cuda_loopback.py tests/test_cuda_library_abi.py \
    -k "budget or static_overflow or rows_per_expert_overflow or failed_dispatch_launch or test_cuda_library_abi"
}

cuda_sample() {  # cuda_sample LIMIT_S: the CUDA sample of the mutation audit (one-GPU tests)
  local sample
  sample=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import mutation_audit_cuda as m; print(m.SAMPLE[-1])")
  run_pytest sample $1 -m "gpu and not multigpu" tests/test_cuda_backend.py tests/test_cuda_loopback.py -k "$sample"
}

narrow_fp8_selection() {  # narrow_fp8_selection LIMIT_S: the narrow-combine and FP8 one-GPU tests
  run_pytest narrow_fp8 $1 -m "gpu and not multigpu" tests/test_fp8_dispatch.py tests/test_cuda_loopback.py \
    tests/test_cuda_backend.py -k "prob_grads_only or narrow_rows or (fp8 and (cuda or loopback))"
}

ERRORS_K="missing_peer or overflow or bad_expert or lagging or past_its_waits or hang or timeout"
errors_selection() {  # errors_selection LIMIT_S [K]: the error-path one-GPU tests (-k K, default $ERRORS_K)
  run_pytest errors $1 -m "gpu and not multigpu" tests/test_cuda_backend.py tests/test_cuda_loopback.py \
    -k "${2:-$ERRORS_K}"
}

regress_selections() {  # the one-GPU regression selections (sessions 35-36): the CUDA sample of the
    # mutation audit, the narrow / FP8 tests, the error paths, the alternative schedules
  cuda_sample 120
  narrow_fp8_selection 90
  errors_selection 120
  schedules_selection 180
}

schedules_selection() {  # schedules_selection LIMIT_S: the alternative-schedule loopback tests
  run_pytest schedules $1 -m "gpu and not multigpu" tests/test_cuda_loopback.py \
    -k "alternative_schedules or combine_split or streamed_produce or speculative"
}

cuda_mutants() {  # cuda_mutants LIBS ONLY FUZZ_S: scripts/mutation_audit_cuda.py run of the mutants
    # ONLY (comma-separated; their libraries carried in LIBS) into $R/audit
  timeout -k 10 ${MUTANTS_LIMIT_S:-300} python3 scripts/mutation_audit_cuda.py run --libs $1 \
    --out $R/audit --only $2 --fuzz-seconds $3 > $R/audit.log 2>&1
  echo "[mutants] rc=$?"; tail -8 $R/audit.log
}

mcore_pytest() {  # mcore_pytest NAME LIMIT_S PYTEST ARGS...: run_pytest on megatron-core from the
    # carried .whl (installed into /tmp/site once), multi-rank tests as processes sharing the GPU
  [ -d /tmp/site/megatron ] || install_wheels .whl /tmp/site
  PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=4 MOK_TEST_SHARED_GPU=1 run_pytest "$@"
}

megatron_t_max_twins() {  # the Megatron T_max twins (CPU reference; 2 processes on the GPU),
    # megatron-core from the carried .whl (sessions 37-38)
  mcore_pytest megatron_t_max 240 tests/megatron/test_megatron_eval.py -k "over_t_max"
}

stop_tests() {  # the CUDA stop tests (loopback ranks, processes sharing the GPU), the C ABI and
    # device-error message tests (sessions 38-39)
  MOK_TEST_SHARED_GPU=1 run_pytest stopnote 360 -m "gpu or multigpu" --durations=8 \
    tests/test_stop_rank.py tests/test_cuda_library_abi.py tests/test_device_errors.py
}

stop_chains() {  # stop_chains REPEATS: the 4-process stop twins REPEATS times with -s, then how
    # often each peer found which stop (a chain of stops is a race; sessions 38-39)
  for i in $(seq $1); do
    MOK_TEST_SHARED_GPU=1 run_pytest chains_$i 120 -s -m multigpu tests/test_stop_rank.py \
      -k "on_gpus and (dispatch-4 or combine-4)" > /dev/null
  done
  grep -ho "\[peer [0-9]*\] .*" $R/chains_*.log | sort | uniq -c | sort -rn | cut -c1-200 | head -12
  grep -L "^2 passed" $R/chains_*.log | head
}

host_ops_build() {  # the C++ host ops (NOTES item 75) for this machine's torch, unless a build newer
    # than its source and mok_api.h is there (the CLI's --if-stale): the build is keyed by torch
    # version, so a build carried from the CPU machine is not it
  local t0=$SECONDS
  python3 -m megatron_mok.cuda.host_ops --if-stale > $R/host_ops_build.log 2>&1
  echo "[host_ops build] rc=$? $((SECONDS - t0)) s"; grep -E "error|ready|up to date" $R/host_ops_build.log | head -20
}

snapshot() {  # snapshot: $R so far as $OUT/r.tgz (replaced whole: a kill mid-write leaves the last one)
  tar czf "$OUT/r.tgz.new" -C "$(dirname "$R")" r && mv -f "$OUT/r.tgz.new" "$OUT/r.tgz"
}

run_parts() {  # run_parts "PARTS" FUZZ_S: each part through the calling script's part() function
    # (timed; an unknown part: part() exits 2), then the fuzzer for FUZZ_S seconds; $OUT/r.tgz
    # after each. The folder moves out of $OUT first: a device call that outlives its limit
    # brings back at most 8 files of $OUT (device/README.md), and s43-3 lost most of its parts
    # that way; now $OUT holds only the archive of every part finished before the kill.
  local p t0 run
  run=$(mktemp -d "${TMPDIR:-/tmp}/mok_run.XXXXXX") && mv "$R" "$run/r" && R=$run/r
  snapshot
  for p in $1; do
    t0=$SECONDS
    part "$p"
    echo "[$p] $((SECONDS - t0)) s"
    snapshot
  done
  fuzz $2 fuzz
  snapshot
  rm -rf "$run"
}

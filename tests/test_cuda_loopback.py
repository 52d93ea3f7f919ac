"""The CUDA backend at world sizes 2, 3, 4 and 8 on ONE GPU: loopback ranks.

Each rank is a thread of this process with its own stream and its own workspace on the
same device (``megatron_mok.loopback``). The kernels run their multi-rank code unchanged:
pulls from peer workspaces, per-source routing, ring sequence numbers, spin-waits with
timeouts. The comparisons are those of ``test_cuda_backend.py`` (bitwise against the
reference backend, which exchanges through the loopback hub, and against the oracle).

This does not replace runs on W GPUs: NVLink-specific behaviour (remote visibility of
writes across devices, bandwidth) is not exercised. It does prove that nothing in the
kernels or the layout assumes two ranks.

The CPU tests at the bottom run the same code with the reference backend on both sides,
so the loopback machinery (threads, hub, all_gather) is checked on every CI run.
"""

import pytest
import torch

from harness import _buffer, contract_cases, run_loopback, spec_inputs
from test_cuda_backend import (ALT_SCHEDULES, _alignment_big_layout, _alignment_vs_reference, CASE_NAMES, FILL_PASS_CONFIGS, SPLIT_SCHEDULES, _fill_passes_calls, _backend_vs_reference, _bad_expert_id_cuda, _cached_cuda, _graph,
                               _lagging_reader, _missing_peer, _reader_past_its_wait, _overflow_cuda, _repeats_and_sms, _ring_wrap,
                               _ring_reused_every_call, _scan_tiles_calls, _speculative_calls, _speculative_mismatch,
                               _split_calls, _static_cuda, _streamed_produce_calls,
                               _fixed_rows_vs_reference, _rows_overflow, _rows_overflow_on_rank0_only,
                               _misaligned_rows, _static_overflow_counts)

ALL_SIZES = (2, 3, 4, 8)
# Every case at the world sizes a 2-GPU machine cannot give; a sample at 2 (also run on
# two real GPUs) and 8 (the slowest to run: 8 threads).
SAMPLE = ("random", "t0_on_rank0", "all_to_one_expert", "mixed", "dsv3_like", "e_equals_w")
CASES = ([(n, w) for w in (3, 4) for n in CASE_NAMES]
         + [(n, w) for w in (2, 8) for n in SAMPLE])

gpu = pytest.mark.gpu


def _max_sms(world_size):
    from megatron_mok import loopback
    from megatron_mok.cuda import library

    sms = library.get().mok_sm_count(torch.cuda.current_device())
    return (sms - loopback.SPARE_SMS) // world_size


@gpu
@pytest.mark.parametrize("name,world_size", CASES)
def test_loopback_matches_reference(name, world_size):
    run_loopback(_backend_vs_reference, world_size, name, 2024, timeout=300)


@gpu
@pytest.mark.parametrize("world_size", (3, 8))
def test_loopback_repeats_and_sm_counts_bitwise(world_size):
    most = min(24, _max_sms(world_size))
    run_loopback(_repeats_and_sms, world_size, "mixed", 5, "cuda", (4, most // 2, most), 20, timeout=300)


@gpu
@pytest.mark.parametrize("world_size,calls,t_max", [(3, 300, 1024), (4, 1000, 1024), (8, 200, 320)])
def test_loopback_ring_wraps(world_size, calls, t_max):
    # T_max 320 at 8 ranks: the routing kernels of 8 ranks must fit on one GPU (loopback.py);
    # a call of T_max tokens is still larger than the 3-chunk ring.
    rows, ring = run_loopback(_ring_wrap, world_size, calls, "cuda", 3, t_max, timeout=600)[0]
    assert rows * 256 * 2 > 4 * ring, "the ring did not wrap"


@gpu
def test_loopback_lagging_reader_never_gets_the_next_calls_rows_silently():
    # The memory-model review's B1 (NOTES item 37): before the fix (s29-5) rank 1 received 67
    # rows of rank 0's SECOND call and no error. Now rank 0's staging poisons the slots it
    # cannot check, and rank 1 reports that its peer stopped instead of reading them.
    out = run_loopback(_lagging_reader, 2, 1.0, 4.0, timeout=120)
    if "skipped" in out[0]:
        pytest.skip(out[0]["skipped"])
    assert out[1]["n_rows_from_0"] > 0, out
    assert "time" in (out[0]["error"] or "").lower(), out          # rank 0 raised its timeout
    assert out[1]["rows_from_0"] != "call 2", out
    assert "rank 0 stopped after an error" in (out[1]["error"] or ""), out


@gpu
@pytest.mark.parametrize("release", (
    pytest.param({}, id="release_at_end"),
    # the per-task release (a chunk released by its last task): it re-reads the chunk's own slot
    pytest.param({"MOK_DISPATCH_RELEASE_AT_END": "0"}, id="release_per_task")))
def test_loopback_reader_past_its_waits_never_returns_overwritten_rows_silently(release, monkeypatch):
    # NOTES item 41: rank 1's warps all passed their waits before rank 0 gave up and its copy
    # overwrote the chunk they were reading. Without the re-read before the release (s31, on the
    # library before it) rank 1 returned a mix of both calls' rows and no error.
    # 32768 tokens on 1 SM: ~40 ms of pull against rank 0's 10 ms timeout (16384 took 20-36 ms,
    # s31-2); 1024-token chunks, so each of the 32 pulling warps waits once, at its start.
    monkeypatch.setenv("MOK_CHUNK_TOKENS", "1024")
    for k, v in release.items():                   # set once for both ranks (threads)
        monkeypatch.setenv(k, v)
    out = run_loopback(_reader_past_its_wait, 2, 0.01, 32768, 1, timeout=120)
    if "skipped" in out[0]:
        pytest.skip(out[0]["skipped"])
    print(f"rank 1's call {out[1]['call_ms']:.1f} ms, its rows {out[1]['rows_from_0']}, "
          f"its error {out[1]['error']!r}; rank 0's error {out[0]['error']!r}")
    assert "time" in (out[0]["error"] or "").lower(), out          # rank 0 gave up
    assert out[1]["n_rows_from_0"] == 32768 * 8, out
    if out[1]["error"] is None:
        # Either the copy landed while rank 1 read (the bug) or rank 1's pull ended before rank 0
        # gave up (the test did not provoke the race: its pull must outlast rank 0's timeout).
        assert out[1]["rows_from_0"] == "call 1", f"rank 1 returned overwritten rows silently: {out}"
        pytest.fail(f"rank 1's call ({out[1]['call_ms']:.1f} ms) ended before rank 0's timeout: {out}")
    assert "rank 0 stopped after an error" in out[1]["error"], out
    assert "while this rank was reading" in out[1]["error"], out     # found at the release


@gpu
def test_loopback_ring_wraps_fp32_many_rows_per_rank():
    # float32 rows and top-8 of 8 experts at W = 2 (4 per rank): most tokens have 4 rows on a
    # rank, and most calls are larger than the 3-chunk ring, so the combine runs its role split,
    # whose producers sum a task's rows in load batches (row_sum.h); fp32 sums of 4 values show
    # any change of that order, which the bf16 ring-wrap tests round away (the mutant
    # held_rows_batch_reversed survived them and died only by the fuzzer, NOTES item 36).
    rows, ring = run_loopback(_ring_wrap, 2, 40, "cuda", 3, 600, True, torch.float32, 8, timeout=300)[0]
    assert rows * 256 * 4 > 4 * ring, "the ring did not wrap"


@gpu
@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("name", ("random", "t_max_exact", "t0_on_rank0", "all_to_one_expert",
                                  "experts_without_rows", "k16_duplicates"))
def test_loopback_expert_alignment(name, world_size):
    run_loopback(_alignment_vs_reference, world_size, name, 315, 16, timeout=300)


@gpu
@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("alignment,extra", ((1, 0), (16, 5)))
@pytest.mark.parametrize("name", ("random", "t0_on_rank0", "all_to_one_expert",
                                  "experts_without_rows", "k16_duplicates"))
def test_loopback_rows_per_expert(name, alignment, extra, world_size):
    run_loopback(_fixed_rows_vs_reference, world_size, name, 415, alignment, extra, timeout=300)


@gpu
@pytest.mark.parametrize("world_size", (2, 3))
def test_loopback_rows_per_expert_overflow(world_size):
    run_loopback(_rows_overflow, world_size, 78, timeout=300)


@gpu
def test_loopback_rows_per_expert_overflow_on_one_rank_does_not_stall_its_peers():
    took = run_loopback(_rows_overflow_on_rank0_only, 2, timeout=120)
    assert max(took) < 8, f"a rank waited {max(took):.1f} s (its peer's transfer never ran?)"


@gpu
@pytest.mark.parametrize("world_size", (2, 3))
def test_loopback_expert_alignment_big_layout(world_size, monkeypatch):
    # every rank (thread) the same; 32-token chunks: 3 ranks' layout grids fit on one GPU, and
    # the fused layout's scan still takes 2 tiles
    monkeypatch.setenv("MOK_CHUNK_TOKENS", "32")
    gaps = run_loopback(_alignment_big_layout, world_size, {}, 16, timeout=300)
    assert sum(gaps) > 0


@gpu
@pytest.mark.parametrize("world_size", (3, 4))
def test_loopback_dispatch_ring_reused_every_call(world_size):
    rows, ring = run_loopback(_ring_reused_every_call, world_size, 200, timeout=600)[0]
    assert rows * 256 * 2 > 30 * ring, "the ring was not reused call after call"


# The 2-GPU file's alternative schedules, but for 7-token chunks: the 1024-token ring-wrap call
# below would need more routing blocks than fit beside 3 ranks' transfers on one GPU (that case
# runs at W=3 in test_loopback_padded_ring_slots_match_reference instead).
LOOPBACK_SCHEDULES = [p for p in ALT_SCHEDULES
                      if p.id not in ("chunk7_padded_slots", "plain_launches", "small_calls_on_num_sms")]


@gpu
@pytest.mark.parametrize("env", LOOPBACK_SCHEDULES)
def test_loopback_alternative_schedules(env, monkeypatch):
    # Set once for all threads: every rank must make the same choice.
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run_loopback(_backend_vs_reference, 4, "mixed", 77, timeout=300)
    rows, ring = run_loopback(_ring_wrap, 3, 150, timeout=600)[0]
    assert rows * 256 * 2 > 4 * ring, "the ring did not wrap"


@gpu
@pytest.mark.parametrize("name", ("random", "mixed"))
def test_loopback_padded_ring_slots_match_reference(name, monkeypatch):
    # 7-token chunks of 32-wide bf16 rows (448 bytes) in 512-byte ring slots: the copy-engine
    # staging copies with a pitch, then the partial last chunk (a 1024-token ring-wrap call would
    # need more routing blocks than fit beside 3 ranks' transfers, so only the contract cases).
    monkeypatch.setenv("MOK_CHUNK_TOKENS", "7")
    run_loopback(_backend_vs_reference, 3, name, 78, timeout=300)


# The combine of rows of one vector (hidden 8: the width of the FP8 dispatch's prob-gradient
# call) takes a lane per task and per token; MOK_COMBINE_NARROW=0 gives those rows the
# warp-per-item path instead, and per-token releases (MOK_COMBINE_RELEASE_AT_END=0) keep them
# there. Each against the reference, forward and backward (the backward's combine carries the
# prob gradients).
NARROW_SCHEDULES = [pytest.param({}, id="combine_narrow"),
                    pytest.param({"MOK_COMBINE_NARROW": "0"}, id="combine_narrow_off"),
                    pytest.param({"MOK_COMBINE_RELEASE_AT_END": "0"}, id="combine_release_per_token")]


@gpu
@pytest.mark.parametrize("world_size", (1, 2, 3))
@pytest.mark.parametrize("env", NARROW_SCHEDULES)
def test_loopback_narrow_rows_match_reference(env, world_size, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run_loopback(_backend_vs_reference, world_size, "narrow_rows", 404, timeout=300)


@gpu
@pytest.mark.parametrize("world_size", (1, 3))
@pytest.mark.parametrize("env", SPLIT_SCHEDULES)
def test_loopback_combine_split_over_warps_matches_reference(env, world_size, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run_loopback(_split_calls, world_size, timeout=300)


@gpu
@pytest.mark.parametrize("world_size", (3, 4))
def test_loopback_streamed_produce_matches_reference(world_size):
    run_loopback(_streamed_produce_calls, world_size, timeout=300)


@gpu
@pytest.mark.parametrize("world_size", (1, 3, 4))
@pytest.mark.parametrize("fused", (True, False), ids=("fused_layout", "three_kernel_layout"))
def test_loopback_layout_scan_over_tiles_matches_reference(fused, world_size, monkeypatch):
    if not fused:  # every loopback rank is a thread of this process
        monkeypatch.setenv("MOK_LAYOUT_FUSED", "0")
    run_loopback(_scan_tiles_calls, world_size, timeout=300)


@gpu
@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("K,chunk_tokens", FILL_PASS_CONFIGS)
def test_loopback_layout_fill_in_passes_matches_reference(K, chunk_tokens, world_size, monkeypatch):
    if chunk_tokens is not None:  # every loopback rank is a thread of this process
        monkeypatch.setenv("MOK_CHUNK_TOKENS", chunk_tokens)
    run_loopback(_fill_passes_calls, world_size, K, chunk_tokens, timeout=300)


@gpu
@pytest.mark.parametrize("fused", (True, False))
def test_loopback_chunks_past_48k_of_shared_memory_match_reference(fused, monkeypatch):
    # 2048-token chunks at top-8: the count kernel's tables (E_local + C * K ints) are 64 KiB,
    # past the 48 KiB a kernel gets without asking; the unfused layout did not ask (s31-1 found
    # "dispatch layout launch: invalid argument" with larger chunks).
    monkeypatch.setenv("MOK_CHUNK_TOKENS", "2048")
    if not fused:
        monkeypatch.setenv("MOK_LAYOUT_FUSED", "0")
    run_loopback(_fill_passes_calls, 2, 8, "2048", timeout=300)


@gpu
@pytest.mark.parametrize("world_size", (3, 4))
def test_loopback_speculative_dispatch_redoes_short_calls_on_every_rank(world_size, monkeypatch):
    monkeypatch.setenv("MOK_EAGER_SPECULATIVE", "1")   # once for all threads (one choice)
    fallbacks = run_loopback(_speculative_calls, world_size, False, timeout=300)
    assert all(f == fallbacks[0] for f in fallbacks), f"ranks disagree on the redone calls: {fallbacks}"
    assert 4 <= fallbacks[0] < 11, f"{fallbacks[0]} calls were redone"


@gpu
def test_loopback_speculative_on_some_ranks_only_is_an_error():
    run_loopback(_speculative_mismatch, 3, timeout=120)


@gpu
@pytest.mark.parametrize("world_size", (3, 4))
@pytest.mark.parametrize("name,extra", [("random", 5), ("unrouted_slots", 0), ("t0_on_rank0", 3)])
def test_loopback_static_shape(name, extra, world_size):
    run_loopback(_static_cuda, world_size, name, extra, timeout=300)


@gpu
@pytest.mark.parametrize("world_size", (3, 4))
@pytest.mark.parametrize("name,static_extra", [("mixed", None), ("t0_on_rank0", None), ("mixed", 3)])
def test_loopback_cached_dispatch(name, static_extra, world_size):
    run_loopback(_cached_cuda, world_size, name, static_extra, timeout=300)


@gpu
@pytest.mark.parametrize("backward", (False, True), ids=["forward", "forward_backward"])
def test_loopback_graph_static_shape(backward):
    run_loopback(_graph, 4, 5 + backward, backward, timeout=300)


@gpu
@pytest.mark.parametrize("mode", ("static", "eager"))
def test_loopback_graph_rows_per_expert(mode):
    run_loopback(_graph, 3, 9, True, mode, timeout=300)


@gpu
def test_loopback_missing_peer_times_out():
    out = run_loopback(_missing_peer, 4, 2, timeout=120)
    for took, msg in out[:-1]:
        assert took < 2 + 20, f"the timeout error came after {took:.1f} s: {msg}"
        assert "rank" in msg and "peer" in msg, f"the error should name rank and peer: {msg}"


def _timeout_after_data_error(rank, world_size, timeout_s, calls):
    """Rank 1 records a data error (static-shape overflow: every row goes to it, one more than
    max_recv_tokens) that nothing reads, then dispatches ``calls`` times alone (rank 0 waits
    at the barrier). Returns rank 1's ``(seconds until check_errors raised, its message)``."""
    import time

    import oracle
    from harness import loopback_barrier, rank_device

    spec = contract_cases(world_size)["all_to_one_expert"]     # every row lands on the last rank
    dev = rank_device(rank)
    inputs = spec_inputs(spec, world_size, torch.bfloat16, 3, device=dev)
    M = max(r.num_rows for r in oracle.route(inputs, spec["E"])) - 1
    buf = _buffer(spec, torch.bfloat16, "cuda", max_recv_tokens=M, timeout_s=timeout_s)
    buf.dispatch(*inputs[rank])               # static shape: no host read, the overflow stays
    torch.cuda.current_stream().synchronize()
    loopback_barrier()
    try:
        if rank == 0:
            return None                       # gone: rank 1's next calls wait for it
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            for _ in range(calls):
                buf.dispatch(*inputs[rank])
            buf.check_errors()
        return time.monotonic() - t0, str(info.value)
    finally:
        loopback_barrier()


@gpu
def test_loopback_timeout_after_an_unread_data_error_still_aborts():
    # NOTES item 46: a data error (here rank 1's static-shape overflow, which no host read sees in
    # static-shape mode) used to keep the error report, so a later timeout was not recorded,
    # `aborted` stayed false and every later wait ran to its own timeout: 8 dispatches with their
    # peer gone took >= 8 timeouts, and check_errors named the overflow, not the missing peer.
    # Now the timeout replaces the data error: the first wait to give up stops the rest.
    timeout_s, calls = 0.5, 8
    took, msg = run_loopback(_timeout_after_data_error, 2, timeout_s, calls, timeout=120)[1]
    assert "timed out" in msg and "peer 0" in msg, msg
    assert took < 4 * timeout_s, f"{calls} dispatches took {took:.2f} s (timeout {timeout_s} s): {msg}"


@gpu
def test_loopback_static_overflow_raises():
    assert run_loopback(_overflow_cuda, 4, timeout=120) == ["ok"] * 3 + ["raised"]


@gpu
@pytest.mark.parametrize("alignment", (1, 16))
def test_loopback_static_overflow_counts_match_written_rows(alignment):
    assert any(run_loopback(_static_overflow_counts, 3, alignment, timeout=120))


@gpu
def test_loopback_misaligned_rows_are_copied():
    run_loopback(_misaligned_rows, 3, timeout=180)


@gpu
def test_loopback_bad_expert_id_is_an_error():
    assert run_loopback(_bad_expert_id_cuda, 4, timeout=120) == [True] * 4


@gpu
def test_loopback_too_many_sms_is_an_error():
    from harness import _buffer, contract_cases

    def make(rank, world_size):
        spec = contract_cases(world_size)["random"]
        with pytest.raises(ValueError, match="loopback group of 8 ranks"):
            _buffer(spec, torch.bfloat16, "cuda", device="cuda", num_sms=10 ** 4 // 8)
        return True

    # The SM check comes after the peer-memory exchange, so every rank reaches it.
    assert run_loopback(make, 8, timeout=120) == [True] * 8


def _launch_settings(rank, world_size, **kw):
    """What a new CUDA Buffer of this rank chose: ``pdl`` (programmatic dependent launch, as the
    library reports it), ``small_blocks`` (blocks of a small call's transfer kernels; its
    ``num_blocks`` when there is no small-call budget), ``small_tokens`` (-1: no small-call
    budget) and the GPU's ``sms``."""
    from megatron_mok.cuda import library

    buf = _buffer(contract_cases(world_size)["random"], torch.bfloat16, "cuda", device="cuda", **kw)
    impl = buf._get_backend("cuda")
    lib = library.get()
    out = dict(pdl=bool(lib.mok_pdl(impl.ctx)), small_tokens=impl.small_call_tokens,
               small_blocks=impl.small_roles[0] if impl.small_call_tokens >= 0 else impl.num_blocks,
               sms=lib.mok_sm_count(torch.cuda.current_device()))
    assert out["pdl"] == impl.pdl, "the library's flag and the backend's disagree"
    buf.destroy()
    return out


def _pdl_of_new_buffer(rank, world_size):
    return _launch_settings(rank, world_size)["pdl"]


def _pdl_calls(rank, world_size, pdl_expected):
    """World size 1 with and without PDL: a full pass against the reference, 300 ring-wrapping
    calls back to back (each call's kernels then start while the last call's run), and a graph
    of static-shape forward + backward (PDL edges captured as programmatic graph edges)."""
    assert _pdl_of_new_buffer(rank, world_size) == pdl_expected
    _backend_vs_reference(rank, world_size, "mixed", 91)
    rows, ring = _ring_wrap(rank, world_size, 300)
    assert rows * 256 * 2 > 4 * ring, "the ring did not wrap"
    return _graph(rank, world_size, 9, True)


@gpu
@pytest.mark.parametrize("env,pdl", [({}, True), ({"MOK_PDL": "0"}, False)], ids=["pdl", "plain_launches"])
def test_loopback_world_size_1_with_and_without_pdl(env, pdl, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert run_loopback(_pdl_calls, 1, pdl, timeout=600) == [True]


@gpu
def test_pdl_is_off_for_ranks_sharing_a_gpu_unless_forced(monkeypatch):
    # Ranks of a loopback group share one GPU: a rank's early-resident blocks could take the SMs
    # a peer's kernel needs, so PDL is off there unless MOK_PDL=1 forces it (not run forced:
    # only the flag is checked).
    assert run_loopback(_pdl_of_new_buffer, 2, timeout=120) == [False, False]
    monkeypatch.setenv("MOK_PDL", "1")
    assert run_loopback(_pdl_of_new_buffer, 2, timeout=120) == [True, True]


def _small_call_budget(rank, world_size, **kw):
    """(small-call blocks, token threshold, SMs) of a new CUDA Buffer of this rank."""
    got = _launch_settings(rank, world_size, **kw)
    return got["small_blocks"], got["small_tokens"], got["sms"]


@gpu
def test_small_calls_get_64_sms_unless_num_sms_is_given(monkeypatch):
    # The default (NOTES (EE)): calls of at most 1024 tokens on a rank run on 64 SMs, larger ones
    # on 24; a num_sms given holds for every call; MOK_SMALL_CALL_SMS=0 turns the budget off;
    # loopback groups of 2+ ranks keep their per-rank SM share.
    blocks, tokens, sms = run_loopback(_small_call_budget, 1, timeout=120)[0]
    assert (blocks, tokens) == (min(64, sms), 1024)
    assert run_loopback(_small_call_budget, 1, timeout=120, num_sms=24)[0][:2] == (24, -1)
    assert run_loopback(_small_call_budget, 2, timeout=120)[0][1] == -1
    monkeypatch.setenv("MOK_SMALL_CALL_TOKENS", "300")
    assert run_loopback(_small_call_budget, 1, timeout=120)[0][:2] == (min(64, sms), 300)
    monkeypatch.setenv("MOK_SMALL_CALL_SMS", "0")
    assert run_loopback(_small_call_budget, 1, timeout=120)[0][:2] == (24, -1)


# ------------------------------------------------- CPU self-checks of the loopback machinery
@pytest.mark.parametrize("world_size", ALL_SIZES)
def test_loopback_reference_runs_on_cpu(world_size):
    """The comparison code over loopback ranks with the reference backend on both sides."""
    run_loopback(_backend_vs_reference, world_size, "mixed", 2024, "reference", device="cpu")


def _by_hand_matches_autograd(rank, world_size, name):
    from harness import DTYPES, _buffer, assert_same_results, contract_cases, full_pass, spec_inputs

    spec = contract_cases(world_size)[name]
    for di, dtype in enumerate(DTYPES):
        x, idx, w = spec_inputs(spec, world_size, dtype, 9 + di)[rank]
        for extra in ({}, {"max_recv_tokens": 1000}):
            ref = _buffer(spec, dtype, "reference", **extra)
            tag = f"[{name} {dtype} {extra} rank {rank}]"
            assert_same_results(full_pass(ref, x, idx, w, 3, by_hand=True),
                                full_pass(ref, x, idx, w, 3, by_hand=False), f"by hand vs autograd {tag}")
    return True


@pytest.mark.parametrize("name", ("mixed", "t0_on_rank0", "dsv3_like", "all_to_one_expert"))
def test_backward_by_hand_matches_autograd(name):
    """The GPU loopback tests take the reference's gradients from ``backward_by_hand``: it
    must give autograd's bits."""
    assert run_loopback(_by_hand_matches_autograd, 3, name, device="cpu") == [True] * 3


def test_loopback_input_checks_code_runs_on_cpu():
    assert any(run_loopback(_static_overflow_counts, 3, 16, "reference", device="cpu", timeout=120))
    run_loopback(_misaligned_rows, 3, "reference", device="cpu", timeout=120)


def test_loopback_ring_code_runs_on_cpu():
    rows = run_loopback(_ring_wrap, 3, 6, "reference", device="cpu")
    assert all(r[0] > 0 for r in rows)


def _fails_on_rank(rank, world_size, bad):
    from megatron_mok import loopback

    if rank == bad:
        raise ValueError(f"rank {rank} fails on purpose")
    loopback.current().barrier()          # the peers wait here: the failure must wake them
    return rank


def test_loopback_reports_a_failing_rank_and_wakes_the_others():
    from harness import DistributedTestError

    with pytest.raises(DistributedTestError, match=r"(?s)rank 2 fails on purpose"):
        run_loopback(_fails_on_rank, 3, 2, device="cpu", timeout=60)
    assert run_loopback(_fails_on_rank, 3, -1, device="cpu") == [0, 1, 2]


def _all_gather_rank_values(rank, world_size):
    from megatron_mok import comm, loopback

    g = loopback.current()
    assert comm.resolve_group(None) is g and comm.group_rank_size(g) == (rank, world_size)
    got = comm.all_gather_exact(torch.tensor([rank, 10 * rank], dtype=torch.bfloat16), g, world_size)
    return got.tolist()


def test_loopback_all_gather_is_exact_and_ordered():
    out = run_loopback(_all_gather_rank_values, 4, device="cpu")
    want = [[float(r), float(10 * r)] for r in range(4)]
    assert out == [want] * 4


def test_loopback_hang_is_reported():
    from harness import DistributedTestError
    from megatron_mok import loopback

    def stuck(rank, world_size):
        if rank == 0:
            loopback.current().barrier()      # rank 1 never arrives
        return rank

    with pytest.raises(DistributedTestError, match="barrier broken|did not finish"):
        run_loopback(stuck, 2, device="cpu", timeout=3)


def test_loopback_on_gpu_needs_eager_module_loading(monkeypatch):
    from megatron_mok import loopback

    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    with pytest.raises(RuntimeError, match="CUDA_MODULE_LOADING=EAGER"):
        loopback.run(lambda rank, world_size: rank, 2, device="cuda")


def test_loopback_on_gpu_needs_a_work_queue_per_stream(monkeypatch):
    from megatron_mok import loopback

    assert loopback.connections_needed(8) == 18 <= loopback.MAX_CONNECTIONS
    assert loopback.connections_needed(16) > loopback.MAX_CONNECTIONS   # no setting is enough
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    for value in ("8", "", "many"):        # CUDA's default, and values that are no number
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
        with pytest.raises(RuntimeError, match=r"CUDA_DEVICE_MAX_CONNECTIONS >= 18"):
            loopback.run(lambda rank, world_size: rank, 8, device="cuda")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")    # the most there is: 16 ranks can't run
    with pytest.raises(RuntimeError, match=r">= 34 \(it is 32\).*use at most 15 loopback ranks"):
        loopback.run(lambda rank, world_size: rank, 16, device="cuda")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    with pytest.raises(RuntimeError, match=r"it is 8\)"):   # unset: CUDA's default
        loopback.run(lambda rank, world_size: rank, 8, device="cuda")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    with pytest.raises(RuntimeError, match=r">= 34"):
        loopback.run(lambda rank, world_size: rank, 16, device="cuda")


def _sleeps_then_fails(rank, world_size):
    import time

    if rank == 1:
        time.sleep(2.5)
        raise ValueError("rank 1 gives up")
    return rank


def test_loopback_failure_report_names_host_stalls(monkeypatch):
    from harness import DistributedTestError
    from megatron_mok import loopback

    monkeypatch.setattr(loopback, "STALL_S", 0.6)
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 gives up.*rank 1 stuck for .*_sleeps_then_fails"):
        run_loopback(_sleeps_then_fails, 2, device="cpu", timeout=60)


def test_loopback_stall_log_written_while_the_run_is_still_going(monkeypatch, tmp_path):
    # The stall reaches the file before the run ends (a run killed from outside loses the
    # report it would raise): the stalled rank reads it, woken once the watcher wrote it.
    import threading

    from megatron_mok import loopback

    log = tmp_path / "stalls.txt"
    monkeypatch.setattr(loopback, "STALL_S", 0.6)
    monkeypatch.setenv("MOK_LOOPBACK_STALL_LOG", str(log))
    written = threading.Event()
    log_stall = loopback._log_stall
    monkeypatch.setattr(loopback, "_log_stall", lambda line: (log_stall(line), written.set()))
    seen = []

    def waits_for_its_own_stall(rank, world_size):
        if rank == 1:
            written.wait(20)                    # one place: the watcher sees it stay here
            seen.append(log.read_text() if log.exists() else "")
        return rank

    assert run_loopback(waits_for_its_own_stall, 2, device="cpu", timeout=60) == [0, 1]
    assert "rank 1 stuck for" in seen[0] and "waits_for_its_own_stall" in seen[0], seen


def _host_reads(rank, world_size):
    """Every host read the loopback guards cover, then ops that read nothing."""
    import torch
    from megatron_mok import loopback
    t = torch.arange(6, dtype=torch.float32) + rank
    one = t[:1]
    reads = {"tolist": lambda: t.tolist(), "item": lambda: one.item(), "cpu": lambda: t.cpu(),
             "numpy": lambda: t.numpy(), "nonzero": lambda: t.nonzero(),
             "equal": lambda: t.equal(t), "torch.equal": lambda: torch.equal(t, t),
             "torch.equal by keyword": lambda: torch.equal(input=t, other=t),
             "allclose": lambda: t.allclose(t), "torch.allclose": lambda: torch.allclose(t, t),
             "bool": lambda: bool(one), "int": lambda: int(one), "float": lambda: float(one),
             "index": lambda: [0, 1][one.long()], "to cpu": lambda: t.to("cpu"),
             "to device cpu": lambda: t.to(device=torch.device("cpu")),
             "mask index": lambda: t[t > 2], "mask in tuple": lambda: t.view(2, 3)[(t.view(2, 3)[:, 0] > 0,)]}
    quiet = {"add": lambda: t + 1, "slice": lambda: t[1:3], "long index": lambda: t[torch.tensor([0, 2])],
             "to dtype": lambda: t.to(torch.float64), "view": lambda: t.view(2, 3)}
    import threading
    mine = lambda: loopback._SETTLED.count(threading.get_ident())      # noqa: E731  (this rank's)
    out = {}
    for name, fn in list(reads.items()) + list(quiet.items()):
        before = mine()
        fn()
        out[name] = mine() - before
    return out


def test_loopback_host_reads_settle_first_in_rank_threads_only(monkeypatch):
    # s43-3 / s44-2: a worker's tokens_per_expert.tolist() (a pageable copy behind its stream's
    # kernels) held up a slower peer's CUDA calls that those kernels waited for: a stall until
    # the timeouts. Loopback runs now settle the stream before torch's host reads. On CPU,
    # every tensor stands in for a CUDA one (_needs_settle patched) and settling is counted.
    import threading

    import torch
    from megatron_mok import loopback

    loopback.settle_host_reads()
    monkeypatch.setattr(loopback, "_SETTLED", [], raising=False)
    monkeypatch.setattr(loopback, "_needs_settle",
                        lambda t: isinstance(t, torch.Tensor) and loopback.current() is not None)
    monkeypatch.setattr(loopback, "_settle_for", lambda t: loopback._SETTLED.append(threading.get_ident()))
    for rank, out in enumerate(loopback.run(_host_reads, 2, device="cpu", timeout_s=60)):
        settled = {k for k, v in out.items() if v}
        assert settled == {k for k in out if k not in ("add", "slice", "long index", "to dtype", "view")}, \
            (rank, out)
    assert _host_reads(0, 1) == dict.fromkeys(_host_reads(0, 1), 0)      # not a loopback thread
    loopback.settle_host_reads()                                       # once: not wrapped twice
    assert not hasattr(torch.Tensor.tolist.__wrapped__, "__wrapped__")
    assert torch.Tensor.tolist.__name__ == "tolist" and torch.equal.__wrapped__ is not None


def test_loopback_run_installs_the_host_read_guards(monkeypatch):
    from megatron_mok import loopback

    calls = []
    monkeypatch.setattr(loopback, "settle_host_reads", lambda: calls.append(1))
    assert loopback.run(lambda rank, world_size: rank, 2, device="cpu") == [0, 1] and calls == [1]
    import torch
    assert not loopback._needs_settle(torch.zeros(2))                  # a CPU tensor: never


def _reads_behind_a_busy_stream(rank, world_size):
    """A CUDA host read with 50 ms of work queued on this rank's stream: settled first."""
    import torch
    from megatron_mok import loopback
    t = torch.ones(4, device="cuda")
    torch.cuda._sleep(100_000_000)
    before = len(loopback._SETTLED)
    t.tolist()
    return len(loopback._SETTLED) - before, loopback._needs_settle(t)


@gpu
def test_loopback_host_reads_settle_on_the_gpu(monkeypatch):
    from megatron_mok import loopback

    settle_for = loopback._settle_for
    monkeypatch.setattr(loopback, "_SETTLED", [], raising=False)
    monkeypatch.setattr(loopback, "_settle_for", lambda t: (loopback._SETTLED.append(1), settle_for(t)))
    out = run_loopback(_reads_behind_a_busy_stream, 1, timeout=60)
    assert out == [(1, True)], out
    assert not loopback._needs_settle(__import__("torch").ones(1, device="cuda"))   # not a rank thread


def test_loopback_refuses_layouts_that_cannot_all_be_resident():
    from megatron_mok import loopback

    g = loopback.LoopbackRank(loopback.LoopbackHub(8, "cpu"), 0)
    g.check_layout_fits(132, 10, 5)                 # 320 count blocks beside 80 transfer SMs
    with pytest.raises(ValueError, match="lower max_tokens_per_rank"):
        g.check_layout_fits(132, 10, 16)            # 1024 blocks: a rank could starve
    assert g.max_sms_per_rank(132) == (132 - loopback.SPARE_SMS) // 8


def _failed_launch_launches_nothing(rank, world_size):
    """A ``mok_dispatch_launch`` whose transfer arguments are bad (producers = blocks), on a live
    Buffer with real tensors: it must fail before the layout and the fill are launched (their
    outputs keep a sentinel), and the Buffer must go on working (a pass against the reference)."""
    from megatron_mok.cuda import bindings, library

    case = contract_cases(world_size)["mixed"]
    buf = _buffer(case, torch.bfloat16, "cuda", device="cuda", max_recv_tokens=4096)
    impl = buf._get_backend("cuda")
    dev = torch.device("cuda", torch.cuda.current_device())
    T, K, E, H, rows = case["T_max"], case["K"], case["E"], case["H"], 4096
    x = torch.randn(T, H, dtype=torch.bfloat16, device=dev)
    idx = torch.randint(0, E, (T, K), dtype=torch.int64, device=dev)
    w = torch.rand(T, K, dtype=torch.float32, device=dev)
    scratch = torch.empty(impl.scratch_bytes, dtype=torch.uint8, device=dev)
    tpe = torch.full((buf.num_local_experts + 2,), -7, dtype=torch.int64, device=dev)
    probs = torch.full((rows,), -7.0, dtype=torch.float32, device=dev)
    src = torch.full((2, rows), -7, dtype=torch.int64, device=dev)
    out = torch.empty(rows, H, dtype=torch.bfloat16, device=dev)
    steps = bindings.STEP_LAYOUT | bindings.STEP_FILL | bindings.STEP_TRANSFER
    lib = library.get()
    rc = lib.mok_dispatch_launch(impl.ctx, impl._stream(), steps, scratch.data_ptr(), idx.data_ptr(), 1,
                                 w.data_ptr(), T, E, tpe.data_ptr(), src[0].data_ptr(),
                                 src[1].data_ptr(), probs.data_ptr(), 1, x.data_ptr(), None, out.data_ptr(),
                                 rows, 24, 24, 0, bindings.NO_ROWS_PER_EXPERT, 0, 0, 0)
    assert rc != 0 and "num_producers" in lib.mok_last_error().decode()
    torch.cuda.synchronize()
    assert (tpe == -7).all() and (probs == -7).all() and (src == -7).all(), "a step was launched"
    buf.destroy()
    _backend_vs_reference(rank, world_size, "mixed", 17)
    return True


@gpu
def test_failed_dispatch_launch_launches_nothing():
    assert run_loopback(_failed_launch_launches_nothing, 1, timeout=300) == [True]


def _one_call_and_separate_launches(rank, world_size):
    """The same dispatches (eager, static, rows_per_expert, a receive budget that drops rows;
    random routing with unrouted slots) queued by one library call and by separate launches
    (``separate_launches``): bitwise the same outputs, and the same combine of them."""
    case = contract_cases(world_size)["mixed"]
    dev = torch.device("cuda", torch.cuda.current_device())
    T, K, E, H = case["T_max"], case["K"], case["E"], case["H"]
    g = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.randint(-1, E, (T, K), generator=g).to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    calls = [({}, {}), ({"max_recv_tokens": T * K + 3}, {}), ({}, {"rows_per_expert": T * K}),
             ({}, {"recv_budget": T * K // 3})]
    for extra, call in calls:
        outs = []
        for separate in (False, True):
            buf = _buffer(case, torch.bfloat16, "cuda", device="cuda", **extra)
            buf._get_backend("cuda").separate_launches = separate
            r = buf.dispatch(x, idx, w, **call)
            y = buf.combine(r.tokens, r.handle)
            buf.check_errors()
            outs.append([t.clone() for t in (r.tokens, r.probs, r.src_rank, r.src_token, r.tokens_per_expert,
                                             r.handle.num_rows_device, y)])
            buf.destroy()
        for a, b in zip(*outs):
            assert a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                                                      b.view(torch.uint8) if b.is_floating_point() else b)
    return True


@gpu
def test_one_call_dispatch_matches_separate_launches_bitwise():
    assert run_loopback(_one_call_and_separate_launches, 1, timeout=300) == [True]


def _host_ops_vs_python_path(rank, world_size):
    """Items 75-77 on the GPU: static dispatches (``max_recv_tokens``, with ``rows_per_expert``,
    a receive budget that drops rows), eager ones (with and without ``rows_per_expert``),
    cached dispatches and combines queued by the C++ host ops and by the Python path
    (``host_ops = None``) on the same Buffer give bitwise the same outputs, handles, combines
    and gradients (training: ``x`` and ``topk_weights`` require gradients, so the backward's
    cached dispatch and prob-gradient combine run too), for 0, 1 and an odd number of tokens,
    unrouted slots and every token to one expert."""
    from megatron_mok.cuda import host_ops

    case = contract_cases(world_size)["mixed"]
    dev = torch.device("cuda", torch.cuda.current_device())
    T_max, K, E, H = case["T_max"], case["K"], case["E"], case["H"]
    W, E_loc = world_size, case["E"] // world_size
    rows = W * T_max * K
    g = torch.Generator(device="cpu").manual_seed(31 + rank)
    configs = [({"max_recv_tokens": rows + 3}, {}), ({"max_recv_tokens": E_loc * rows}, {"rows_per_expert": rows}),
               ({"max_recv_tokens": rows + 3}, {"recv_budget": rows // 3}),
               ({}, {}), ({}, {"rows_per_expert": rows})]     # eager (item 76)
    counts = [0 if rank == 1 else T_max, 1, min(7, T_max)]
    for extra, call in configs:
        buf = _buffer(case, torch.bfloat16, "cuda", device="cuda", **extra)
        impl = buf._get_backend("cuda")
        op = impl.host_ops
        assert op is not None, f"the C++ host ops are not loaded: {host_ops.why_not()}"
        for T in counts:
            for one_expert in (False, True):
                x0 = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
                idx = torch.randint(-1, E, (T, K), generator=g)
                if one_expert:
                    idx[:, 0], idx[:, 1:] = 0, -1
                idx = idx.to(dev)
                w0 = torch.rand(T, K, generator=g).to(dev)
                outs = []
                for module in (op, None):
                    impl.host_ops = module
                    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                    r = buf.dispatch(x, idx, w, **call)
                    # A cached dispatch along the handle (item 77; its backward: a combine).
                    c = buf.dispatch(x * 0.5, handle=r.handle).tokens
                    y = buf.combine(r.tokens * 2, r.handle)
                    (y.float().square().sum() + (r.probs * 3).sum() + (c.float() * 1.25).sum()).backward()
                    with torch.no_grad():
                        y2 = buf.combine(r.tokens, r.handle)
                        c2 = buf.dispatch(x * 3, handle=r.handle).tokens
                    buf.check_errors()
                    h = r.handle
                    got = [r.tokens, r.probs, r.src_rank, r.src_token, r.tokens_per_expert, h.num_rows_device,
                           y, y2, c, c2, x.grad, w.grad]
                    if h.rows_received is not None:
                        got += [h.rows_received, h.over_budget]
                    outs.append([None if t is None else t.detach().clone() for t in got])
                impl.host_ops = op
                for i, (a, b) in enumerate(zip(*outs)):
                    assert (a is None) == (b is None), i
                    if a is None:
                        continue
                    assert a.shape == b.shape and a.dtype == b.dtype, (i, a.shape, b.shape)
                    assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                                       b.view(torch.uint8) if b.is_floating_point() else b), \
                        f"output {i} differs (T={T}, one_expert={one_expert}, {extra}, {call})"
        buf.destroy()
    return True


@gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_host_ops_are_the_python_path_bitwise(world_size):
    """The C++ host ops against the Python path on the real library (the CPU twin with a
    stand-in library: ``tests/test_host_ops.py``). The op must be built for this torch
    (``python -m megatron_mok.cuda.host_ops``; ``setup.py`` builds it)."""
    assert run_loopback(_host_ops_vs_python_path, world_size, timeout=300) == [True] * world_size


@gpu
def test_cuda_calls_without_gradients_skip_the_functions_bitwise():
    """Item 73 on the CUDA backend: calls that need no gradient skip their autograd Functions
    and give bitwise what the Functions' path gives (``test_autograd.py``'s check, on the GPU)."""
    from test_autograd import _calls_without_gradients

    assert run_loopback(_calls_without_gradients, 1, "cuda", timeout=300) == [True]

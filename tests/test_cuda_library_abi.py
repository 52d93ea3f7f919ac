"""The compiled library's C ABI, checked without a GPU (it loads on any x86-64 machine).

CI builds ``libmok_cuda.so`` with nvcc; these tests make sure the build exports what
``megatron_mok/cuda/bindings.py`` declares, that argument checks refuse bad configurations
with a message, and that the workspace layout (computed in C++, one place) is sane.
"""

import pytest

from megatron_mok.cuda import library

pytestmark = pytest.mark.skipif(not library.is_available(),
                                reason="libmok_cuda.so not built (no nvcc on this machine)")


def _create(lib, **over):
    cfg = dict(world=2, rank=0, hidden=7168, elem=2, pelem=2, topk=8, e_local=128, t_max=4096,
               chunk=64, meta=16, disp_chunks=100, comb_chunks=90, align=1)
    cfg.update(over)
    return lib.mok_create(cfg["world"], cfg["rank"], cfg["hidden"], cfg["elem"], cfg["pelem"],
                          cfg["topk"], cfg["e_local"], cfg["t_max"], cfg["chunk"], cfg["meta"],
                          cfg["disp_chunks"], cfg["comb_chunks"], cfg["align"])


def test_workspace_layout_holds_both_rings():
    lib = library.get()
    ctx = _create(lib)
    try:
        total = lib.mok_workspace_bytes(ctx)
        chunk_d = 64 * 7168 * 2                      # C rows of H bf16 elements
        chunk_c = 64 * 7168 * 2 + 64 * 8 * 4         # partials + prob-gradient side values
        assert total >= 100 * chunk_d + 90 * chunk_c
        # Flags, counters, routing slots: well under 64 MiB on top of the rings.
        assert total - (100 * chunk_d + 90 * chunk_c) < 64 << 20
        assert 0 <= lib.mok_error_offset(ctx) < total
        assert 0 <= lib.mok_trace_offset(ctx) < total
        scratch = lib.mok_handle_scratch_bytes(ctx)
        assert scratch >= 2 * 4096 * 8 * 4 * 2       # task rows and slots, W * T_max * K each
        assert 0 < lib.mok_handle_totals_offset(ctx) < scratch
    finally:
        lib.mok_destroy(ctx)


def test_layout_grows_with_t_max_and_zero_t_max_is_valid():
    lib = library.get()
    small, zero = _create(lib, t_max=64), _create(lib, t_max=0)
    try:
        assert small and zero
        assert lib.mok_handle_scratch_bytes(small) > lib.mok_handle_scratch_bytes(zero) > 0
    finally:
        lib.mok_destroy(small)
        lib.mok_destroy(zero)


@pytest.mark.parametrize("over, message", [
    (dict(hidden=100), "hidden must be a positive multiple of 8"),
    (dict(hidden=1 << 21, elem=4), "must be under 8 MiB"),     # the dispatch ring's row tag
    (dict(elem=0), "must be under 8 MiB"),
    (dict(topk=33), "topk must be in"),
    (dict(world=65), "world size"),
    (dict(rank=2), "rank outside"),
    (dict(disp_chunks=0), "ring sizes must be >= 1"),
    (dict(align=0), "expert_alignment must be in [1, 1024]"),
    (dict(align=1025), "expert_alignment must be in [1, 1024]"),
])
def test_bad_configuration_is_refused_with_a_message(over, message):
    lib = library.get()
    assert not _create(lib, **over)
    assert message in lib.mok_last_error().decode()


def test_calls_before_peers_are_set_fail_cleanly():
    lib = library.get()
    ctx = _create(lib)
    try:
        rc = lib.mok_dispatch_fill(ctx, None, None, None, None, None, 0, 1)
        assert rc != 0
        assert "mok_set_peers" in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


def test_host_report_must_be_mapped_pinned_memory():
    """The eager dispatch's host report: a null or pageable pointer is refused with a message
    (the scan kernel would otherwise write to an address the device cannot reach)."""
    import ctypes

    lib = library.get()
    ctx = _create(lib)
    try:
        assert lib.mok_set_host_report(ctx, None) != 0
        assert "null pointer" in lib.mok_last_error().decode()
        pageable = (ctypes.c_int32 * 12)()
        assert lib.mok_set_host_report(ctx, ctypes.addressof(pageable)) != 0
        assert "not mapped, pinned host memory" in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


@pytest.mark.parametrize("blocks, producers, mode, message", [
    (24, 4, 3, "mode must be 0 (both roles), 1 (stage) or 2 (pull)"),
    (24, 4, 7, "mode must be 0 (both roles), 1 (stage) or 2 (pull)"),
    (24, 24, 4, "1 <= num_producers < num_blocks"),   # 4 = both roles, rows past R not zeroed
    (24, 24, 0, "1 <= num_producers < num_blocks"),
    (24, 0, 0, "1 <= num_producers < num_blocks"),
    (0, 0, 1, "num_blocks >= 1"),
    (0, 0, 2, "num_blocks >= 1"),
    (24, 4, 9, "8 (copy-engine staged) only goes with 0"),    # stage | copy-engine staged
    (24, 0, 10, "8 (copy-engine staged) only goes with 0"),   # pull | copy-engine staged
])
def test_dispatch_transfer_refuses_bad_roles_before_launching(blocks, producers, mode, message):
    # Peers are only recorded by mok_set_peers, so fake (never dereferenced) pointers let the
    # argument checks run on a machine without a GPU; every case fails before any launch.
    import ctypes
    lib = library.get()
    ctx = _create(lib)
    try:
        peers = (ctypes.c_uint64 * 2)(1 << 40, 2 << 40)
        assert lib.mok_set_peers(ctx, peers, 2, 1.0) == 0
        rc = lib.mok_dispatch_transfer(ctx, None, None, None, None, 0, None, 0, blocks, producers, mode, 0, 0)
        assert rc != 0
        assert message in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


def _with_fake_peers(lib, **over):
    import ctypes
    ctx = _create(lib, **over)
    peers = (ctypes.c_uint64 * 2)(1 << 40, 2 << 40)
    assert lib.mok_set_peers(ctx, peers, 2, 1.0) == 0
    return ctx


def test_copy_engine_staging_needs_a_ring_that_holds_a_call():
    # 4096 tokens in chunks of 64 = 64 chunks per call: a ring of 64 holds a call, 63 does not.
    lib = library.get()
    fits, short = _with_fake_peers(lib, disp_chunks=64), _with_fake_peers(lib, disp_chunks=63)
    try:
        assert lib.mok_dispatch_ce_stage_supported(fits) == 1
        assert lib.mok_dispatch_ce_stage_supported(short) == 0
        assert lib.mok_dispatch_ce_stage_supported(None) == 0
        assert lib.mok_dispatch_stage_copy(short, None, None, None, 128, 0, 0) != 0
        assert "holds a whole call" in lib.mok_last_error().decode()
        assert lib.mok_dispatch_transfer(short, None, None, None, None, 0, None, 0, 24, 0, 8, 0, 0) != 0
        assert "holds a whole call" in lib.mok_last_error().decode()
        assert lib.mok_dispatch_stage_copy(fits, None, None, None, 4097, 0, 0) != 0
        assert "num_tokens outside" in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(fits)
        lib.mok_destroy(short)


@pytest.mark.parametrize("over, fused", [
    (dict(world=1, e_local=256, t_max=128), True),      # 512 groups: a small call's Buffer
    (dict(world=8, e_local=32, t_max=4096), False),     # 16384 groups (8 x 32 x 64 chunks)
    (dict(world=2, e_local=128, t_max=4096), False),    # the standard shape: 16384
    (dict(world=2, e_local=64, t_max=4096), True),      # 8192: the limit itself
    (dict(world=2, e_local=65, t_max=4096), False),     # 8320
    (dict(world=3, e_local=65, t_max=64 * 22), True),   # the scan-tiles test: 4290 groups
])
def test_layout_fuses_publish_count_and_scan_for_small_layouts_only(over, fused):
    lib = library.get()
    ctx = _create(lib, **over)
    try:
        assert lib.mok_layout_fused(ctx, 0) == int(fused)
        assert lib.mok_layout_fused(ctx, 1) == 0        # speculative calls: three kernels
    finally:
        lib.mok_destroy(ctx)


def test_layout_fusion_follows_the_environment(monkeypatch):
    lib = library.get()
    small, big = _create(lib, world=1, e_local=256, t_max=128), _create(lib)
    try:
        monkeypatch.setenv("MOK_LAYOUT_FUSED", "0")
        assert lib.mok_layout_fused(small, 0) == 0
        monkeypatch.delenv("MOK_LAYOUT_FUSED")
        monkeypatch.setenv("MOK_LAYOUT_FUSED_MAX_GROUPS", "16384")
        assert lib.mok_layout_fused(big, 0) == 1
        monkeypatch.setenv("MOK_LAYOUT_FUSED_MAX_GROUPS", "511")
        assert lib.mok_layout_fused(small, 0) == 0
        assert lib.mok_layout_fused(None, 0) == 0
    finally:
        lib.mok_destroy(small)
        lib.mok_destroy(big)


def test_programmatic_dependent_launch_is_off_until_set():
    # mok_create launches plainly; the CUDA backend turns PDL on per context (not for ranks
    # sharing one GPU), so the flag must belong to the context, not to the process.
    lib = library.get()
    a, b = _create(lib), _create(lib)
    try:
        assert lib.mok_pdl(a) == 0 and lib.mok_pdl(b) == 0
        assert lib.mok_set_pdl(a, 1) == 0
        assert lib.mok_pdl(a) == 1 and lib.mok_pdl(b) == 0
        assert lib.mok_set_pdl(a, 7) == 0 and lib.mok_pdl(a) == 1   # any non-zero is on
        assert lib.mok_set_pdl(a, 0) == 0 and lib.mok_pdl(a) == 0
        assert lib.mok_set_pdl(None, 1) != 0 and "null" in lib.mok_last_error().decode()
        assert lib.mok_pdl(None) == 0
    finally:
        lib.mok_destroy(a)
        lib.mok_destroy(b)


def test_library_reports_the_abi_version_this_package_declares():
    from megatron_mok.cuda import bindings
    assert library.get().mok_abi_version() == bindings.ABI_VERSION


def test_a_library_of_another_abi_version_is_refused(monkeypatch):
    # A stale build must not be called with new arguments: declare() refuses it, with a hint.
    from megatron_mok.cuda import bindings
    monkeypatch.setattr(bindings, "ABI_VERSION", bindings.ABI_VERSION + 1)
    import ctypes
    with pytest.raises(OSError, match="rebuild"):
        bindings.declare(ctypes.CDLL(str(library.library_path())))


def _launch(lib, ctx, steps, num_tokens=0, blocks=24, producers=4, mode=0, rows_per_expert=-1,
            row_bytes=0, x=None, x2=None, two_sources=0, drop_over_cap=0):
    """mok_dispatch_launch with null (or fake) tensors (every case below fails in its checks)."""
    return lib.mok_dispatch_launch(ctx, None, steps, None, None, 0, None, num_tokens, 256, None,
                                   None, None, None, 1, x, x2, None, 0, blocks, producers, mode,
                                   rows_per_expert, row_bytes, two_sources, drop_over_cap)


@pytest.mark.parametrize("dst_bytes,a_bytes,b_bytes,a_ptr,message", [
    (48, 32, 8, 16, "multiples of 16"),          # scale row of 8 bytes
    (48, 40, 16, 16, "multiples of 16"),
    (32, 32, 16, 16, "a_bytes + b_bytes <= dst_bytes"),
    (40, 16, 16, 16, "multiples of 16"),         # packed row of 40 bytes
    (48, 32, 16, 8, "16-byte aligned"),          # a misaligned source
    (48, 32, 16, 0, "non-null"),
])
def test_pack_rows_refuses_bad_widths_and_pointers_before_launching(dst_bytes, a_bytes, b_bytes, a_ptr, message):
    # The checks come first, so fake pointers never reach a launch (no GPU needed).
    lib = library.get()
    rc = lib.mok_pack_rows(None, 1 << 40, dst_bytes, a_ptr and (1 << 40) + a_ptr, a_bytes, 2 << 40, b_bytes, 3)
    assert rc != 0
    assert message in lib.mok_last_error().decode()
    assert lib.mok_pack_rows(None, None, 48, None, 32, None, 16, 0) == 0   # no rows: nothing to do


# The row size of an FP8 dispatch's packed rows (megatron_mok/fp8.py): a multiple of 16 within
# the ring's row of hidden x elem = 7168 x 2 bytes; 0 means that row.
@pytest.mark.parametrize("row_bytes", [-16, 8, 7400, 14336 + 16, 1 << 30])
def test_dispatch_refuses_a_bad_row_size_before_launching(row_bytes):
    lib = library.get()
    ctx = _with_fake_peers(lib, disp_chunks=64)
    try:
        for rc in (lib.mok_dispatch_transfer(ctx, None, None, None, None, 0, None, 0, 24, 4, 0, row_bytes, 0),
                   lib.mok_dispatch_stage_copy(ctx, None, None, None, 0, row_bytes, 0),
                   _launch(lib, ctx, 4 | 8, row_bytes=row_bytes, mode=8)):
            assert rc != 0
            assert "row_bytes must be 0" in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


# An FP8 pair read from two sources (C ABI 15, NOTES #57): x holds hidden bytes per row (7168),
# x2 the rest of row_bytes; the choice is explicit (a rank without tokens has no pointers), and
# pointers of a call with tokens must be non-null and 16-byte aligned. Fake pointers: every case
# fails in the checks, before any launch (no GPU needed).
BASE = 1 << 40


@pytest.mark.parametrize("row_bytes,x,x2,two,tokens,message", [
    (7392, BASE, BASE, 2, 4, "two_sources must be 0 or 1"),
    (7168, BASE, BASE, 1, 4, "row_bytes > hidden"),          # nothing left for x2
    (7392, BASE + 8, BASE, 1, 4, "16-byte aligned"),         # misaligned FP8 rows
    (7392, BASE, BASE + 4, 1, 4, "16-byte aligned"),         # misaligned scale rows
    (7392, BASE, None, 1, 4, "non-null"),                    # tokens but no scale rows
    (7392, None, BASE, 1, 4, "non-null"),
    (7392, BASE + 8, None, 0, 4, "16-byte aligned"),         # one source: x checked too
])
def test_dispatch_refuses_bad_sources_before_launching(row_bytes, x, x2, two, tokens, message):
    lib = library.get()
    ctx = _with_fake_peers(lib, disp_chunks=64)
    try:
        for rc in (lib.mok_dispatch_transfer(ctx, None, None, x, x2, tokens, None, 0, 24, 4, 0, row_bytes, two),
                   lib.mok_dispatch_stage_copy(ctx, None, x, x2, tokens, row_bytes, two),
                   _launch(lib, ctx, 4 | 8, num_tokens=tokens, row_bytes=row_bytes, mode=8, x=x, x2=x2,
                           two_sources=two)):
            assert rc != 0
            assert message in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


def test_dispatch_from_two_sources_needs_hidden_a_multiple_of_16():
    lib = library.get()
    ctx = _with_fake_peers(lib, hidden=7176, disp_chunks=64)   # a multiple of 8, not of 16
    try:
        assert lib.mok_dispatch_layout(ctx, None, None, None, 0, None, 0, 256, None, 0, -1, 0, -1,
                                       7392, 1, 0) != 0
        assert "hidden a multiple of 16" in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


# The combine's row width (the prob-gradient-only combine runs with hidden = 8): 0 means the
# Buffer's hidden (7168); else a multiple of 8 no larger.
@pytest.mark.parametrize("hidden", [-8, 4, 12, 7168 + 8, 1 << 30])
def test_combine_refuses_a_bad_row_width_before_launching(hidden):
    lib = library.get()
    ctx = _with_fake_peers(lib)
    try:
        assert lib.mok_combine(ctx, None, None, None, None, 0, None, None, 0, 0, 0, 24, 4, hidden) != 0
        assert "combine hidden must be 0" in lib.mok_last_error().decode()
        # The producer check comes first and still names itself.
        assert lib.mok_combine(ctx, None, None, None, None, 0, None, None, 0, 0, 0, 24, 24, 8) != 0
        assert "num_producers" in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


@pytest.mark.parametrize("expert_out, y, rows, tokens", [
    (0x1000 + 2, 0x2000, 8, 4),     # expert_out 2 bytes past a 16-byte boundary (a bf16 view at +1)
    (0x1000 + 8, 0x2000, 8, 4),
    (None, 0x2000, 8, 4),           # rows to read, no pointer
    (0x1000, 0x2000 + 4, 8, 4),     # y misaligned
])
def test_combine_refuses_misaligned_rows_before_launching(expert_out, y, rows, tokens):
    """The combine's kernels load expert_out and store y as 16-byte vectors: a misaligned
    pointer is refused with a message (it reached the kernel before, whose misaligned load ends
    the CUDA context). The pointers are fake: the check comes before any launch."""
    lib = library.get()
    ctx = _with_fake_peers(lib)
    try:
        assert lib.mok_combine(ctx, None, None, expert_out, None, tokens, y, None, rows, 0, 0, 24, 4, 0) != 0
        assert "16-byte aligned" in lib.mok_last_error().decode(), lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


def test_combine_without_rows_or_tokens_needs_no_pointers():
    """No rows (row_cap 0) and no tokens: nothing is read or written, null pointers pass the
    alignment check (the call then fails at its launch here, without a GPU, not before)."""
    import torch

    if torch.cuda.is_available():
        # There the call passes its checks and launches on the fake workspace, and the last
        # error is the previous test's (run s39-4): the check is for a machine without a GPU.
        pytest.skip("a GPU is visible: the call would launch on a fake workspace")
    lib = library.get()
    ctx = _with_fake_peers(lib)
    try:
        lib.mok_combine(ctx, None, None, None, None, 0, None, None, 0, 0, 0, 24, 4, 0)
        assert "16-byte aligned" not in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


@pytest.mark.parametrize("steps", [0, 16, 1 | 32, -1])
def test_dispatch_launch_refuses_unknown_steps(steps):
    lib = library.get()
    ctx = _with_fake_peers(lib)
    try:
        assert _launch(lib, ctx, steps) != 0
        assert "MOK_STEP_" in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


@pytest.mark.parametrize("steps, kwargs, message", [
    # A bad transfer behind a valid layout and fill: refused before the layout is launched (a
    # launch on this GPU-less machine would fail with "dispatch layout launch: ..." instead).
    (1 | 2 | 8, dict(producers=24), "1 <= num_producers < num_blocks"),
    (1 | 2 | 8, dict(mode=3), "mode must be 0 (both roles)"),
    (1 | 2 | 4 | 8, dict(num_tokens=4097), "num_tokens outside"),
    (2 | 8, dict(blocks=0, producers=0, mode=2), "num_blocks >= 1"),
    (1 | 2 | 8, dict(rows_per_expert=-2), "rows_per_expert must be -1 or in [0"),
    (1 | 2 | 8, dict(rows_per_expert=1 << 40), "rows_per_expert must be -1 or in [0"),
    (1 | 2 | 8, dict(drop_over_cap=2), "drop_over_cap must be 0 or 1"),
    (1 | 2 | 8, dict(drop_over_cap=-1), "drop_over_cap must be 0 or 1"),
])
def test_dispatch_launch_checks_every_step_before_launching_any(steps, kwargs, message):
    lib = library.get()
    ctx = _with_fake_peers(lib)
    try:
        assert _launch(lib, ctx, steps, **kwargs) != 0
        assert message in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


def test_layout_drop_over_cap_is_not_for_a_speculative_layout():
    # A receive budget drops the rows past row_cap; a speculative layout instead redoes a short
    # transfer on every rank, so the two do not mix (refused before any launch).
    lib = library.get()
    ctx = _with_fake_peers(lib)
    try:
        assert lib.mok_dispatch_layout(ctx, None, None, None, 0, None, 0, 256, None, 0, 64, 0, -1,
                                       0, 0, 1) != 0
        assert "speculative" in lib.mok_last_error().decode()
        assert lib.mok_dispatch_layout(ctx, None, None, None, 0, None, 0, 256, None, 0, -1, 0, -1,
                                       0, 0, 3) != 0
        assert "drop_over_cap must be 0 or 1" in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


def test_dispatch_launch_staging_needs_a_ring_that_holds_a_call():
    lib = library.get()
    short = _with_fake_peers(lib, disp_chunks=63)
    try:
        assert _launch(lib, short, 1 | 2 | 4 | 8, num_tokens=128, mode=8) != 0
        assert "holds a whole call" in lib.mok_last_error().decode()
        assert _launch(lib, None, 1) != 0 and "null MokContext" in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(short)


def test_dispatch_launch_before_peers_are_set_fails_cleanly():
    lib = library.get()
    ctx = _create(lib)
    try:
        assert _launch(lib, ctx, 1 | 2 | 8) != 0
        assert "mok_set_peers" in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


def test_dispatch_launch_rows_per_expert_must_be_a_multiple_of_the_alignment():
    lib = library.get()
    ctx = _with_fake_peers(lib, align=16)
    try:
        assert _launch(lib, ctx, 1 | 2 | 8, rows_per_expert=40) != 0
        assert "multiple of expert_alignment" in lib.mok_last_error().decode()
        # a multiple passes this check and fails the next one (null pointers on a GPU-less
        # machine: the launch itself; here the transfer's checks come first)
        assert _launch(lib, ctx, 1 | 2 | 8, rows_per_expert=48, producers=24) != 0
        assert "num_producers" in lib.mok_last_error().decode()
    finally:
        lib.mok_destroy(ctx)


def test_a_chunk_past_the_routing_kernels_shared_memory_is_refused_at_create():
    # Such a chunk failed at its first dispatch with "dispatch layout launch: invalid argument"
    # (s31-1, MOK_CHUNK_TOKENS=16384 at top-8). The message names the largest chunk that fits;
    # that one is accepted, one token more is not, and the limit shrinks with topk.
    import re
    lib = library.get()
    assert not _create(lib, chunk=16384)
    msg = lib.mok_last_error().decode()
    assert "MOK_CHUNK_TOKENS" in msg and "shared memory" in msg, msg
    most = int(re.search(r"at most (\d+) tokens per chunk", msg).group(1))
    assert 1000 < most < 16384, msg
    ok = _create(lib, chunk=most)
    assert ok, lib.mok_last_error().decode()
    lib.mok_destroy(ok)
    assert not _create(lib, chunk=most + 1)
    assert not _create(lib, chunk=most, topk=16)
    assert not _create(lib, chunk=most, e_local=128 + 128)      # the experts' tables share it
    assert not _create(lib, e_local=0) and "num_local_experts" in lib.mok_last_error().decode()
    # experts whose tables alone fill the shared memory: no chunk size is offered ("at most 0")
    assert not _create(lib, chunk=1, e_local=4000)
    msg = lib.mok_last_error().decode()
    assert "no chunk fits" in msg and "4000 local experts" in msg and "at most" not in msg, msg


def test_kernel_arch_without_a_device_is_refused_with_a_message():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: test_the_gpu_runs_the_librarys_code checks it")
    lib = library.get()
    assert lib.mok_kernel_arch(0) == -1
    assert lib.mok_last_error().decode().startswith("mok_kernel_arch: ")


@pytest.mark.gpu
def test_the_gpu_runs_the_librarys_code():
    # The default build (sm_90a) on a Hopper GPU: the code it runs is sm_90 (binaryVersion 90).
    import torch

    lib = library.get()
    major, minor = torch.cuda.get_device_capability(0)
    assert lib.mok_kernel_arch(0) == 10 * major + minor == 90
    assert lib.mok_kernel_arch(torch.cuda.device_count()) == -1    # no such device
    assert "cannot be selected" in lib.mok_last_error().decode()

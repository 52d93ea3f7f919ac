"""The Python mirrors of the C ABI's numbers (megatron_mok/cuda/bindings.py) against the C
sources they copy: a renumbering on one side only would launch the wrong steps or modes
without any error. Reads the headers as text: runs without the library or a GPU."""

import os
import re

from megatron_mok.cuda import bindings

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def _read(rel):
    with open(os.path.join(CSRC, rel)) as f:
        return f.read()


def test_abi_version_matches_the_header():
    m = re.search(r"#define MOK_ABI_VERSION (\d+)", _read("api/mok_api.h"))
    assert m and int(m.group(1)) == bindings.ABI_VERSION


def test_dispatch_steps_match_the_header():
    api = _read("api/mok_api.h")
    for name in ("LAYOUT", "FILL", "STAGE_COPY", "TRANSFER"):
        m = re.search(rf"#define MOK_STEP_{name} (\d+)", api)
        assert m and int(m.group(1)) == getattr(bindings, f"STEP_{name}"), name


def test_transfer_modes_match_the_kernels_enum():
    launch = _read("include/mok/launch.h")
    for c_name, py_name in (("kTransferBoth", "TRANSFER_BOTH"), ("kTransferStage", "TRANSFER_STAGE"),
                            ("kTransferPull", "TRANSFER_PULL"), ("kTransferNoPad", "TRANSFER_NO_PAD"),
                            ("kTransferCeStaged", "TRANSFER_CE_STAGED")):
        m = re.search(rf"\b{c_name} = (\d+)", launch)
        assert m and int(m.group(1)) == getattr(bindings, py_name), c_name


def test_expert_alignment_limit_matches_the_kernels():
    from megatron_mok.buffer import MAX_EXPERT_ALIGNMENT

    m = re.search(r"kMaxExpertAlignment = (\d+)", _read("include/mok/config.h"))
    assert m and int(m.group(1)) == MAX_EXPERT_ALIGNMENT


def test_error_codes_match_the_kernels_enum():
    from megatron_mok.cuda import backend, errors

    config = _read("include/mok/config.h")
    codes = dict((int(v), n) for n, v in re.findall(r"\b(k[A-Za-z]+) = (\d+),\s*//", config)
                 if n in ("kTimeout", "kBadExpert", "kRecvOverflow", "kAborted", "kConfigMismatch",
                          "kExpertOverflow", "kPeerStopped"))
    assert len(codes) == 7, codes
    assert set(errors.ERROR_CODES) == set(codes)
    assert codes[backend.BAD_EXPERT] == "kBadExpert"
    assert codes[backend.EXPERT_OVERFLOW] == "kExpertOverflow"


def test_rows_per_expert_off_value_matches_the_header():
    # "-1: rows as received" in mok_dispatch_layout's comment; RowOutputs' default
    assert "int32_t rows_per_expert = -1;" in _read("include/mok/launch.h")
    assert bindings.NO_ROWS_PER_EXPERT == -1


def test_config_mismatch_subjects_match_the_kernels_enum():
    from megatron_mok.cuda import errors

    config = _read("include/mok/config.h")
    for c_name, value in (("kMismatchSpeculative", errors.MISMATCH_SPECULATIVE),
                          ("kMismatchRowBytes", errors.MISMATCH_ROW_BYTES)):
        m = re.search(rf"\b{c_name} = (\d+)", config)
        assert m and int(m.group(1)) == value, c_name
    # The detail is the peer's row format: 16-byte vectors, | 1 << 19 for an FP8 pair's two sources.
    one = errors.describe([5, 0, 1, 1, 7392 // 16, 0, 0, 0], 60, None)
    assert "dispatched rows of different sizes" in one and "7392 bytes, from one tensor" in one
    two = errors.describe([5, 0, 1, 1, 7392 // 16 | 1 << 19, 0, 0, 0], 60, None)
    assert "7392 bytes, from an FP8 pair read in place" in two
    assert "speculative" in errors.describe([5, 0, 1, 0, -1, -1, 0, 0], 60, None)


def test_row_format_bit_matches_the_kernels():
    from megatron_mok.cuda import errors

    config = _read("include/mok/config.h")
    bits = re.search(r"constexpr int kRowTagBits = (\d+);", config)
    two = re.search(r"kRowTwoSources = 1 << \(kRowTagBits - 1\);", config)
    assert bits and two and int(bits.group(1)) - 1 == errors.ROW_TWO_SOURCES_BIT


def test_stop_note_size_matches_the_kernels():
    from megatron_mok.cuda import errors

    config = _read("include/mok/config.h")
    m = re.search(r"constexpr int kStopNoteBytes = (\d+);", config)
    assert m and int(m.group(1)) == errors.REASON_BYTES
    assert "static_assert(sizeof(StopNote) == 256" in _read("include/mok/workspace.h")


def test_dtype_codes_match_the_kernels_enum():
    # The combine takes its dtypes as these codes (launch.h DtypeCode); a second, different
    # table of the same name once shadowed this one in backend.py and every combine read its
    # rows in the wrong dtype (found on the GPU, s39-5: this test would have found it here).
    import torch

    from megatron_mok.cuda import backend

    m = re.search(r"enum DtypeCode : int \{ kBF16 = (\d+), kFP16 = (\d+), kFP32 = (\d+) \};",
                  _read("include/mok/launch.h"))
    assert m, "DtypeCode not found in launch.h"
    assert backend.DTYPE_CODES == {torch.bfloat16: int(m.group(1)), torch.float16: int(m.group(2)),
                                   torch.float32: int(m.group(3))}

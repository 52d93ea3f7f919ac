"""scripts/fuzz_dispatch.py on the CPU: the reference backend against the oracle.

The fuzzer's GPU run (CUDA backend vs reference) uses the same draw, rank code and checker,
so these tests keep its machinery honest on every CI run: a few cases pass end to end and
write the JSON; the draw is deterministic, valid by construction and turns every feature
both on and off; and the checker does fail on a corrupted result (a checker that cannot
fail would make every fuzz run pass).
"""

import json
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import fuzz_dispatch as fz  # noqa: E402
from megatron_mok import fp8, loopback  # noqa: E402

# A master seed whose first 6 cases (max world 3) cover every kind of call: FP8 pairs, both
# backward paths, cached dispatches, static shape, alignment, rows_per_expert, a wrapped ring.
# A failure here is a reference/oracle disagreement, a library error or a fuzzer bug; fuzz.json
# (and the message below) names the case seed to --replay.
SEED = 5
# What those 6 cases must have exercised (so a change of the draw cannot quietly hollow it out).
COVERED = ("fp8", "backward_autograd", "backward_by_hand", "cached", "cached_backward", "static_shape",
           "expert_alignment", "rows_per_expert", "call_larger_than_ring", "rank_with_zero_tokens")


def test_fuzzer_runs_cases_on_cpu_and_writes_json(tmp_path):
    rc = fz.main(["--device", "cpu", "--cases", "6", "--max-world", "3", "--seed", str(SEED),
                  "--seconds", "600", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "fuzz.json").read_text())
    first = doc["failures"][0] if doc["failures"] else {}
    assert not first, f"case seed {first.get('case_seed')}: {first.get('message')}"
    assert rc == 0
    assert doc["cases"] == 6 and doc["stopped"] == "cases"
    assert doc["args"]["max_world"] == 3 and doc["device"] == "cpu"
    assert sum(v for k, v in doc["feature_counts"].items() if k.startswith("world_")) == 6
    missing = [f for f in COVERED if f not in doc["feature_counts"]]
    assert not missing, f"seed {SEED} no longer covers {missing}: pick another"
    assert doc["elapsed_s"] > 0


def _check_valid(cfg: dict, device_sms: int = fz.NOMINAL_SMS) -> None:
    """What Buffer, dispatch and the loopback group would refuse must never be drawn."""
    W, E, K, H = cfg["world_size"], cfg["num_experts"], cfg["topk"], cfg["hidden"]
    A, T_max, dtype = cfg["expert_alignment"], cfg["max_tokens_per_rank"], fz.DTYPES[cfg["dtype"]]
    assert E % W == 0 and 1 <= E // W <= 8 and 1 <= K <= E and H % 8 == 0
    if cfg["num_sms"] is not None:
        assert 1 <= cfg["num_sms"] <= max(1, (device_sms - loopback.SPARE_SMS) // W)
    if cfg["ring_bytes"] is not None:
        C, elem = fz.chunk_tokens(), dtype.itemsize
        pelem = 4 if cfg["partial_fp32"] else elem
        assert cfg["ring_bytes"] >= max(C * H * elem, C * H * pelem + C * K * 4)
    for i, st in enumerate(cfg["steps"]):
        assert len(st["tokens"]) == W and all(0 <= t <= T_max for t in st["tokens"])
        counts = fz.expert_counts(cfg, i)
        for d in range(W):
            idx = fz.step_routing(cfg, i, d)
            assert tuple(idx.shape) == (st["tokens"][d], K)
            assert bool(((idx >= -1) & (idx < E)).all())
            if st["rows_per_expert"] is not None:
                n = st["rows_per_expert"][d]
                assert n % A == 0 and n >= int(counts[d].max())
            rows = (E // W * st["rows_per_expert"][d] if st["rows_per_expert"] is not None
                    else sum(-(-int(c) // A) * A for c in counts[d]))
            if cfg["max_recv_tokens"] is not None:
                assert rows <= cfg["max_recv_tokens"]
        if st["fp8"] is not None:
            scale_cols, scale_dtype = ((H // st["fp8"]["block"], torch.float32) if st["fp8"]["kind"] == "quantize"
                                       else (st["fp8"]["scale_cols"], torch.uint8))
            assert fp8.packed_row_bytes(H, scale_cols, scale_dtype) <= H * dtype.itemsize


def test_draw_is_deterministic_valid_and_turns_every_feature_on_and_off():
    n = 200
    counts = {}
    for s in range(n):
        cfg = fz.draw_config(s, max_world=4)
        assert cfg == fz.draw_config(s, max_world=4)          # --replay depends on it
        json.dumps(cfg)                                         # goes into fuzz.json as is
        _check_valid(cfg)
        for f in fz.case_features(cfg):
            counts[f] = counts.get(f, 0) + 1
    on_and_off = {f: counts.get(f, 0) for f in fz.MAIN_FEATURES}
    assert all(0 < c < n for c in on_and_off.values()), on_and_off
    for w in (1, 2, 3, 4):
        assert counts.get(f"world_{w}", 0) > 0, counts
    assert not any(k.startswith("world_5") for k in counts)


def _small_case() -> dict:
    """Two ranks, padding rows (alignment 4), a backward and a cached dispatch: every field."""
    cfg = {"case_seed": 0, "world_size": 2, "num_experts": 4, "topk": 2, "hidden": 16,
           "dtype": "bfloat16", "partial_fp32": False, "num_sms": None, "expert_alignment": 4,
           "max_tokens_per_rank": 9, "ring_chunks": None, "ring_bytes": None}
    cfg["steps"] = [{"seed": 5, "tokens": [5, 7], "routing": "duplicates", "hot_expert": 0, "hot_rank": 0,
                     "one_slot": False, "unrouted": 0.15, "idx_dtype": "int64", "values": "normal",
                     "fp8": None, "rows_extra": None, "cached": True, "grad": "by_hand", "nan_padding": True}]
    fz._derive_capacities(random.Random(0), cfg)
    return cfg


def _flip_low_bit(t: torch.Tensor, index) -> None:
    """Flip the lowest bit of one element in place (the smallest change there is)."""
    ints = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    ints[index] ^= 1


def test_the_checker_reports_a_corrupted_result():
    cfg = _small_case()
    got, want = fz.execute_case(cfg, "cpu", 60.0)
    assert fz.compare_case(got, want) == []
    r0 = got[0][0]
    pad = r0["src_rank"] < 0
    assert bool(pad.any()) and bool((~pad).any()), "the case must have real and padding rows"
    for field in ("tokens", "y", "grad_x", "grad_w", "grad_eo", "cached_tokens", "grad_cached_x"):
        assert got[0][1][field].numel() > 0, field

    # one bit of one element of the combine output
    _flip_low_bit(got[0][1]["y"], (0, 3))
    problems = fz.compare_case(got, want)
    assert len(problems) == 1 and problems[0].startswith("step 0 rank 1 y: 1 of "), problems
    assert "differ bitwise" in problems[0]
    _flip_low_bit(got[0][1]["y"], (0, 3))
    assert fz.compare_case(got, want) == []

    # +0.0 vs -0.0 is a difference (bits, not values)
    zero = r0["tokens"][pad][0:1]
    assert bool((zero == 0).all())
    row = int(pad.nonzero()[0])
    r0["tokens"][row, 0] = -0.0
    problems = fz.compare_case(got, want)
    assert any("step 0 rank 0 tokens:" in p for p in problems), problems
    assert any("tokens on padding rows" in p for p in problems), problems

    # a missing field is reported, not skipped
    del got[0][1]["grad_w"]
    assert "step 0 rank 1 grad_w: only in the expectation" in fz.compare_case(got, want)


def test_padding_check_needs_no_expectation():
    got, _ = fz.execute_case(_small_case(), "cpu", 60.0)
    r = got[0][1]
    assert fz.padding_problems(r, "x") == []
    row = int((r["src_rank"] < 0).nonzero()[0])
    r["probs"][row] = 0.5
    r["src_token"][row] = 3
    problems = fz.padding_problems(r, "x")
    assert any("probs on padding rows" in p for p in problems), problems
    assert any("src_token on padding rows" in p for p in problems), problems


def test_failures_and_timeouts_are_recorded_and_set_the_exit_status(tmp_path, monkeypatch):
    calls = []

    def fake_execute(cfg, device, timeout_s):     # an error first, then a hang
        calls.append(cfg["case_seed"])
        if len(calls) == 1:
            raise ValueError("an unexpected error")
        raise loopback.LoopbackError("loopback run of rank_main failed:\n--- rank -1 ---\n"
                                     "ranks [1] did not finish within 3 s (hang?)")

    monkeypatch.setattr(fz, "execute_case", fake_execute)
    rc = fz.main(["--device", "cpu", "--cases", "5", "--max-world", "2", "--seed", "3", "--seconds", "600",
                  "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "fuzz.json").read_text())
    assert rc == 1
    # a hang stops the run (its threads may still hold the device); an error before it does not
    assert [f["kind"] for f in doc["failures"]] == ["exception", "timeout"] and doc["cases"] == 2
    assert doc["stopped"].startswith("timeout")
    first, hang = doc["failures"]
    assert first["message"] == "ValueError: an unexpected error" and "Traceback" in first["traceback"]
    assert first["case_seed"] == calls[0] and first["config"] == fz.draw_config(calls[0], 2)
    assert f"--replay {calls[0]} --max-world 2" in first["replay"]
    assert hang["message"] == "rank -1: ranks [1] did not finish within 3 s (hang?)"

    # --replay runs exactly that case again
    calls.clear()
    rc = fz.main(["--device", "cpu", "--replay", str(first["case_seed"]), "--max-world", "2",
                  "--out", str(tmp_path / "replay")])
    assert rc == 1 and calls == [first["case_seed"]]


@pytest.mark.parametrize("text,root", [
    ("x failed:\n--- rank 0 ---\nTraceback\nLoopbackError: loopback barrier broken: a peer rank failed\n"
     "--- rank 2 ---\nTraceback\n  File y\nRuntimeError: boom\n", "rank 2: RuntimeError: boom"),
    ("x failed:\n--- rank -1 ---\nranks [0] did not finish within 3 s (hang?)\n",
     "rank -1: ranks [0] did not finish within 3 s (hang?)"),
])
def test_the_root_cause_is_the_first_error_line(text, root):
    assert fz._first_error_line(text) == root

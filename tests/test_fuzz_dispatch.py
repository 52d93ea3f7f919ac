"""scripts/fuzz_dispatch.py on the CPU: the reference backend against the oracle.

The fuzzer's GPU run (CUDA backend vs reference) uses the same draw, rank code and checker,
so these tests keep its machinery honest on every CI run: a few cases pass end to end and
write the JSON; the draw is deterministic, valid by construction and turns every feature
both on and off; and the checker does fail on a corrupted result (a checker that cannot
fail would make every fuzz run pass).

The ``--device cuda`` extras (MOK_* schedules, CUDA-graph steps) cannot run here; these tests
check their draw (only in cuda mode, valid, deterministic), that the environment is put back
after a case however it ends, that ``--replay`` reproduces them, and the graph step's plumbing
(inputs copied into the captured tensors, results in order) through its eager CPU stand-in
against the oracle.
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
from megatron_mok.cuda.backend import ring_chunk_bytes  # noqa: E402

# A master seed whose first 6 cases (max world 3) cover every kind of call: FP8 pairs, both
# backward paths, cached dispatches, static shape, alignment, rows_per_expert, a wrapped ring,
# receive budgets (one that drops rows, one beside a cached dispatch, a peer without one).
# A failure here is a reference/oracle disagreement, a library error or a fuzzer bug; fuzz.json
# (and the message below) names the case seed to --replay.
SEED = 5
# What those 6 cases must have exercised (so a change of the draw cannot quietly hollow it out).
COVERED = ("fp8", "backward_autograd", "backward_by_hand", "cached", "cached_backward", "static_shape",
           "expert_alignment", "rows_per_expert", "call_larger_than_ring", "rank_with_zero_tokens",
           "recv_budget", "recv_budget_drop", "recv_budget_cached", "recv_budget_mixed_ranks")


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
        elem = dtype.itemsize
        pelem = 4 if cfg["partial_fp32"] else elem
        # At least one chunk of each ring, as the backend counts them (else Buffer refuses).
        assert cfg["ring_bytes"] >= max(ring_chunk_bytes(fz.chunk_tokens(), H, K, elem, pelem))
    for i, st in enumerate(cfg["steps"]):
        assert len(st["tokens"]) == W and all(0 <= t <= T_max for t in st["tokens"])
        counts = fz.expert_counts(cfg, i)
        budgets = _check_budgets(cfg, st)
        for d in range(W):
            idx = fz.step_routing(cfg, i, d)
            assert tuple(idx.shape) == (st["tokens"][d], K)
            assert bool(((idx >= -1) & (idx < E)).all())
            if st["rows_per_expert"] is not None:
                n = st["rows_per_expert"][d]
                assert n % A == 0 and n >= int(counts[d].max())
            rows = (E // W * st["rows_per_expert"][d] if st["rows_per_expert"] is not None
                    else sum(-(-int(c) // A) * A for c in counts[d]))
            if cfg["max_recv_tokens"] is not None and budgets[d] is None:
                assert rows <= cfg["max_recv_tokens"]      # (a budget replaces it for its call)
        if st["fp8"] is not None:
            scale_cols, scale_dtype = ((H // st["fp8"]["block"], torch.float32) if st["fp8"]["kind"] == "quantize"
                                       else (st["fp8"]["scale_cols"], torch.uint8))
            assert fp8.packed_row_bytes(H, scale_cols, scale_dtype) <= H * dtype.itemsize
    _check_graph(cfg)
    _check_schedule(cfg, device_sms)


def _check_budgets(cfg: dict, st: dict) -> list:
    """A step's (or graph step's) receive budgets, per rank: None, or a list with at least one
    int >= 0 that is a multiple of the alignment (None: that rank passes none); never with
    rows_per_expert (dispatch refuses both). Returns them per rank."""
    b = st.get("recv_budget")
    W = cfg["world_size"]
    if b is None:
        return [None] * W
    assert isinstance(b, list) and len(b) == W and any(m is not None for m in b), b
    assert st["rows_per_expert"] is None
    for m in b:
        assert m is None or (type(m) is int and m >= 0 and m % cfg["expert_alignment"] == 0), b
    return b


def _check_graph(cfg: dict) -> None:
    """A graph step: static shape, or on an eager Buffer a receive budget on every rank (no
    host read: capturable); every input the captured shapes and arguments; every rank's rows of
    every input within max_recv_tokens, but a rank with a budget; rows_per_expert over every
    input's fullest expert, never with FP8, a budget or an eager Buffer; an FP8 row that fits
    the token row."""
    g = cfg.get("graph")
    if g is None:
        return
    W, E, A, H = cfg["world_size"], cfg["num_experts"], cfg["expert_alignment"], cfg["hidden"]
    budgets = _check_budgets(cfg, g)
    if cfg["max_recv_tokens"] is None:
        assert all(m is not None for m in budgets), budgets
        assert g["rows_per_expert"] is None
    assert len(g["tokens"]) == W and all(0 <= t <= cfg["max_tokens_per_rank"] for t in g["tokens"])
    assert 3 <= len(g["replays"]) <= 5
    assert not (g["fp8"] and g["rows_per_expert"] is not None)
    if g["fp8"] is not None:
        scale_cols, scale_dtype = ((H // g["fp8"]["block"], torch.float32) if g["fp8"]["kind"] == "quantize"
                                   else (g["fp8"]["scale_cols"], torch.uint8))
        assert fp8.packed_row_bytes(H, scale_cols, scale_dtype) <= H * fz.DTYPES[cfg["dtype"]].itemsize
    steps = fz.graph_steps(cfg)
    shapes = None
    for st in steps:
        assert st["tokens"] == g["tokens"] and st["grad"] == "none" and not st["cached"]
        inputs = fz._inputs(cfg, st)
        sig = [(k, tuple(t.shape), t.dtype) for d in inputs for k, v in sorted(d.items())
               for t in (v if isinstance(v, tuple) else (v,))]
        assert shapes is None or sig == shapes       # what the captured tensors hold
        shapes = sig
        counts = fz._expert_counts(cfg, st)
        for d in range(W):
            if g["rows_per_expert"] is not None:
                n = g["rows_per_expert"][d]
                assert n % A == 0 and n >= int(counts[d].max())
                rows = E // W * n
            else:
                rows = sum(-(-int(c) // A) * A for c in counts[d])
            if budgets[d] is None:
                assert rows <= cfg["max_recv_tokens"]


# The requirement of each schedule, written out again here (not read from the script).
def _schedule_ok(env: dict, cfg: dict, device_sms: int) -> bool:
    W, static = cfg["world_size"], cfg["max_recv_tokens"] is not None
    if "MOK_EAGER_SPECULATIVE" in env and (static or cfg["expert_alignment"] != 1):
        return False
    # A step where some ranks pass a budget (not speculative) and others not (speculative): the
    # speculative layout refuses such peers.
    steps = list(cfg["steps"]) + ([cfg["graph"]] if cfg["graph"] else [])
    if "MOK_EAGER_SPECULATIVE" in env and any(
            st.get("recv_budget") and None in st["recv_budget"] for st in steps):
        return False
    if "MOK_EAGER_FILL_FIRST" in env and static:
        return False
    if "MOK_DISPATCH_CE_OVERLAP" in env and (W == 1 or cfg["graph"] is not None):
        return False
    if "MOK_PDL" in env and W != 1:
        return False
    if env.get("MOK_SMALL_CALL_SMS") == "0" and (W != 1 or cfg["num_sms"] is not None):
        return False
    if env.get("MOK_SMALL_CALL_SMS") == "8":
        # the backend's own check for the small-call budget's blocks (loopback.check_layout_fits)
        most = max(1, (device_sms - loopback.SPARE_SMS) // W)
        blocks = max(2, min(8, most))
        need = W * W * -(-cfg["max_tokens_per_rank"] // fz.chunk_tokens())
        if need > (device_sms - W * blocks) * loopback.COUNT_BLOCKS_PER_SM:
            return False
    if "MOK_COMBINE_NARROW" in env and cfg["hidden"] != 8 and cfg["fp8"] is None:
        return False
    return "MOK_CHUNK_TOKENS" not in env


def _check_schedule(cfg: dict, device_sms: int) -> None:
    sched = cfg.get("schedule")
    if sched is None:
        return
    assert 1 <= len(sched["ids"]) <= 2 and len(set(sched["ids"])) == len(sched["ids"])
    envs = [fz.SCHEDULE_ENV[sid] for sid in sched["ids"]]
    if len(envs) == 2:
        assert not set(envs[0]) & set(envs[1]), sched
    merged = {k: v for e in envs for k, v in e.items()}
    assert sched["env"] == merged
    for e in envs:
        assert _schedule_ok(e, cfg, device_sms), (sched, cfg["world_size"], cfg["max_recv_tokens"])


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
    assert "recv_budget" in on_and_off and "recv_budget_drop" in on_and_off
    for w in (1, 2, 3, 4):
        assert counts.get(f"world_{w}", 0) > 0, counts
    assert not any(k.startswith("world_5") for k in counts)
    budget_kinds = {f: counts.get(f, 0) for f in fz.BUDGET_FEATURES}
    assert all(0 < c < n for c in budget_kinds.values()), budget_kinds


def test_budgets_are_drawn_below_at_and_above_each_ranks_rows():
    """Each budgeted rank's M against its own rows R, counted here from the routing (not from
    the fuzzer's features): 0, below R (a drop), exactly R, above R, a peer without a budget,
    on eager and static Buffers, R past max_recv_tokens (the budget replaces it), alignment
    multiples; never a step with rows_per_expert."""
    kinds = {}
    for s in range(200):
        cfg = fz.draw_config(s, max_world=4)
        A = cfg["expert_alignment"]
        for i, st in enumerate(cfg["steps"]):
            if st["recv_budget"] is None:
                continue
            assert st["rows_per_expert"] is None
            counts = fz.expert_counts(cfg, i)
            for d, M in enumerate(st["recv_budget"]):
                if M is None:
                    kinds["none"] = kinds.get("none", 0) + 1
                    continue
                R = sum(-(-int(c) // A) * A for c in counts[d])
                kind = ("zero" if M == 0 else "below" if M < R else "exact" if M == R else "above")
                for k in (kind, "static" if cfg["max_recv_tokens"] is not None else "eager",
                          "aligned" if A > 1 else None,
                          "past_cap" if cfg["max_recv_tokens"] is not None and R > cfg["max_recv_tokens"] else None):
                    if k:
                        kinds[k] = kinds.get(k, 0) + 1
    for k in ("zero", "below", "exact", "above", "none", "static", "eager", "aligned", "past_cap"):
        assert kinds.get(k, 0) > 0, kinds


def _test_list_settings() -> dict:
    """id -> environment of every entry of the schedule lists of the GPU tests."""
    import test_cuda_backend
    import test_cuda_loopback
    import test_fp8_dispatch

    out = {}
    for lst in (test_cuda_backend.ALT_SCHEDULES, test_cuda_backend.SPLIT_SCHEDULES,
                test_cuda_loopback.LOOPBACK_SCHEDULES, test_cuda_loopback.NARROW_SCHEDULES,
                test_fp8_dispatch.FP8_SCHEDULES):
        for p in lst:
            assert out.get(p.id, p.values[0]) == p.values[0]
            out[p.id] = p.values[0]
    return out


def test_the_schedules_are_entries_of_the_test_lists():
    listed = _test_list_settings()
    for sid, env, _ in fz.SCHEDULES:
        assert listed.get(sid) == env, sid
        fz.schedule_allowed(sid, fz.draw_config(0, device="cuda"))      # a known requirement
    # every setting of those lists is drawn but one (the same setting may have two ids there)
    left_out = {sid for sid, env in listed.items() if env and env not in fz.SCHEDULE_ENV.values()}
    assert left_out == {"chunk7_padded_slots"}, left_out


def test_cuda_draw_adds_valid_schedules_and_graphs_and_cpu_draw_never_does():
    n, counts, ids = 300, {}, {}
    for s in range(n):
        cpu = fz.draw_config(s, max_world=4)
        cfg = fz.draw_config(s, max_world=4, device="cuda")
        assert cpu["schedule"] is None and cpu["graph"] is None
        assert cfg == fz.draw_config(s, max_world=4, device="cuda")          # --replay
        json.dumps(cfg)
        _check_valid(cfg)
        # the rest of the draw is the CPU draw (a graph step may only raise max_recv_tokens)
        assert {k: v for k, v in cfg.items() if k not in ("schedule", "graph", "max_recv_tokens")} == \
            {k: v for k, v in cpu.items() if k not in ("schedule", "graph", "max_recv_tokens")}
        if cfg["graph"] is None or cpu["max_recv_tokens"] is None:     # (eager: a budget graph)
            assert cfg["max_recv_tokens"] == cpu["max_recv_tokens"]
        else:
            assert cfg["max_recv_tokens"] >= cpu["max_recv_tokens"]
        off = fz.draw_config(s, max_world=4, device="cuda", schedules=False, graphs=False)
        assert off["schedule"] is None and off["graph"] is None and off["max_recv_tokens"] == cpu["max_recv_tokens"]
        feats = fz.case_features(cfg)
        for f in feats:
            counts[f] = counts.get(f, 0) + 1
        assert ("schedule" in feats) == (cfg["schedule"] is not None)
        assert ("cuda_graph" in feats) == (cfg["graph"] is not None)
        for sid in (cfg["schedule"] or {}).get("ids", ()):
            ids[sid] = ids.get(sid, 0) + 1
            assert f"schedule_{sid}" in feats
    for f in ("schedule", "cuda_graph", "cuda_graph_fp8", "cuda_graph_rows_per_expert",
              "cuda_graph_recv_budget", "cuda_graph_eager_buffer", "cuda_graph_recv_budget_drop_and_not"):
        assert 0 < counts.get(f, 0) < n, (f, counts.get(f))
    assert sum(1 for s in range(n) if len((fz.draw_config(s, 4, device="cuda")["schedule"] or {}).get("ids", ())) == 2) > 0
    assert len(ids) >= 15, ids
    for sid in ("eager_speculative", "dispatch_ce_copy_beside_layout", "plain_launches",
                "small_call_sms_mixed_ranks", "layout_three_kernels"):
        assert ids.get(sid, 0) > 0, ids
    # a smaller GPU: the 8-SM small-call budget is left out where its routing kernels do not fit
    for s in range(100):
        _check_valid(fz.draw_config(s, max_world=4, device_sms=80, device="cuda"), 80)


def test_schedule_requirements():
    base = fz.draw_config(1, device="cuda")
    cfg = dict(base, world_size=2, num_sms=None, max_recv_tokens=None, expert_alignment=1, graph=None)
    assert fz.schedule_allowed("eager_speculative", cfg)
    assert not fz.schedule_allowed("eager_speculative", dict(cfg, expert_alignment=8))
    assert not fz.schedule_allowed("eager_speculative", dict(cfg, max_recv_tokens=100))
    assert not fz.schedule_allowed("eager_fill_first", dict(cfg, max_recv_tokens=100))
    assert fz.schedule_allowed("dispatch_ce_copy_beside_layout", cfg)
    assert not fz.schedule_allowed("dispatch_ce_copy_beside_layout", dict(cfg, world_size=1))
    assert not fz.schedule_allowed("dispatch_ce_copy_beside_layout", dict(cfg, graph={"replays": []}))
    assert not fz.schedule_allowed("plain_launches", cfg)
    assert fz.schedule_allowed("plain_launches", dict(cfg, world_size=1))
    assert fz.schedule_allowed("small_calls_on_num_sms", dict(cfg, world_size=1))
    assert not fz.schedule_allowed("small_calls_on_num_sms", dict(cfg, world_size=1, num_sms=8))
    # 4 ranks x 8 SMs on a 132-SM GPU leave room for (132 - 32) * 8 // 16 = 50 chunks of 64 tokens
    assert fz.schedule_allowed("small_call_sms_mixed_ranks", dict(cfg, world_size=4, max_tokens_per_rank=50 * 64))
    assert not fz.schedule_allowed("small_call_sms_mixed_ranks", dict(cfg, world_size=4, max_tokens_per_rank=50 * 64 + 1))


def _cuda_cfg(pred, max_world=3, limit=2000) -> dict:
    for s in range(limit):
        cfg = fz.draw_config(s, max_world, device="cuda")
        if pred(cfg):
            return cfg
    raise AssertionError("no such config drawn")


def test_the_environment_is_set_for_a_case_and_put_back_however_it_ends(monkeypatch):
    cfg = _cuda_cfg(lambda c: c["schedule"] is not None and len(c["schedule"]["ids"]) == 2)
    env = cfg["schedule"]["env"]
    keys = sorted(env)
    monkeypatch.setenv(keys[0], "previous")               # put back as it was ...
    for k in keys[1:]:
        monkeypatch.delenv(k, raising=False)             # ... or removed
    before = dict(os.environ)
    seen = []

    def body(kind):
        def fake_execute(c, device, timeout_s):
            seen.append({k: os.environ.get(k) for k in keys})
            if kind == "error":
                raise RuntimeError("the case body failed")
            if kind == "hang":
                raise loopback.LoopbackError("x failed:\n--- rank -1 ---\nranks [0] did not finish within 3 s (hang?)")
            raise KeyboardInterrupt
        return fake_execute

    monkeypatch.setattr(fz, "execute_case", body("error"))
    failure = fz.run_case(cfg, "cuda", 5.0)
    assert failure["kind"] == "exception" and "the case body failed" in failure["message"]
    assert seen[-1] == env and dict(os.environ) == before
    monkeypatch.setattr(fz, "execute_case", body("hang"))
    assert fz.run_case(cfg, "cuda", 5.0)["kind"] == "timeout"
    assert seen[-1] == env and dict(os.environ) == before
    monkeypatch.setattr(fz, "execute_case", body("interrupt"))
    with pytest.raises(KeyboardInterrupt):
        fz.run_case(cfg, "cuda", 5.0)
    assert seen[-1] == env and dict(os.environ) == before
    # not on the CPU (the settings are the CUDA backend's)
    monkeypatch.setattr(fz, "execute_case", body("error"))
    fz.run_case(cfg, "cpu", 5.0)
    assert seen[-1] == {k: before.get(k) for k in keys} and dict(os.environ) == before


def _pretend_gpu(monkeypatch, seen):
    """main() with --device cuda on this machine: a stand-in GPU, and a case body that records
    its config and MOK_* environment, then fails (so every case is written to fuzz.json)."""
    monkeypatch.setattr(fz, "_cuda_usable", lambda: True)
    monkeypatch.setattr(fz, "_gpu_environment_ok", lambda max_world: True)
    monkeypatch.setattr(fz, "_device_info", lambda device: ("stand-in GPU", fz.NOMINAL_SMS))

    def fake_execute(cfg, device, timeout_s):
        assert device == "cuda"
        seen.append((json.loads(json.dumps(cfg)), {k: v for k, v in os.environ.items() if k.startswith("MOK_")}))
        raise RuntimeError("recorded")

    monkeypatch.setattr(fz, "execute_case", fake_execute)


def test_replay_reproduces_the_schedule_and_the_graph_step(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("MOK_")]:
        monkeypatch.delenv(k)
    seen = []
    _pretend_gpu(monkeypatch, seen)
    rc = fz.main(["--device", "cuda", "--cases", "16", "--max-world", "3", "--seed", "11", "--seconds", "600",
                  "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "fuzz.json").read_text())
    assert rc == 1 and doc["cases"] == 16 and len(doc["failures"]) == 16
    assert not [k for k in os.environ if k.startswith("MOK_")]
    for f in ("schedule", "cuda_graph"):
        assert 0 < doc["feature_counts"].get(f, 0) < 16, (f, doc["feature_counts"])
    for (cfg, env), failure in zip(seen, doc["failures"]):
        assert failure["config"] == cfg and env == ((cfg["schedule"] or {}).get("env") or {})
    sched = next(f for f in doc["failures"] if f["config"]["schedule"])
    graph = next(f for f in doc["failures"] if f["config"]["graph"])
    for i, failure in enumerate((sched, graph)):
        assert "--device cuda" in failure["replay"] and "--no-" not in failure["replay"]
        seen.clear()
        fz.main(["--device", "cuda", "--replay", str(failure["case_seed"]), "--max-world", "3",
                 "--out", str(tmp_path / f"replay{i}")])
        assert seen == [(failure["config"], (failure["config"]["schedule"] or {}).get("env") or {})]

    # --no-schedules / --no-graphs: none drawn, and the replay command says so
    seen.clear()
    fz.main(["--device", "cuda", "--cases", "16", "--max-world", "3", "--seed", "11", "--seconds", "600",
             "--no-schedules", "--no-graphs", "--out", str(tmp_path / "off")])
    doc = json.loads((tmp_path / "off" / "fuzz.json").read_text())
    assert all(cfg["schedule"] is None and cfg["graph"] is None and env == {} for cfg, env in seen)
    assert "--no-schedules --no-graphs" in doc["failures"][0]["replay"]


def _graph_cfg(fp8_input=False, fixed=False, budget=None) -> dict:
    """A small cuda-mode case (2+ ranks) with a graph step of that kind (``budget``: None, or a
    receive budget in the graph, on a "static" Buffer or an "eager" one, whose replays drop rows
    on some rank in some replays but not all)."""
    return _cuda_cfg(lambda c: c["graph"] is not None and c["world_size"] > 1 and c["hidden"] <= 256
                     and bool(c["graph"]["fp8"]) == fp8_input
                     and (c["graph"]["rows_per_expert"] is not None) == fixed
                     and (c["graph"]["recv_budget"] is not None) == (budget is not None)
                     and (c["max_recv_tokens"] is None) == (budget == "eager")
                     and (budget is None or "cuda_graph_recv_budget_drop_and_not" in fz.case_features(c))
                     and max(max(st["tokens"]) for st in c["steps"]) <= (300 if budget is None else 450))


@pytest.mark.parametrize("kind", ["plain", "fp8", "rows_per_expert", "budget", "eager_budget"])
def test_the_graph_step_plumbing_on_the_cpu_stand_in(kind, monkeypatch):
    """The graph step's code with the eager stand-in for the graph and the reference backend
    under test, against the oracle: its inputs land in the captured tensors, its results come
    in order (warm-up, then each replay), and a replay that sees stale inputs is caught. With a
    receive budget (on a static-shape or an eager Buffer): its fields come back from every
    replay, some replays over the budget and some not."""
    budget = {"budget": "static", "eager_budget": "eager"}.get(kind)
    cfg = _graph_cfg(fp8_input=kind == "fp8", fixed=kind == "rows_per_expert", budget=budget)
    labels = fz.result_labels(cfg)
    assert labels[len(cfg["steps"])] == "graph warm-up" and labels[-1] == f"graph replay {len(cfg['graph']['replays']) - 1}"
    got, want = fz.execute_case(cfg, "cpu", 60.0)
    assert len(got) == len(want) == len(labels)
    assert fz.compare_case(got, want, labels=labels, budgets=fz.result_budgets(cfg)) == []
    last = got[-1][1]
    M = (cfg["graph"]["recv_budget"] or [None] * cfg["world_size"])[1]
    assert set(last) == ({"tokens", "probs", "tokens_per_expert", "src_rank", "src_token", "y"} - (
        {"tokens"} if kind == "fp8" else set()) | ({"fp8_bytes", "scale_bytes"} if kind == "fp8" else set())
        | (set() if M is None else {"over_budget", "rows_received", "num_rows_device"}))
    assert last["src_rank"].shape[0] == (cfg["max_recv_tokens"] if M is None else M)
    if budget:
        flags = {bool(res[r]["over_budget"]) for res in got[len(cfg["steps"]):] for r in range(cfg["world_size"])
                 if "over_budget" in res[r]}
        assert flags == {True, False}, flags
    if last["y"].numel():
        _flip_low_bit(last["y"], (0, 0))
        problems = fz.compare_case(got, want, labels=labels)
        assert problems and problems[0].startswith(f"{labels[-1]} rank 1 y:"), problems

    loads, real_load = [], fz._load

    def stale_load(static, data):          # only each rank's first input reaches its graph
        if id(static) not in loads:
            real_load(static, data)
        loads.append(id(static))

    monkeypatch.setattr(fz, "_load", stale_load)
    got, want = fz.execute_case(cfg, "cpu", 60.0)
    problems = fz.compare_case(got, want, labels=labels)
    assert len(loads) == cfg["world_size"] * len(cfg["graph"]["replays"])
    assert problems and all(p.startswith("graph replay") for p in problems), problems[:3]


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


def _small_budget_case() -> dict:
    """:func:`_small_case` with a receive budget: rank 0 a row of experts short of its rows (a
    drop), rank 1 room past its rows (zero rows after them)."""
    cfg = _small_case()
    st = cfg["steps"][0]
    R = fz._rows_of(cfg, st)
    assert R[0] >= 8, R
    st["recv_budget"] = [R[0] - 4, R[1] + 4]
    return cfg


def _copy(got):
    return [[{k: v.clone() for k, v in r.items()} for r in step] for step in got]


def test_a_budget_case_passes_and_its_invariants_need_no_expectation():
    """A budget step (with a backward and a cached dispatch along its handle) matches the
    oracle; then each budget invariant, broken in a result and in a copy of it taken as the
    expectation (so the bitwise comparison sees nothing), is still reported: the flag, the
    rows received, num_rows_device, the clamped counts, a row past the kept ones, a field
    missing."""
    cfg = _small_budget_case()
    budgets = fz.result_budgets(cfg)
    got, want = fz.execute_case(cfg, "cpu", 60.0)
    assert fz.compare_case(got, want, budgets=budgets) == []
    r0, r1 = got[0]
    assert bool(r0["over_budget"]) and not bool(r1["over_budget"])
    R0, M0 = budgets[0][0]["R"], budgets[0][0]["M"]
    assert int(r0["rows_received"]) == R0 and int(r0["num_rows_device"]) == M0 == r0["src_rank"].shape[0]
    for field in ("grad_x", "grad_w", "grad_eo", "cached_tokens", "grad_cached_x"):
        assert field in r0, field

    def broken(rank, change):
        g = _copy(got)
        change(g[0][rank])
        return fz.compare_case(g, _copy(g), budgets=budgets)

    def bump(field):
        def change(r):
            r[field] += 1
        return change

    def flip(r):
        r["over_budget"] = ~r["over_budget"]

    def past_kept(r):
        r["src_rank"][-1] = 0

    def drop_flag(r):
        del r["over_budget"]

    for rank, change, needle in [(0, flip, "step 0 rank 0 over_budget (budget invariant"),
                                 (1, flip, "step 0 rank 1 over_budget (budget invariant"),
                                 (0, bump("rows_received"), "rows_received (budget invariant"),
                                 (1, bump("num_rows_device"), "num_rows_device (budget invariant"),
                                 (0, bump("tokens_per_expert"), "tokens_per_expert (budget invariant"),
                                 (1, past_kept, "a row past the"),
                                 (0, drop_flag, "over_budget: missing from a dispatch with recv_budget")]:
        problems = broken(rank, change)
        assert problems and all(f"rank {rank}" in p for p in problems), problems
        assert any(needle in p for p in problems), (needle, problems)
    # checked on the reference too when it is the expectation of a GPU run
    g = _copy(got)
    flip(g[0][0])
    assert any(p.startswith("reference step 0 rank 0 over_budget")
               for p in fz.compare_case(_copy(got), g, want_is_backend=True, budgets=budgets))


def test_a_broken_reference_budget_is_reported(monkeypatch):
    """The reference backend with a broken budget (counts not clamped to the rows kept) fails
    the fuzzer's case: a check that cannot fail would pass every fuzz run."""
    from megatron_mok.backends import reference

    cfg = _small_budget_case()
    monkeypatch.setattr(reference, "budget_counts", lambda tpe, budget: tpe)
    got, want = fz.execute_case(cfg, "cpu", 60.0)
    problems = fz.compare_case(got, want, budgets=fz.result_budgets(cfg))
    assert any(p.startswith("step 0 rank 0 tokens_per_expert:") for p in problems), problems
    assert any("tokens_per_expert (budget invariant" in p for p in problems), problems
    assert not any("rank 1" in p for p in problems), problems     # rank 1 kept every row


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

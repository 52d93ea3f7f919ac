"""CPU checks of scripts/profile_host_calls.py's timing helpers (fake calls and syncs)."""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import profile_host_calls as phc  # noqa: E402


def test_host_time_stops_at_the_return_and_latency_at_the_sync():
    # A call that takes 2 ms on the host and leaves 6 ms of "device work" for the sync.
    syncs = []

    def fn():
        time.sleep(0.002)

    def sync():
        syncs.append(1)
        time.sleep(0.006)

    host, lat = phc.host_and_latency(fn, 3, sync)
    assert len(host) == len(lat) == 3 and len(syncs) == 6      # one sync before, one after
    assert all(0.0018 < h < 0.0055 for h in host)
    assert all(l - h >= 0.0055 for h, l in zip(host, lat))


def test_loop_time_syncs_once_before_and_once_after():
    syncs, calls = [], []
    per_call = phc.loop_time(lambda: (calls.append(1), time.sleep(0.001)), 10,
                             lambda: (syncs.append(1), time.sleep(0.01)))
    assert len(calls) == 10 and len(syncs) == 2
    assert 0.001 < per_call < 0.0035    # (10 x 1 ms + one 10 ms sync) / 10


def test_median_in_microseconds():
    assert phc.median_us([3e-6, 1e-6, 2e-6]) == 2.0
    assert phc.median_us([1.5e-6, 2.5e-6]) == 2.0


def test_process_probes_time_each_fixed_workload():
    import torch

    class FakeLib:
        calls = {"abi": 0, "sms": 0}

        def mok_abi_version(self):
            self.calls["abi"] += 1
            return 8

        def mok_sm_count(self, dev):
            self.calls["sms"] += 1
            return 132

    lib = FakeLib()
    probes = phc.process_probes(torch, torch.device("cpu"), lib, n=10)
    assert set(probes) == {"python_loop100", "ctypes_return", "ctypes_cuda_attribute", "torch_empty"}
    assert all(v > 0 for v in probes.values())
    assert lib.calls == {"abi": 90, "sms": 90}     # 9 runs of n calls each


def test_alternating_blocks_rotate_the_order_and_pair_by_block():
    order = []

    def make(name, cost):
        def fn():
            order.append(name)
            time.sleep(cost)
        return fn

    variants = {"a": make("a", 0.001), "b": make("b", 0.003)}
    calls, per_block = phc.alternating_blocks(variants, 4, 2, lambda: None)
    assert [order[i] for i in range(0, 16, 2)] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(calls["a"]["host"]) == len(calls["b"]["latency"]) == 8
    assert len(per_block["a"]) == len(per_block["b"]) == 4
    change = phc.paired_change_us(per_block, "b", "a")      # a is ~2 ms faster than b
    assert -2600 < change < -1500


def test_paired_change_takes_out_a_drift_both_variants_saw():
    # Block medians drift from 10 to 40 us; the new variant is always 3 us faster.
    base = [10e-6, 20e-6, 40e-6, 30e-6]
    new = [b - 3e-6 for b in base]
    assert phc.paired_change_us({"base": base, "new": new}, "base", "new") == -3.0


def test_ab_variants_default_pairs_and_settings():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import common

    default = phc.ab_variants("", common.parse_settings, common.settings_label)
    assert [v[0] for v in default] == ["eager_one_call", "eager_separate", "static_one_call", "static_separate"]
    assert [v[3] for v in default] == [False, True, False, True]
    got = phc.ab_variants(";MOK_EAGER_FILL_FIRST=1", common.parse_settings, common.settings_label)
    assert got == [("eager[defaults]", "eager", {}, False),
                   ("eager[MOK_EAGER_FILL_FIRST=1]", "eager", {"MOK_EAGER_FILL_FIRST": "1"}, False)]


def test_with_env_restores_set_and_unset_variables(monkeypatch):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import common

    monkeypatch.setenv("MOK_A", "old")
    monkeypatch.delenv("MOK_B", raising=False)
    with common.with_env({"MOK_A": "new", "MOK_B": "1"}):
        assert os.environ["MOK_A"] == "new" and os.environ["MOK_B"] == "1"
    assert os.environ["MOK_A"] == "old" and "MOK_B" not in os.environ


def test_merge_ranks_takes_the_slowest_rank_and_keeps_all():
    a = {"tokens": 128, "rows": 1000, "host_x_us": 10.0, "paired_change_y_vs_x_us": -3.0}
    b = {"tokens": 128, "rows": 1010, "host_x_us": 12.5, "paired_change_y_vs_x_us": -5.0}
    m = phc.merge_ranks([a, b])
    assert m["host_x_us"] == 12.5 and m["paired_change_y_vs_x_us"] == -3.0
    assert m["tokens"] == 128 and m["rows"] == 1000 and m["per_rank"] == [a, b]

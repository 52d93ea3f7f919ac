"""``mok`` through NVIDIA Megatron-Bridge (0.3.1, on megatron-core 0.16.1: CPU, gloo).

Bridge's model providers are ``TransformerConfig`` subclasses that build Megatron's own
``MoELayer``, so ``install()`` is all a Bridge user needs (docs/MEGATRON.md, "NeMo /
Megatron-Bridge"). What is checked here:

- Bridge's ``Qwen3MoEModelProvider`` (shrunk; CPU settings) built with ``mok`` has a
  ``MokTokenDispatcher`` in every MoE layer, and one forward + backward at world size 2 with
  EP 2 (and at world size 1) gives a loss and every gradient bitwise equal to the same build
  with ``alltoall``, same seed and batch.
- Without ``install()`` the same ``mok`` build fails with Megatron's "Unsupported token
  dispatcher type" (so the tests above exercise our registration), and a ``mok`` config that
  the project's checks reject fails inside Bridge's validation with ``MokConfigError`` only
  when installed.
- The OLMoE recipe's config with ``mok`` passes Bridge's ``runtime_config_update`` and keeps
  ``mok``; the Qwen3-MoE recipe's ``apply_flex_dispatcher_backend`` turns a ``mok`` set before
  it into ``flex`` on a Hopper GPU, while ``mok`` set after the recipe returns, or given as a
  command-line override, sticks (``torch.cuda.get_device_properties`` answered as a Hopper
  / Volta GPU in that process: Bridge reads nothing else of the GPU there).
- Bridge's ``CommOverlapConfig(overlap_moe_expert_parallel_comm=True)`` with ``mok`` (EP 2,
  bf16) passes after ``install()`` (item 5 of ``megatron_mok/megatron/_patch.py``), whether
  Bridge was imported after ``install()`` or before it, and the model config ends with the
  overlap on; without ``install()`` Bridge raises its alltoall/flex assertion.

Bridge does not import on a CPU machine as it is (TransformerEngine, Triton, VLM and Hugging
Face ``datasets`` imports): ``bridge_workers.py`` has the shims, with why each exists. They
run only in processes started for one call (``run_distributed(..., fresh=True)``), never in
this pytest process (the last test checks that).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import pytest
import torch

from harness import run_distributed

import bridge_workers as BW


def _skip_reason():
    try:
        if importlib.util.find_spec("megatron.bridge") is None:
            raise ImportError
        bridge = importlib.metadata.version("megatron-bridge")
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return ("needs Megatron-Bridge 0.3.x (megatron.bridge): scripts/setup.sh installs it "
                "when megatron-core is 0.16.x, unless MOK_SETUP_BRIDGE=0")
    try:
        core = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "needs megatron-core 0.16.x"
    if not core.startswith("0.16."):
        return (f"megatron-core {core} is outside Megatron-Bridge 0.3.1's range (0.16.x); these "
                f"tests and their CPU shims are for that pair")
    if not bridge.startswith("0.3."):
        return f"Megatron-Bridge {bridge}: these tests and their CPU shims are for 0.3.x"
    return None


_SKIP = _skip_reason()
pytestmark = [pytest.mark.megatron, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

# Modules the shims put into a rank's sys.modules; none may reach this process.
_SHIMMED = [name for name, _ in BW._TE_OR_TRITON_MODULES] + ["megatron.bridge.recipes",
                                                                 "datasets"]


@pytest.fixture(scope="module")
def world2():
    """Rank reports of the Qwen3-MoE step at world size 2, EP 2: ``mok``, then ``alltoall``."""
    return run_distributed(BW.qwen3_moe_mok_and_alltoall, 2, 2, fresh=True)


@pytest.fixture(scope="module")
def world1():
    """World size 1: nothing installed first, then ``install()`` (``without_then_with_install``)."""
    return run_distributed(BW.without_then_with_install, 1, fresh=True)[0]


@pytest.fixture(scope="module")
def configs():
    """Bridge's config path with ``install()`` called before Bridge is imported."""
    return run_distributed(BW.bridge_configs_installed, 1, fresh=True)[0]


def _assert_steps_bitwise(steps, ep_size, rank):
    mok, ref = steps["mok"], steps["alltoall"]
    assert mok["dispatchers"] == ["MokTokenDispatcher"] * 2, mok["dispatchers"]
    assert ref["dispatchers"] == ["MoEAlltoAllTokenDispatcher"] * 2, ref["dispatchers"]
    for run in (mok, ref):
        assert run["ep_group_size"] == ep_size
        assert run["local_experts"] == [8 // ep_size] * 2
        assert len(run["grads"]) == run["params"], "every parameter gets a gradient"
    expert = [n for n in ref["grads"] if ".experts." in n]
    assert expert and all(ref["grads"][n].abs().sum() > 0 for n in expert), \
        "every local expert got tokens (else the A/B would not cover them)"
    assert torch.isfinite(mok["loss"])
    assert torch.equal(mok["loss"], ref["loss"]), \
        f"rank {rank}: loss mok {mok['loss'].item()!r} != alltoall {ref['loss'].item()!r}"
    assert sorted(mok["grads"]) == sorted(ref["grads"])
    differ = [n for n in ref["grads"] if not torch.equal(mok["grads"][n], ref["grads"][n])]
    assert not differ, f"rank {rank}: gradients not bitwise alltoall's: {differ}"


# ------------------------------------------------------------------------- a. the model
def test_qwen3_moe_provider_mok_world2_ep2_bitwise_alltoall(world2):
    assert len(world2) == 2
    for rank, steps in enumerate(world2):
        _assert_steps_bitwise(steps, 2, rank)
    # the ranks saw different batches: the EP exchange carried real traffic both ways
    assert not torch.equal(world2[0]["mok"]["loss"], world2[1]["mok"]["loss"])


def test_qwen3_moe_provider_mok_world1_bitwise_alltoall(world1):
    steps = world1["after"]["steps"]
    assert steps["ok"], steps
    _assert_steps_bitwise(steps["value"], 1, 0)


# ----------------------------------------------------------------- b. without install()
def test_mok_build_fails_without_install(world1):
    before = world1["before"]
    assert before["installed"] is False
    build = before["build_mok"]
    assert not build["ok"], "the mok model built without install()"
    assert build["error_type"] == "ValueError"
    assert "Unsupported token dispatcher type: mok" in build["error"], build["error"]


def test_mok_checks_run_inside_bridge_validation(world1, configs):
    # installed: the project's config check runs inside Bridge's cfg.validate()
    res = configs["olmoe_mok_deepep"]
    assert not res["ok"] and res["error_type"] == "MokConfigError", res
    assert "moe_enable_deepep" in res["error"]
    # not installed: only Megatron's own check
    res = world1["before"]["olmoe_mok_deepep"]
    assert not res["ok"] and res["error_type"] == "ValueError", res


# -------------------------------------------------------------- c. recipes and configs
def test_olmoe_recipe_mok_passes_runtime_config_update(configs):
    assert configs["installed"] is True
    res = configs["olmoe_mok"]
    assert res["ok"], res
    assert res["value"]["dispatcher"] == "mok"
    assert res["value"]["overlap_moe_expert_parallel_comm"] is False


def test_recipe_flex_backend_overwrites_mok_set_before_it(configs):
    """Bridge's Qwen3-MoE recipes end with ``apply_flex_dispatcher_backend(cfg.model,
    "deepep")``: on a Hopper GPU it sets ``flex`` (and turns ``moe_shared_expert_overlap``
    off), overwriting whatever dispatcher was set before the call; on an older GPU it leaves
    the recipe's ``alltoall``. ``mok`` set after the recipe returns is what sticks."""
    res = configs["recipe_order"]
    assert res["ok"], res
    order = res["value"]
    assert order["hopper_recipe"] == ("flex", "deepep")
    assert order["volta_recipe"] == ("alltoall", "deepep")
    assert order["mok_then_apply"] == ("flex", False)
    after = order["mok_after_recipe"]
    assert after["ok"] and after["value"]["dispatcher"] == "mok", after


def test_recipe_cli_override_mok_sticks(configs):
    """``run_recipe.py ... model.moe_token_dispatcher_type=mok``: Bridge applies the override
    to the config the recipe returned (after ``apply_flex_dispatcher_backend``)."""
    res = configs["recipe_order"]
    assert res["ok"], res
    cli = res["value"]["mok_cli_override"]
    assert cli["ok"] and cli["value"]["dispatcher"] == "mok", cli


# ------------------------------------------------------- d. Bridge's 1F1B EP overlap check
def test_comm_overlap_ep_overlap_with_mok_after_install(configs):
    """``install()`` before Bridge is imported (the docs' order): Bridge validates the mok
    config as alltoall's; its other checks of the overlap (EP > 1, bf16) still ran."""
    assert configs["comm_overlap_patched"] is True
    for key in ("olmoe_mok_ep_overlap", "olmoe_alltoall_ep_overlap"):
        res = configs[key]
        assert res["ok"], (key, res)
        assert res["value"]["overlap_moe_expert_parallel_comm"] is True, (key, res)
        assert res["value"]["bf16"] is True
    assert configs["olmoe_mok_ep_overlap"]["value"]["dispatcher"] == "mok"


def test_comm_overlap_ep_overlap_with_mok_asserts_without_install(world1):
    """Control: without ``install()`` Bridge 0.3.1 raises its own assertion; ``install()``
    after Bridge's module was imported patches it in place, and the same config passes."""
    before, after = world1["before"], world1["after"]
    assert before["comm_overlap_patched"] is False
    res = before["olmoe_mok_ep_overlap"]
    assert not res["ok"] and res["error_type"] == "AssertionError", res
    assert "only supported when moe_token_dispatcher_type == 'alltoall' or 'flex'" in res["error"]
    assert after["installed"] and after["comm_overlap_patched"] is True
    res = after["olmoe_mok_ep_overlap"]
    assert res["ok"], res
    assert res["value"]["dispatcher"] == "mok"
    assert res["value"]["overlap_moe_expert_parallel_comm"] is True


# ------------------------------------------------------------------------ isolation
def test_shims_stay_out_of_the_pytest_process(world1, configs):
    """The CPU shims (placeholder modules, recipes package without its __init__, stand-in
    ``datasets``) lived only in the ranks' processes, which have ended."""
    def _shim(name):
        mod = sys.modules.get(name)
        if mod is None:
            return False
        if name == "megatron.bridge.recipes":
            return True                         # Bridge itself must not be imported here
        if name == "datasets":
            return getattr(getattr(mod, "__spec__", None), "origin", "") is None
        return "placeholder" in str(getattr(mod, "__file__", ""))

    leaked = [n for n in _SHIMMED if _shim(n)]
    assert not leaked, leaked
    assert "megatron.bridge" not in sys.modules, "Bridge was imported into the pytest process"

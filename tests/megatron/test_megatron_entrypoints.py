"""The ways in, against real Megatron code: the launcher (``python -m megatron_mok.launch``)
and the Megatron-LM release patches (``patches/``).

Each check runs in a fresh interpreter (the launcher and a patched tree must not meet an
already-patched megatron-core). Argument parsing needs ``megatron.training`` (Megatron-LM):
the megatron-core 0.19 wheel ships it; for 0.16 point ``$MEGATRON_LM_PATH`` at a checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import megatron_lm_path

pytestmark = pytest.mark.megatron

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Builds an MoELayer for the config's dispatcher on one gloo rank and reports what it holds.
LAYER_PROBE = textwrap.dedent("""
    import json, os, socket, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron_mok.megatron import harness
    harness.init_parallel(1)
    import megatron.core
    cfg = harness.moe_config("mok", ep_size=1, num_experts=4, topk=2, hidden=16,
                             moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    layer = harness.build_moe_layer(cfg)
    x = torch.randn(6, 2, 16, requires_grad=True)
    y, _ = layer(x)
    y.sum().backward()

    def config_outcome(**kw):
        try:
            cfg = harness.moe_config("mok", num_experts=4, topk=2, hidden=16, **kw)
            return ["ok", cfg.moe_token_dispatcher_type]
        except (ValueError, AssertionError) as e:
            return [type(e).__name__, str(e)]
    # a MoK config check (MokConfigError); then Megatron's 1F1B EP overlap (a config only),
    # which install() lets through for mok and a patched tree without install() refuses
    config_error = config_outcome(ep_size=1, moe_enable_deepep=True)
    ep_overlap = config_outcome(ep_size=2, dtype=torch.bfloat16,
                                overlap_moe_expert_parallel_comm=True)
    # the 1F1B EP overlap's free rule (where install() looks for it) for a mok config: which
    # schedule nodes may free their input after forward
    import importlib, inspect
    from megatron_mok.megatron._patch import _FREE_INPUT_MODULES
    free_input = None
    for name in _FREE_INPUT_MODULES:
        try:
            rule = getattr(importlib.import_module(name), "should_free_input", None)
        except ImportError:
            continue
        if rule is not None:
            mok_cfg = harness.moe_config("mok", ep_size=1, num_experts=4, topk=2, hidden=16)
            extra = (4,) * (len(inspect.signature(rule).parameters) - 3)   # 0.19: num_local_experts
            free_input = {n: rule(n, True, mok_cfg, *extra)
                          for n in ("moe_dispatch", "mlp", "moe_combine")}
            break
    # Megatron allows the shared-expert overlap for its own dispatchers only; mok is let in
    # (a config only: the overlapped SharedExpertMLP needs a CUDA stream)
    overlap_cfg = harness.moe_config("mok", ep_size=1, num_experts=4, topk=2, hidden=16,
                                     moe_shared_expert_intermediate_size=16,
                                     moe_shared_expert_overlap=True)
    out = {"dispatcher": type(layer.token_dispatcher).__name__,
           "overlap_config": [overlap_cfg.moe_token_dispatcher_type,
                              overlap_cfg.moe_shared_expert_overlap],
           "name": __name__, "argv": sys.argv, "path0": sys.path[0],
           "megatron_core": os.path.dirname(megatron.core.__file__),
           "y_shape": list(y.shape), "x_grad_finite": bool(torch.isfinite(x.grad).all()),
           "config_error": config_error, "ep_overlap": ep_overlap, "free_input": free_input}
    harness.destroy_parallel()
    dist.destroy_process_group()
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump(out, f)
""")

# Megatron-LM's own argument parser on a MoE command line with --moe-token-dispatcher-type mok.
ARGS_PROBE = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    from megatron.training.arguments import parse_args
    args = parse_args()
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({"dispatcher": args.moe_token_dispatcher_type,
                   "num_experts": args.num_experts}, f)
""")

MOE_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128",
            "--micro-batch-size", "1", "--num-experts", "8", "--moe-router-topk", "2",
            "--expert-model-parallel-size", "1", "--moe-token-dispatcher-type", "mok"]


def _run(cmd, tmp_path, pythonpath, timeout=150):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(pythonpath + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PROBE_OUT"] = str(tmp_path / "probe.json")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("MOK_BACKEND", None)
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    out = None
    if os.path.exists(env["PROBE_OUT"]):
        with open(env["PROBE_OUT"]) as f:
            out = json.load(f)
        os.remove(env["PROBE_OUT"])
    return p, out


def _skip_if_missing_third_party(p):
    tail = p.stderr[-3000:]
    if "ModuleNotFoundError" in tail and "No module named 'megatron" not in tail:
        line = [ln for ln in tail.splitlines() if "ModuleNotFoundError" in ln][-1]
        pytest.skip(f"megatron.training needs a package this env lacks: {line.strip()}")


def test_launcher_runs_script_unchanged_and_builds_mok(tmp_path):
    script_dir = tmp_path / "scripts"
    script_dir.mkdir()
    script = script_dir / "train_probe.py"
    script.write_text(LAYER_PROBE)
    p, out = _run([sys.executable, "-m", "megatron_mok.launch", str(script), "--foo", "1"],
                  tmp_path, [REPO])
    assert p.returncode == 0, p.stderr[-4000:]
    assert out["dispatcher"] == "MokTokenDispatcher"
    assert out["overlap_config"] == ["mok", True]
    assert out["name"] == "__main__"
    assert out["argv"] == [str(script), "--foo", "1"]
    assert out["path0"] == str(script_dir)
    assert out["y_shape"] == [6, 2, 16] and out["x_grad_finite"]
    assert out["config_error"][0] == "MokConfigError" and "moe_enable_deepep" in out["config_error"][1]
    assert out["ep_overlap"] == ["ok", "mok"]
    # install() keeps the dispatch and experts nodes' inputs for mok (the combine's may go)
    assert out["free_input"] == {"moe_dispatch": False, "mlp": False, "moe_combine": True}
    assert "installed the 'mok' token dispatcher" in p.stderr

    # the same script without the launcher: 'mok' is not a dispatcher Megatron knows
    p2, out2 = _run([sys.executable, str(script)], tmp_path, [REPO])
    assert p2.returncode != 0 and out2 is None
    assert "mok" in p2.stderr


def test_launcher_usage_errors(tmp_path):
    p, _ = _run([sys.executable, "-m", "megatron_mok.launch"], tmp_path, [REPO], timeout=60)
    assert p.returncode == 2 and "usage" in p.stderr
    p, _ = _run([sys.executable, "-m", "megatron_mok.launch", "no_such.py"], tmp_path, [REPO],
                timeout=60)
    assert p.returncode == 2 and "no such script" in p.stderr


@pytest.mark.megatron_training
def test_launcher_megatron_lm_argument_parsing(tmp_path):
    """Megatron-LM's ``parse_args`` accepts ``--moe-token-dispatcher-type mok`` through the
    launcher, and rejects it without (so the test can fail)."""
    script = tmp_path / "args_probe.py"
    script.write_text(ARGS_PROBE)
    path = [REPO] + ([megatron_lm_path()] if megatron_lm_path() else [])
    p, out = _run([sys.executable, "-m", "megatron_mok.launch", str(script)] + MOE_ARGS,
                  tmp_path, path)
    _skip_if_missing_third_party(p)
    assert p.returncode == 0, p.stderr[-4000:]
    assert out == {"dispatcher": "mok", "num_experts": 8}
    p2, out2 = _run([sys.executable, str(script)] + MOE_ARGS, tmp_path, path)
    assert p2.returncode != 0 and out2 is None
    assert "invalid choice: 'mok'" in p2.stderr


def _patched_copy(tmp_path):
    """A copy of the megatron package (Megatron-LM checkout if named, else the installed
    megatron-core) with the matching release patch applied by ``patch -p1``."""
    import megatron.core

    from megatron_mok.megatron.versions import parse_version

    src = os.path.join(megatron_lm_path(), "megatron") if megatron_lm_path() else \
        os.path.dirname(os.path.dirname(megatron.core.__file__))
    major, minor, _ = parse_version(megatron.core.package_info.__version__)
    name = f"core_r0.{minor}.0" if 16 <= minor <= 19 else None
    if major != 0 or name is None:
        pytest.skip(f"no patch for megatron-core {megatron.core.package_info.__version__}")
    root = tmp_path / "tree"
    shutil.copytree(src, root / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    patch = os.path.join(REPO, "patches", f"megatron-lm-{name}.patch")
    tool = shutil.which("patch")
    cmd = [tool, "-p1", "-i", patch] if tool else ["git", "apply", "-p1", patch]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return root


def test_patch_builds_mok_without_install(tmp_path):
    root = _patched_copy(tmp_path)
    script = tmp_path / "probe.py"
    script.write_text(LAYER_PROBE)
    p, out = _run([sys.executable, str(script)], tmp_path, [str(root), REPO])
    assert p.returncode == 0, p.stderr[-4000:]
    assert out["megatron_core"].startswith(str(root)), out["megatron_core"]
    assert out["dispatcher"] == "MokTokenDispatcher"
    assert out["overlap_config"] == ["mok", True]
    assert out["config_error"][0] == "MokConfigError" and "moe_enable_deepep" in out["config_error"][1]
    # the patches carry the 1F1B EP overlap too: the config is accepted as mok, and the
    # patched free rule keeps the dispatch and experts nodes' inputs for mok
    assert out["ep_overlap"] == ["ok", "mok"]
    assert out["free_input"] == {"moe_dispatch": False, "mlp": False, "moe_combine": True}
    # the package is never installed in that process
    assert "installed the 'mok'" not in p.stderr


def test_patch_builds_mok_argparse(tmp_path):
    root = _patched_copy(tmp_path)
    if not (root / "megatron" / "training").is_dir():
        pytest.skip("megatron.training not in this megatron tree (0.16 wheel): set "
                    "MEGATRON_LM_PATH to a Megatron-LM checkout")
    script = tmp_path / "args_probe.py"
    script.write_text(ARGS_PROBE)
    p, out = _run([sys.executable, str(script)] + MOE_ARGS, tmp_path, [str(root), REPO])
    _skip_if_missing_third_party(p)
    assert p.returncode == 0, p.stderr[-4000:]
    assert out == {"dispatcher": "mok", "num_experts": 8}


def test_a_patch_for_every_supported_release():
    # make_patches.py's releases, the patch files and versions.py's supported range agree
    import importlib.util

    from megatron_mok.megatron import versions

    spec = importlib.util.spec_from_file_location("mok_make_patches",
                                                  os.path.join(REPO, "patches", "make_patches.py"))
    make_patches = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_patches)
    lo, hi = versions.MIN_SUPPORTED[1], versions.MAX_SUPPORTED[1]
    want = {f"core_r0.{m}.0" for m in range(lo, hi + 1)}
    assert set(make_patches.RELEASES) == want
    files = {f[len("megatron-lm-"):-len(".patch")]
             for f in os.listdir(os.path.join(REPO, "patches")) if f.endswith(".patch")}
    assert files == want
    for name in sorted(want):
        text = open(os.path.join(REPO, "patches", f"megatron-lm-{name}.patch")).read()
        # the four changes of install(), in source form (patches/make_patches.py)
        for needle in ("'flex', 'mok']", "check_config(self)",
                       'moe_token_dispatcher_type == "mok"', "should_free_input"):
            assert needle in text, (name, needle)


def test_launcher_banner_comes_from_rank_zero_only(monkeypatch):
    """The launcher's one line on stderr is printed by rank 0 (RANK, else LOCAL_RANK, else a
    single process), not once per rank of a torchrun job."""
    from megatron_mok import launch
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launch._is_rank0()
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert not launch._is_rank0()
    monkeypatch.setenv("RANK", "0")          # RANK wins over LOCAL_RANK
    assert launch._is_rank0()
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not launch._is_rank0()

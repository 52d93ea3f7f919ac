"""One-command A/B: the same GPT MoE model and data with each available dispatcher.

    python examples/ab_dispatchers.py --nproc-per-node 2 --out out/ab -- --train-iters 60 --bf16

Runs ``examples/train_gpt_moe.py`` under ``torchrun`` once per dispatcher (``alltoall``,
``mok``, and ``flex`` when ``deep_ep`` imports), then prints a table (time per step,
tokens/s/GPU, final loss, largest per-step loss difference against ``alltoall``) and writes
``ab_summary.json`` next to the per-dispatcher JSONs. Arguments after ``--`` go to every
training run unchanged.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def available_dispatchers(requested):
    out = []
    for d in requested:
        if d == "flex" and importlib.util.find_spec("deep_ep") is None:
            print("[ab] skipping flex: deep_ep is not importable", flush=True)
            continue
        out.append(d)
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--dispatchers", default="alltoall,mok,flex")
    p.add_argument("--out", default=os.path.join(REPO, "out", "ab"))
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ)
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)

    results, failures = {}, {}
    for d in available_dispatchers(args.dispatchers.split(",")):
        out_json = os.path.join(args.out, f"train_{d}.json")
        if os.path.exists(out_json):
            os.remove(out_json)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc_per_node}", os.path.join(HERE, "train_gpt_moe.py"),
               "--moe-token-dispatcher-type", d, "--output-json", out_json] + train_args
        print("[ab] " + " ".join(cmd), flush=True)
        log = os.path.join(args.out, f"train_{d}.log")
        with open(log, "w") as f:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        if rc != 0 or not os.path.exists(out_json):
            failures[d] = f"exit code {rc}; see {log}"
            print(f"[ab] {d} FAILED ({failures[d]})", flush=True)
            continue
        with open(out_json) as f:
            results[d] = json.load(f)

    base = results.get("alltoall")
    rows = []
    for d, r in results.items():
        diff = None
        if base is not None and d != "alltoall":
            diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        rows.append({"dispatcher": d, "mok_backend": r.get("mok_backend"),
                     "schedule": r.get("schedule"),
                     "median_step_ms": r["median_step_time_s"] * 1e3,
                     "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                     "final_loss": r["final_loss"], "first_loss": r["losses"][0],
                     "max_abs_loss_diff_vs_alltoall": diff, "steps": len(r["losses"])})
    hdr = f"{'dispatcher':<10} {'ms/step':>9} {'tokens/s/GPU':>13} {'first loss':>11} " \
          f"{'final loss':>11} {'max |dloss| vs a2a':>19}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        diff = "-" if r["max_abs_loss_diff_vs_alltoall"] is None else \
            f"{r['max_abs_loss_diff_vs_alltoall']:.5f}"
        print(f"{r['dispatcher']:<10} {r['median_step_ms']:9.1f} {r['tokens_per_s_per_gpu']:13.0f} "
              f"{r['first_loss']:11.5f} {r['final_loss']:11.5f} {diff:>19}")
    summary = {"rows": rows, "failures": failures, "train_args": train_args,
               "nproc_per_node": args.nproc_per_node, "command": " ".join([sys.executable] + sys.argv)}
    with open(os.path.join(args.out, "ab_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

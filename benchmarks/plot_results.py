#!/usr/bin/env python3
"""Turn a ``bench_dispatch_combine`` results JSON into a markdown table and a PNG plot.

    python benchmarks/plot_results.py benchmarks/results/bench_dispatch_combine.json [--out DIR]

The benchmark calls :func:`render` itself at the end of a run. Without matplotlib the PNG
is skipped (with a note in the markdown); the table never needs it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import OrderedDict
from typing import Dict, List, Optional

OPS = ("dispatch", "dispatch_cached", "combine", "dispatch_bwd", "combine_bwd")
OP_LABEL = {"dispatch": "dispatch", "dispatch_cached": "dispatch (cached)", "combine": "combine",
            "dispatch_bwd": "dispatch bwd", "combine_bwd": "combine bwd"}
SYSTEM_ORDER = ("mok", "mok_fp8", "deepep", "alltoall", "symm_a2a")
SYSTEM_LABEL = {"mok": "MoK", "mok_fp8": "MoK FP8 dispatch", "deepep": "DeepEP",
                "alltoall": "NCCL a2a (Megatron alltoall)", "symm_a2a": "torch symm-mem a2a"}
COLORS = {"mok": "#d62728", "mok_fp8": "#ff9896", "deepep": "#1f77b4", "alltoall": "#7f7f7f",
          "symm_a2a": "#2ca02c"}


def _us(v) -> str:
    if v is None:
        return "—"
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.1f}"


def _t(rec, op) -> Optional[float]:
    t = rec.get("ops", {}).get(op)
    return t.get("median_us") if isinstance(t, dict) else None


def _cell(rec, op) -> str:
    t = rec.get("ops", {}).get(op)
    if not isinstance(t, dict):
        return "—"
    if "median_us" in t:
        return _us(t["median_us"])
    return "n/a"


def _checks_by(doc) -> Dict:
    out: Dict = {}
    for c in doc.get("checks", []):
        key = (c["shape"], c["system"].split(" ")[0])
        p, f = out.get(key, (0, 0))
        out[key] = (p + (1 if c["passed"] else 0), f + (0 if c["passed"] else 1))
    return out


def _sorted_results(doc) -> List[Dict]:
    shapes = [s["name"] for s in doc.get("shapes", [])]
    order = {n: i for i, n in enumerate(shapes)}

    def key(r):
        sys_i = SYSTEM_ORDER.index(r["system"]) if r["system"] in SYSTEM_ORDER else 99
        return (order.get(r["shape"], 999), sys_i, r.get("variant", ""))
    return sorted(doc.get("results", []), key=key)


def _sysname(r) -> str:
    name = SYSTEM_LABEL.get(r["system"], r["system"])
    if r.get("backend") and r["system"] in ("mok", "mok_fp8"):
        name += f" [{r['backend']}]"
    if r.get("num_sms") and r["system"] in ("mok", "mok_fp8", "deepep"):
        name += f" {r['num_sms']} SMs"
    elif r.get("transfer_sms") and r["system"] in ("mok", "mok_fp8"):   # the Buffer's default: per call size
        name += f" {r['transfer_sms']} SMs"
    if r.get("variant"):
        name += f" {r['variant']}"
    return name


def no_claims_label(doc) -> str:
    """What a run whose times are no claims is (its title's suffix); "" for a timed GPU run."""
    mode = doc.get("mode")
    if mode == "cpu smoke":
        return "CPU SMOKE"
    if mode == "gpu shared (dry run)":
        return "SHARED-GPU DRY RUN"
    return "" if doc.get("timing_claims", True) else "NO TIMING CLAIMS"


def markdown(doc) -> str:
    env = doc.get("env", {})
    bw = doc.get("peer_bandwidth", {})
    L = []
    label = no_claims_label(doc)
    L.append("# Dispatch / combine benchmark" + (f" — {label} (no timing claims)" if label else ""))
    L.append("")
    L.append(f"- date {env.get('date')}, commit `{env.get('commit')}`")
    L.append(f"- {env.get('world_size')} ranks, {env.get('gpu_count')} x {env.get('gpu_model')}, "
             f"torch {env.get('torch_version')} (CUDA {env.get('cuda_version')}, NCCL {env.get('nccl_version')})")
    L.append(f"- command: `{env.get('command')}`")
    cfg = doc.get("config", {})
    L.append(f"- timing: {cfg.get('timing')}; {cfg.get('iters')} timed calls after {cfg.get('warmup')} warm-up")
    if bw.get("gbps"):
        L.append(f"- peer bandwidth (floor rate): **{bw['gbps']:.1f} GB/s** per direction, {bw.get('method')}"
                 + "".join(f"; {k} {bw[k]['gbps']:.1f} GB/s" for k in ("copy_engine", "sm_kernel") if k in bw))
    else:
        L.append(f"- peer bandwidth: not measured ({bw.get('reason')})")
    n_fail = len(doc.get("checks_failed", []))
    L.append(f"- correctness checks: **{'ALL PASSED' if doc.get('checks_passed') else f'{n_fail} FAILED'}** "
             f"({len(doc.get('checks', []))} checks)" + ("" if doc.get("complete", True) else " — PARTIAL RUN"))
    L.append("")
    L.append("Times are medians on the slowest rank, in us. Floor = bytes a per-rank deduplicating "
             "dispatcher must move over the busiest rank-direction, at the measured peer bandwidth; "
             "'x floor' = time / floor. 'n/a' = the system has no such call (see JSON).")
    L.append("")
    L.append("| shape | system | dispatch | cached | combine | dispatch bwd | combine bwd | NVLink MB | "
             "floor | x floor (disp / comb) | checks |")
    L.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    checks = _checks_by(doc)
    for r in _sorted_results(doc):
        p, f = checks.get((r["shape"], r["system"]), (0, 0))
        chk = "FAILED" if (f or r.get("status") == "failed") else (f"ok ({p})" if p else "—")
        xf = r.get("x_floor", {})
        xs = " / ".join(f"{xf[o]:.2f}" if o in xf else "—" for o in ("dispatch", "combine"))
        mb = r.get("nvlink_bytes_max_rank_direction")
        err = f" ({r['error']})" if r.get("error") else ""
        L.append(f"| {r['shape']} | {_sysname(r)}{err} | {_cell(r, 'dispatch')} | {_cell(r, 'dispatch_cached')} | "
                 f"{_cell(r, 'combine')} | {_cell(r, 'dispatch_bwd')} | {_cell(r, 'combine_bwd')} | "
                 f"{mb / 1e6:.1f} | {_us(r.get('floor_us'))} | {xs} | {chk} |" if mb is not None else
                 f"| {r['shape']} | {_sysname(r)}{err} | — | — | — | — | — | — | — | — | {chk} |")
    sweep = doc.get("sm_sweep", [])
    if sweep:
        L.append("")
        L.append(f"## MoK SM sweep ({sweep[0]['shape']})")
        L.append("")
        L.append("| num_sms | dispatch | combine | x floor (disp / comb) | status |")
        L.append("| ---: | ---: | ---: | ---: | --- |")
        for r in sweep:
            xf = r.get("x_floor", {})
            xs = " / ".join(f"{xf[o]:.2f}" if o in xf else "—" for o in ("dispatch", "combine"))
            L.append(f"| {r.get('num_sms')} | {_cell(r, 'dispatch')} | {_cell(r, 'combine')} | {xs} | "
                     f"{r.get('status')}{' ' + r['error'] if r.get('error') else ''} |")
    L.append("")
    L.append("## Shapes")
    L.append("")
    L.append("| shape | case | rows/rank | NVLink MB busiest dir (dedup / per-expert copies) | floor | "
             "local HBM MB (rows written, max rank) | hot/mean |")
    L.append("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for s in doc.get("shapes", []):
        nb = s["nvlink_bytes"]
        hm = s.get("hot_load_over_mean")
        hms = f"{hm:.2f}" if hm is not None else "—"
        L.append(f"| {s['name']} | {s['desc']} | {s['rows_per_rank']} | "
                 f"{nb['dedup']['max_rank_direction'] / 1e6:.1f} / {nb['copies']['max_rank_direction'] / 1e6:.1f} | "
                 f"{_us(s.get('floor_us'))} | {s['local_hbm_bytes_max_rank'] / 1e6:.1f} | {hms} |")
    L.append("")
    L.append("## Systems")
    L.append("")
    for name, s in doc.get("systems", {}).items():
        L.append(f"- {name}: {'available' if s.get('available') else 'unavailable'}"
                 f"{'' if s.get('requested', True) else ' (not requested)'} — {s.get('reason') or ''}"
                 f"{' error: ' + s['error'] if s.get('error') else ''}")
    if doc.get("skipped"):
        L.append("")
        L.append("## Skipped")
        L.append("")
        for s in doc["skipped"]:
            L.append(f"- {s['what']}: {s['reason']}")
    if doc.get("checks_failed"):
        L.append("")
        L.append("## FAILED CHECKS")
        L.append("")
        for c in doc["checks_failed"]:
            L.append(f"- rank {c.get('rank')} {c['shape']} / {c['system']}: {c['check']} {c.get('detail', '')}")
    return "\n".join(L) + "\n"


def summary_text(doc) -> str:
    """A short fixed-width table for the end of the run's output."""
    bw = doc.get("peer_bandwidth", {})
    lines = ["=" * 100,
             "SUMMARY" + (f" ({no_claims_label(doc)}: correctness only, times are no claims)"
                          if no_claims_label(doc) else "")
             + (f" | peer BW {bw['gbps']:.0f} GB/s ({bw.get('method')})" if bw.get("gbps") else "")]
    hdr = f"{'shape':12s} {'system':26s} {'dispatch':>9s} {'cached':>9s} {'combine':>9s} {'d-bwd':>9s} {'c-bwd':>9s} {'floor':>8s} {'xF d/c':>11s} chk"
    lines.append(hdr)
    lines.append("-" * len(hdr))
    checks = _checks_by(doc)
    rows = _sorted_results(doc) + list(doc.get("sm_sweep", []))
    for r in rows:
        p, f = checks.get((r["shape"], r["system"]), (0, 0))
        if r.get("variant"):
            f = sum(1 for c in doc.get("checks", []) if c["shape"] == r["shape"]
                    and c["system"] == f"mok {r['variant']}" and not c["passed"])
        chk = "FAIL" if (f or r.get("status") == "failed") else "ok"
        xf = r.get("x_floor", {})
        xs = "/".join(f"{xf[o]:.2f}" if o in xf else "-" for o in ("dispatch", "combine"))
        name = r["system"] + (f"[{r['backend']}]" if r.get("backend") else "") + (
            f" {r['variant']}" if r.get("variant") else "")

        def c(op):
            v = _t(r, op)
            return "-" if v is None else (f"{v:.1f}" if v < 10000 else f"{v / 1000:.1f}ms")
        fl = f"{r['floor_us']:.1f}" if r.get("floor_us") else "-"
        lines.append(f"{r['shape'][:12]:12s} {name[:26]:26s} {c('dispatch'):>9s} {c('dispatch_cached'):>9s} "
                     f"{c('combine'):>9s} {c('dispatch_bwd'):>9s} {c('combine_bwd'):>9s} "
                     f"{fl:>8s} {xs:>11s} {chk}"
                     + (f"  {r['error'][:60]}" if r.get("error") else ""))
    n_fail = len(doc.get("checks_failed", []))
    lines.append("-" * len(hdr))
    lines.append(f"times in us (median, slowest rank); checks: "
                 f"{'ALL PASSED' if doc.get('checks_passed') else f'{n_fail} FAILED'} of {len(doc.get('checks', []))}; "
                 f"wall {doc.get('wall_s', 0):.0f}s; skipped: {len(doc.get('skipped', []))}")
    lines.append("=" * 100)
    return "\n".join(lines)


def plot(doc, path: str) -> Optional[str]:
    """PNG: time per system per shape (dispatch, combine), floors marked; SM sweep."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"matplotlib unavailable ({type(e).__name__})"
    res = [r for r in doc.get("results", []) if not r.get("variant")]
    shapes = [s["name"] for s in doc.get("shapes", [])]
    floors = {s["name"]: s.get("floor_us") for s in doc.get("shapes", [])}
    series: "OrderedDict[tuple, Dict[str, float]]" = OrderedDict()
    for sysname in SYSTEM_ORDER:
        for op in ("dispatch", "dispatch_cached"):
            vals = {r["shape"]: _t(r, op) for r in res if r["system"] == sysname and _t(r, op)}
            if vals:
                series[(sysname, op)] = vals
    sweep = doc.get("sm_sweep", [])
    ncols = 3 if sweep else 2
    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols, 6.5))
    for ax, ops, title in ((axes[0], ("dispatch", "dispatch_cached"), "dispatch"),
                           (axes[1], ("combine",), "combine")):
        keys = [(s, o) for s in SYSTEM_ORDER for o in ops
                if any(r["system"] == s and _t(r, o) for r in res)]
        width = 0.8 / max(1, len(keys))
        for i, (sysname, op) in enumerate(keys):
            xs, ys = [], []
            for j, sh in enumerate(shapes):
                v = next((_t(r, op) for r in res if r["system"] == sysname and r["shape"] == sh), None)
                if v:
                    xs.append(j - 0.4 + width * (i + 0.5))
                    ys.append(v)
            label = SYSTEM_LABEL.get(sysname, sysname) + (" cached" if op == "dispatch_cached" else "")
            ax.bar(xs, ys, width, label=label, color=COLORS.get(sysname, None),
                   alpha=0.55 if op == "dispatch_cached" else 0.95,
                   hatch="//" if op == "dispatch_cached" else None)
        fx = [j for j, sh in enumerate(shapes) if floors.get(sh)]
        if fx:
            ax.scatter(fx, [floors[shapes[j]] for j in fx], marker="_", s=900, color="black", zorder=5,
                       label="NVLink floor")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes)
        ax.set_yscale("log")
        ax.set_ylabel("us (median, slowest rank)")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, frameon=False)
    if sweep:
        ax = axes[2]
        for op, m in (("dispatch", "o-"), ("combine", "s-")):
            pts = [(r["num_sms"], _t(r, op)) for r in sweep if _t(r, op)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], m, label=f"MoK {op}")
        fl = floors.get(sweep[0]["shape"])
        if fl:
            ax.axhline(fl, color="black", ls="--", label="NVLink floor")
        ax.set_xlabel("num_sms")
        ax.set_ylabel("us")
        ax.set_title(f"MoK SM sweep ({sweep[0]['shape']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    env = doc.get("env", {})
    ws, ng = env.get("world_size"), env.get("gpu_count")
    where = (f"{ws} ranks on {ng} x {env.get('gpu_model')}" if doc.get("mode") == "gpu shared (dry run)"
             else f"{ws} x {env.get('gpu_model')}")
    fig.suptitle(f"dispatch/combine, {where}, "
                 f"commit {str(env.get('commit'))[:12]}, {env.get('date')}"
                 + (f" — {no_claims_label(doc)}" if no_claims_label(doc) else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def render(doc, out_dir: str, stem: str) -> Dict[str, str]:
    """Write ``<stem>.md`` and ``<stem>.png`` into ``out_dir``; return what was written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    png = os.path.join(out_dir, stem + ".png")
    try:
        why = plot(doc, png)
    except Exception as e:  # noqa: BLE001  (a plot problem must not cost the table)
        why = f"plot failed: {type(e).__name__}: {e}"
    md = markdown(doc)
    if why:
        md += f"\n(PNG not written: {why})\n"
    else:
        paths["png"] = png
        md += f"\n![plot]({stem}.png)\n"
    mdp = os.path.join(out_dir, stem + ".md")
    with open(mdp, "w") as f:
        f.write(md)
    paths["markdown"] = mdp
    paths["json"] = os.path.join(out_dir, stem + ".json")
    return paths


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json")
    p.add_argument("--out", default=None, help="directory (default: the JSON's)")
    a = p.parse_args()
    with open(a.json) as f:
        doc = json.load(f)
    stem = os.path.splitext(os.path.basename(a.json))[0]
    paths = render(doc, a.out or os.path.dirname(os.path.abspath(a.json)), stem)
    print(summary_text(doc))
    for k, v in paths.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()

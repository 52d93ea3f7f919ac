#!/usr/bin/env python3
"""Dispatch / combine benchmark: MoK against Megatron ``alltoall``, DeepEP and torch
symmetric-memory all-to-all, on the same inputs, in one launch (GitHub issue 5).

Launch (GPU, 2 ranks):
    torchrun --nproc-per-node 2 benchmarks/bench_dispatch_combine.py [--quick] [--out DIR]
or let the script spawn its own ranks:
    python benchmarks/bench_dispatch_combine.py [--nproc 2]
Without a GPU (or with ``--cpu``) it spawns 2 gloo processes and runs the "cpu smoke": tiny
shapes, the reference backend, correctness checks only (its times are no claims).
``--shared-gpu`` runs the ranks as processes sharing the GPUs there are (rank r on
``cuda:(r % GPUs)``, gloo between them, peers mapped with CUDA IPC): a dry run of the GPU
suite's code paths at world size 2 where one GPU is lent. No NVLink, the driver time-slices the
ranks' kernels, so its times are no claims (``timing_claims`` false); DeepEP, the symmetric-memory
all-to-all and the peer bandwidth are skipped (they need a GPU per rank).

Per shape and system it reports the median per-call time on the slowest rank (>= 50 calls
after warm-up) of dispatch, cached dispatch, combine and the backward of each; the bytes
that cross NVLink (exact, from the routing); and the ratio to the floor (the bytes a
per-rank deduplicating dispatcher must move, over the peer bandwidth this run measures).
Before any timing every output is checked against an oracle and against the other systems;
a failed check is printed loudly and recorded. Output: JSON, a markdown table and a PNG
under ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))

import common as C  # noqa: E402  (sets the no-multicast environment before torch loads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from baselines import Unavailable  # noqa: E402
from baselines.alltoall import AlltoAllDispatcher, routing_from_topk  # noqa: E402

OPS = ("dispatch", "dispatch_cached", "combine", "dispatch_bwd", "combine_bwd")
SYSTEMS = ("mok", "mok_fp8", "alltoall", "deepep", "symm_a2a")
# mok_fp8: the same Buffer dispatching FP8 rows with 1x128 float32 scales (megatron_mok/fp8.py).
FP8_BLOCK = 128
# torch 2.11's all_to_all_vdev_2d: NUM_TILES = 512 threads / 32-wide tiles experts per rank.
SYMM_A2A_MAX_LOCAL_EXPERTS = 16
RESULT_STEM = "bench_dispatch_combine"
COMBINE_TOL = 1e-2   # rel. norm error for bf16 sums whose order differs from the contract's


# ------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=C.DEFAULT_OUT, help="output directory (default benchmarks/results)")
    p.add_argument("--quick", action="store_true", help=f"shapes {C.QUICK_SHAPES}, short SM sweep")
    p.add_argument("--cpu", action="store_true", help="force the CPU smoke (gloo, reference backend)")
    p.add_argument("--shared-gpu", action="store_true",
                   help="ranks share the GPUs there are (gloo, CUDA IPC): a dry run, no timing claims")
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn when not under torchrun")
    p.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated systems")
    p.add_argument("--iters", type=int, default=None, help="timed calls per op (GPU default 100)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per op (GPU default 10)")
    p.add_argument("--sm-sweep", default=None, help="mok num_sms values (default 8,16,24,32,48,64,96)")
    p.add_argument("--sm-sweep-shape", default="dsv3")
    p.add_argument("--mok-backend", default="auto", choices=["auto", "reference", "cuda"])
    p.add_argument("--mok-num-sms", type=int, default=None, help="num_sms of the main mok runs")
    p.add_argument("--deepep-sms", type=int, default=24)
    p.add_argument("--ref-check-max-tokens", type=int, default=8192,
                   help="largest T for the mok cuda-vs-reference bitwise check")
    p.add_argument("--no-bwd", action="store_true", help="skip the backward timings")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new work after this many seconds (GPU default 300)")
    p.add_argument("--peer-bw-bytes", type=int, default=1 << 30)
    p.add_argument("--commit", default=None, help="commit to record (when no .git is present)")
    p.add_argument("--dist-timeout-s", type=int, default=300)
    # internal: the symmetric-memory (NVSHMEM) child processes
    p.add_argument("--phase", default="main", choices=["main", "symm"], help=argparse.SUPPRESS)
    p.add_argument("--child-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child-world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--child-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child-device", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    p.add_argument("--child-t0", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = [os.path.relpath(sys.argv[0]) if sys.argv else "bench"] + list(argv or sys.argv[1:])
    return args


def resolve_config(args, cpu: bool):
    if cpu:
        names = [s.name for s in C.CPU_SHAPES]
        iters, warmup, sweep, budget = 3, 1, [], 600.0
    else:
        names = [s.name for s in C.GPU_SHAPES]
        if args.quick:
            names = list(C.QUICK_SHAPES)
        iters, warmup = 100, 10
        sweep = [16, 32] if args.quick else [8, 16, 24, 32, 48, 64, 96]
        budget = 300.0
    if args.shapes:
        names = [n.strip() for n in args.shapes.split(",") if n.strip()]
        unknown = [n for n in names if n not in C.SHAPES_BY_NAME]
        if unknown:
            raise SystemExit(f"unknown shape(s) {unknown}; known: {sorted(C.SHAPES_BY_NAME)}")
    if args.sm_sweep is not None:
        sweep = [int(v) for v in args.sm_sweep.split(",") if v.strip()]
    args.shape_names = names
    args.iters = args.iters or iters
    args.warmup = args.warmup if args.warmup is not None else warmup
    args.sweep = sweep
    args.budget = args.budget_s or budget
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.system_list if s not in SYSTEMS]
    if bad:
        raise SystemExit(f"unknown system(s) {bad}; known: {SYSTEMS}")
    return args


# ----------------------------------------------------------------------------- inputs
class ShapeInputs:
    """Every rank's routing and tokens (seeded), this rank's oracle rows and gradients."""

    def __init__(self, shape: C.Shape, rank: int, world: int, device):
        self.shape, self.rank, self.world, self.device = shape, rank, world, device
        E, T, K = shape.experts, shape.tokens, shape.topk
        self.el = E // world
        routing = [C.make_routing(shape, r, world, device) for r in range(world)]
        self.all_idx = [r[0] for r in routing]
        self.all_w = [r[1] for r in routing]
        self.all_x = [C.make_x(shape, r, device) for r in range(world)]
        self.x, self.idx, self.w = self.all_x[rank], self.all_idx[rank], self.all_w[rank]
        self.layout = C.expected_layout(self.all_idx, rank, world, E, T)
        lay = self.layout
        self.exp_tokens = C.gather_rows(self.all_x, lay)
        self.exp_probs = C.gather_probs(self.all_w, lay)
        self.row_expert = lay.local_expert + rank * self.el
        self.expert_out = C.expert_fn(self.exp_tokens, self.row_expert, E, which=0)
        # backward inputs: deterministic functions of the row identity, so every rank
        # knows every other rank's rows and the gradients have exact expected values
        self.grad_tokens = C.expert_fn(self.exp_tokens, self.row_expert, E, which=1)
        self.grad_probs = self.slot_value(lay.src_rank, lay.src_token, lay.slot)
        self.all_grad_y = [C.make_grad_y(shape, r, device) for r in range(world)]
        self.grad_y = self.all_grad_y[rank]
        self.exp_grad_expert_out = C.gather_rows(self.all_grad_y, lay)
        t = torch.arange(T, device=device)[:, None].expand(T, K)
        k = torch.arange(K, device=device)[None, :].expand(T, K)
        gw = self.slot_value(torch.full_like(t, rank), t, k)
        self.exp_grad_w = torch.where(self.idx >= 0, gw, torch.zeros_like(gw))
        self.fingerprint = [float(self.x.double().sum()), int(self.idx.sum()), float(self.w.double().sum())]

    def slot_value(self, src_rank, src_token, slot) -> torch.Tensor:
        T, K = self.shape.tokens, self.shape.topk
        code = (src_rank * T + src_token) * K + slot
        return ((code % 1021).to(torch.float32) - 510.0) / 64.0   # exact in float32

    def oracles(self):
        """(contract-order combine, float64 combine) of expert_out; same for grad_tokens."""
        s, E, W = self.shape, self.shape.experts, self.world
        return {
            "y_contract": C.contract_combine(self.x, self.idx, E, W, which=0),
            "y_exact": C.exact_combine(self.x, self.idx, E, which=0),
            "gx_contract": C.contract_combine(self.x, self.idx, E, W, which=1),
            "gx_exact": C.exact_combine(self.x, self.idx, E, which=1),
        }


def fp8_block(hidden: int) -> int:
    """Columns per scale of the mok_fp8 rows: 128 (DeepSeek-V3 / DeepEP), or the whole row for
    the CPU smoke's narrow shapes."""
    return FP8_BLOCK if hidden % FP8_BLOCK == 0 else hidden


def fp8_row_bytes(hidden: int) -> int:
    from megatron_mok import fp8
    return fp8.packed_row_bytes(hidden, hidden // fp8_block(hidden), torch.float32)


def shape_record(inp: ShapeInputs, peer_bw_gbps) -> dict:
    s = inp.shape
    nb = C.nvlink_bytes(inp.all_idx, inp.world, s.experts, s.hidden, 2)
    nb8 = C.nvlink_bytes(inp.all_idx, inp.world, s.experts, fp8_row_bytes(s.hidden), 1)
    rows = C.local_rows(inp.all_idx, inp.world, s.experts)
    loads = torch.zeros(s.experts, dtype=torch.int64)
    for idx in inp.all_idx:
        v = idx[idx >= 0].cpu()
        loads += torch.bincount(v, minlength=s.experts)[: s.experts]
    mean = loads.float().mean().item()
    rec = {
        "name": s.name, "desc": s.describe(), "tokens": s.tokens, "hidden": s.hidden,
        "experts": s.experts, "topk": s.topk, "skew_hot": s.skew_hot, "skew_factor": s.skew_factor,
        "unrouted_frac": s.unrouted_frac, "world_size": inp.world,
        "rows_per_rank": rows,
        "hot_load_over_mean": (loads.max().item() / mean) if mean > 0 else None,
        "nvlink_bytes": nb,
        "nvlink_bytes_fp8": nb8,
        # local HBM: dispatch writes R rows of H per rank (combine reads them back)
        "local_hbm_bytes_max_rank": max(rows) * s.hidden * 2,
        "floor_bw_gbps": peer_bw_gbps,
        "floor_us": None, "floor_us_copies": None, "floor_us_fp8": None,
    }
    if peer_bw_gbps:
        rec["floor_us_fp8"] = nb8["dedup"]["max_rank_direction"] / (peer_bw_gbps * 1e9) * 1e6
        rec["floor_us"] = nb["dedup"]["max_rank_direction"] / (peer_bw_gbps * 1e9) * 1e6
        rec["floor_us_copies"] = nb["copies"]["max_rank_direction"] / (peer_bw_gbps * 1e9) * 1e6
    return rec


# ------------------------------------------------------------------------- the runner
class Bench:
    def __init__(self, args, rank, world, local_rank, cpu):
        self.args, self.rank, self.world, self.cpu = args, rank, world, cpu
        self.shared = bool(getattr(args, "shared_gpu", False)) and not cpu
        self.device = torch.device("cpu") if cpu else torch.device("cuda", C.gpu_of(local_rank, self.shared))
        self.local_rank = local_rank
        self.group = dist.group.WORLD
        self.log = C.Progress(rank)
        self.checks = C.CheckLog(rank)
        self.results, self.shapes, self.skipped, self.sm_sweep = [], [], [], []
        self.systems = {}
        self.peer_bw = {"gbps": None, "method": None, "reason": "not measured"}
        self.fingerprints = {}
        self.keep = {}          # per shape: mok default outputs for the SM sweep
        self.refs = {}          # per shape: alltoall outputs for the cross-checks
        self.t0 = time.perf_counter()

    # ------------------------------------------------------------- small helpers
    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn):
        return C.time_op(fn, self.group, self.device, self.args.iters, self.args.warmup)

    def over_budget(self) -> bool:
        flag = torch.tensor([1 if (time.perf_counter() - self.t0) > self.args.budget else 0],
                            device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def skip(self, what, reason):
        self.skipped.append({"what": what, "reason": reason})
        self.log(f"SKIP {what}: {reason}")

    def check(self, shape, system, name, passed, detail=""):
        return self.checks.add(shape, system, name, passed, detail)

    # ------------------------------------------------------------ availability
    def probe_systems(self):
        a = self.args
        for name in SYSTEMS:
            self.systems[name] = {"requested": name in a.system_list, "available": False, "reason": ""}
        self.systems["alltoall"].update(available=True, reason="plain torch.distributed")
        try:
            import megatron_mok as mok
            self.mok = mok
            avail = mok.available_backends() if hasattr(mok, "available_backends") else ["?"]
            for name in ("mok", "mok_fp8"):
                self.systems[name].update(available=True, backends=avail, requested_backend=a.mok_backend)
                if self.cpu and a.mok_backend == "cuda":
                    self.systems[name].update(available=False, reason="backend cuda needs a GPU")
        except Exception as e:  # noqa: BLE001
            self.mok = None
            for name in ("mok", "mok_fp8"):
                self.systems[name]["reason"] = f"import megatron_mok failed: {type(e).__name__}: {e}"
        if self.cpu:
            self.systems["deepep"]["reason"] = "needs CUDA"
            self.systems["symm_a2a"]["reason"] = "needs CUDA + NVSHMEM"
        elif self.shared:
            self.systems["deepep"]["reason"] = "shared-GPU dry run: needs a GPU per rank"
            self.systems["symm_a2a"]["reason"] = "shared-GPU dry run: needs a GPU per rank"
        else:
            try:
                from baselines.deepep import import_deep_ep
                import_deep_ep()
                self.systems["deepep"].update(available=True)
            except Unavailable as e:
                self.systems["deepep"]["reason"] = str(e)
            try:
                import torch.distributed._symmetric_memory  # noqa: F401  (registers the ops' schemas)
            except Exception:  # noqa: BLE001
                pass
            missing = [op for op in ("all_to_all_vdev_2d", "all_to_all_vdev_2d_offset")
                       if not hasattr(torch.ops.symm_mem, op)]
            if missing:
                self.systems["symm_a2a"]["reason"] = f"torch {torch.__version__} lacks torch.ops.symm_mem.{missing}"
            else:
                self.systems["symm_a2a"].update(available=True,
                                                reason="runs in child processes (NVSHMEM backend)")
        for name, s in self.systems.items():
            state = "yes" if s["available"] else "no"
            if not s["requested"]:
                state += " (not requested)"
            self.log(f"system {name:9s} available={state} {s.get('reason', '')}")

    def want(self, name) -> bool:
        s = self.systems[name]
        return s["requested"] and s["available"]

    # ---------------------------------------------------------- peer bandwidth
    def measure_peer_bw(self):
        if self.cpu:
            self.peer_bw = {"gbps": None, "method": None, "reason": "cpu smoke: no NVLink"}
            return
        if self.world == 1:
            self.peer_bw = {"gbps": None, "method": None,
                            "reason": "world size 1: no peer (local copies and layout only)"}
            return
        if self.shared:
            self.peer_bw = {"gbps": None, "method": None,
                            "reason": "shared-GPU dry run: the ranks share a GPU, no NVLink"}
            return
        n = self.args.peer_bw_bytes // 2
        peer = (self.rank + 1) % self.world
        out = {"bytes": n * 2, "direction": "every rank reads from rank+1 at the same time"}
        try:
            import torch.distributed._symmetric_memory as symm_mem
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                try:
                    symm_mem.enable_symm_mem_for_group(self.group.group_name)
                except Exception:  # noqa: BLE001  (deprecated / no-op in newer torch)
                    pass
            buf = symm_mem.empty(n, dtype=torch.bfloat16, device=self.device)
            buf.fill_(float(self.rank + 1))
            hdl = symm_mem.rendezvous(buf, self.group.group_name)
            src = hdl.get_buffer(peer, (n,), torch.bfloat16)
            dst = torch.empty(n, dtype=torch.bfloat16, device=self.device)
            dist.barrier(group=self.group)
            self.sync()
            for label, fn in (("copy_engine", lambda: dst.copy_(src)),
                              ("sm_kernel", lambda: torch.mul(src, 1, out=dst))):
                dst.fill_(-1.0)
                t = C.time_op(fn, self.group, self.device, iters=10, warmup=2)
                ok = bool((dst[:4096] == float(peer + 1)).all() and (dst[-4096:] == float(peer + 1)).all())
                out[label] = {"median_us": t["median_us"], "gbps": n * 2 / (t["median_us"] * 1e-6) / 1e9,
                              "data_ok": ok}
                if not ok:
                    self.check("peer_bw", "symm_mem", f"{label} read the peer's data", False,
                               "destination does not hold the peer's fill value")
            out["copy_engine"]["how"] = "dst.copy_(peer view from symm_mem.rendezvous) -> cudaMemcpyAsync"
            out["sm_kernel"]["how"] = "torch.mul(peer view, 1, out=dst): elementwise kernel pulling over NVLink"
            try:
                out["symm_mem_backend"] = symm_mem.get_backend(self.device)
            except Exception:  # noqa: BLE001
                pass
            best = max(("copy_engine", "sm_kernel"), key=lambda k: out[k]["gbps"])
            out.update(gbps=out[best]["gbps"], method=f"symm_mem peer read ({best})", reason="")
            dist.barrier(group=self.group)
            del src, dst, hdl, buf
        except Exception as e:  # noqa: BLE001
            out["symm_mem_error"] = f"{type(e).__name__}: {e}"
            a = torch.full((n,), float(self.rank + 1), dtype=torch.bfloat16, device=self.device)
            b = torch.empty_like(a)
            prev = (self.rank - 1) % self.world

            def sendrecv():
                ops = [dist.P2POp(dist.isend, a, peer, self.group), dist.P2POp(dist.irecv, b, prev, self.group)]
                for r in dist.batch_isend_irecv(ops):
                    r.wait()
            t = C.time_op(sendrecv, self.group, self.device, iters=10, warmup=2)
            gbps = n * 2 / (t["median_us"] * 1e-6) / 1e9
            out.update(gbps=gbps, method="NCCL send/recv fallback (symm_mem unavailable)",
                       reason="", nccl_sendrecv={"median_us": t["median_us"], "gbps": gbps})
            del a, b
        torch.cuda.empty_cache()
        self.peer_bw = out
        self.log(f"peer bandwidth: {out['gbps']:.1f} GB/s per direction via {out['method']}"
                 + "".join(f"; {k} {out[k]['gbps']:.1f}" for k in ("copy_engine", "sm_kernel") if k in out))

    # ------------------------------------------------------------- one system
    def run_system(self, name, inp: ShapeInputs, orc, ref, rec_shape):
        """Run ``name`` on ``inp``; returns the result record (also on failure)."""
        rec = {"shape": inp.shape.name, "system": name, "variant": "", "status": "ok", "ops": {},
               "error": None}
        t_start = time.perf_counter()
        try:
            fn = {"alltoall": self._run_alltoall, "mok": self._run_mok, "mok_fp8": self._run_mok_fp8,
                  "deepep": self._run_deepep}[name]
            fn(inp, orc, ref, rec)
            ok = True
        except Exception as e:  # noqa: BLE001
            ok = False
            rec["status"] = "failed"
            rec["error"] = f"{type(e).__name__}: {e}"
            tb = traceback.format_exc()
            rec["traceback"] = tb[-3000:]
            print(f"\n!!!! {inp.shape.name} / {name} FAILED on rank {self.rank}: {rec['error']}\n{tb}",
                  flush=True)
        if not C.all_ranks_ok(ok, self.group, self.device) and ok:
            rec["status"] = "failed"
            rec["error"] = rec["error"] or "failed on another rank"
        self.sync()
        rec["wall_s"] = time.perf_counter() - t_start
        self._add_floor(rec, rec_shape)
        self.results.append(rec)
        self._print_rec(rec, rec_shape)
        return rec

    def _add_floor(self, rec, rs):
        fp8_rows = rec["system"] == "mok_fp8"    # its rows are FP8 + scales: its own bytes and floor
        sysbytes = rs["nvlink_bytes_fp8" if fp8_rows else "nvlink_bytes"][
            "copies" if rec["system"] in ("alltoall", "symm_a2a") else "dedup"]
        rec["nvlink_bytes_total"] = sysbytes["total"]
        rec["nvlink_bytes_max_rank_direction"] = sysbytes["max_rank_direction"]
        rec["bytes_kind"] = ("one copy per (token, remote expert)" if rec["system"] in ("alltoall", "symm_a2a")
                             else "one copy per (token, remote rank)")
        if fp8_rows:
            rec["bytes_kind"] += f", packed FP8 rows of {rs['nvlink_bytes_fp8']['row_bytes']} bytes"
        rec["floor_us"] = rs["floor_us_fp8" if fp8_rows else "floor_us"]
        bw = rs["floor_bw_gbps"]
        rec["own_floor_us"] = sysbytes["max_rank_direction"] / (bw * 1e9) * 1e6 if bw else None
        rec["x_floor"], rec["achieved_gbps"] = {}, {}
        for op, t in rec["ops"].items():
            if not (isinstance(t, dict) and t.get("median_us")):
                continue
            if rec["floor_us"]:
                rec["x_floor"][op] = t["median_us"] / rec["floor_us"]
            # this system's own busiest-direction bytes over its time (combine moves the same)
            rec["achieved_gbps"][op] = sysbytes["max_rank_direction"] / (t["median_us"] * 1e-6) / 1e9

    def _print_rec(self, rec, rs):
        parts = []
        for op in OPS:
            t = rec["ops"].get(op)
            if isinstance(t, dict) and "median_us" in t:
                xf = rec["x_floor"].get(op)
                parts.append(f"{op} {C.fmt_us(t['median_us'])}" + (f" ({xf:.2f}x)" if xf and not self.cpu else ""))
        name = rec["system"] + (f"[{rec['backend']}]" if rec.get("backend") else "") + (
            f" {rec['variant']}" if rec["variant"] else "")
        status = rec["status"] if rec["status"] != "ok" else "ok"
        self.log(f"{rec['shape']:6s} | {name:18s} | {status} | " + " | ".join(parts)
                 + (f" | {rec['error']}" if rec["error"] else ""))

    def _time_ops(self, rec, fns: dict):
        for op, fn in fns.items():
            if fn is None:
                continue
            if isinstance(fn, str):
                rec["ops"][op] = {"unavailable": fn}
                continue
            rec["ops"][op] = self.time(fn)

    def _check_rows(self, sname, system, inp, tokens, probs, tpe, extra=""):
        lay = inp.layout
        ok_t = C.bitwise_equal(tokens, inp.exp_tokens)
        self.check(sname, system, f"dispatch tokens == oracle rows (bitwise){extra}", ok_t,
                   f"rows {tuple(tokens.shape)} vs {tuple(inp.exp_tokens.shape)}")
        ok_p = C.bitwise_equal(probs.float(), inp.exp_probs)
        self.check(sname, system, f"dispatch probs == oracle (bitwise){extra}", ok_p)
        ok_e = torch.equal(tpe.to(torch.int64).cpu(), lay.tokens_per_expert.cpu())
        self.check(sname, system, f"tokens_per_expert == oracle{extra}", ok_e)
        return ok_t and ok_p and ok_e

    # alltoall ---------------------------------------------------------------
    def _run_alltoall(self, inp, orc, ref, rec):
        s, a = inp.shape, self.args
        d = AlltoAllDispatcher(self.group, s.experts, s.topk, self.device)
        rm, pr = routing_from_topk(inp.idx, inp.w, s.experts)
        res = d.dispatch(inp.x, rm, pr)
        self._check_rows(s.name, "alltoall", inp, res.tokens, res.probs, res.tokens_per_expert)
        y = d.combine(inp.expert_out, res.handle)
        err = C.rel_err(y, orc["y_exact"])
        self.check(s.name, "alltoall", "combine ~= float64 oracle", err < COMBINE_TOL, f"rel err {err:.2e}")
        ref["alltoall_tokens"], ref["alltoall_y"] = res.tokens, y
        fns = {
            "dispatch": lambda: d.dispatch(inp.x, rm, pr),
            "dispatch_cached": "Megatron alltoall recomputes its layout every call",
            "combine": lambda: d.combine(inp.expert_out, res.handle),
        }
        if not a.no_bwd:
            x_r = inp.x.detach().clone().requires_grad_(True)
            p_r = pr.detach().clone().requires_grad_(True)
            r2 = d.dispatch(x_r, rm, p_r)
            gx, gp = torch.autograd.grad([r2.tokens, r2.probs], [x_r, p_r], [inp.grad_tokens, inp.grad_probs],
                                         retain_graph=True)
            err = C.rel_err(gx, orc["gx_exact"])
            self.check(s.name, "alltoall", "dispatch bwd grad_x ~= float64 oracle", err < COMBINE_TOL,
                       f"rel err {err:.2e}")
            gw = gp.gather(1, inp.idx.clamp(min=0))
            gw = torch.where(inp.idx >= 0, gw, torch.zeros_like(gw))
            self.check(s.name, "alltoall", "dispatch bwd grad_probs == oracle (bitwise)",
                       C.bitwise_equal(gw, inp.exp_grad_w))
            fns["dispatch_bwd"] = lambda: torch.autograd.grad(
                [r2.tokens, r2.probs], [x_r, p_r], [inp.grad_tokens, inp.grad_probs], retain_graph=True)
            self._combine_bwd(s.name, "alltoall", d.combine, res.handle, inp, fns)
        self._time_ops(rec, fns)

    def _combine_bwd(self, shape, system, combine, handle, inp, fns):
        """combine's backward (rows of grad_y) checked bitwise against the oracle, then timed
        as ``fns["combine_bwd"]``."""
        eo_r = inp.expert_out.detach().clone().requires_grad_(True)
        y2 = combine(eo_r, handle)
        (geo,) = torch.autograd.grad(y2, eo_r, inp.grad_y, retain_graph=True)
        self.check(shape, system, "combine bwd == oracle rows of grad_y (bitwise)",
                   C.bitwise_equal(geo, inp.exp_grad_expert_out))
        fns["combine_bwd"] = lambda: torch.autograd.grad(y2, eo_r, inp.grad_y, retain_graph=True)

    # mok -------------------------------------------------------------------
    def make_mok(self, shape, backend, num_sms=None):
        kw = dict(num_experts=shape.experts, hidden=shape.hidden, topk=shape.topk,
                  max_tokens_per_rank=shape.tokens, dtype=torch.bfloat16, backend=backend)
        if num_sms is not None:
            kw["num_sms"] = num_sms
        return self.mok.Buffer(self.group, **kw)

    def _mok_backend_name(self, buf, x):
        try:
            return buf._backend_for(x).name
        except Exception:  # noqa: BLE001
            return getattr(buf, "backend", self.args.mok_backend)

    def _mok_record(self, rec, buf, inp) -> str:
        """A MoK system's backend and SM fields in its record; returns the backend's name."""
        backend = self._mok_backend_name(buf, inp.x)
        rec["backend"] = backend
        rec["num_sms"] = self.args.mok_num_sms
        if backend == "cuda":  # the SMs this shape's calls run on (small calls: their own budget)
            rec["transfer_sms"] = buf._get_backend("cuda")._roles(inp.shape.tokens)[0]
        return backend

    def _run_mok(self, inp, orc, ref, rec):
        s, a = inp.shape, self.args
        buf = self.make_mok(s, a.mok_backend, a.mok_num_sms)
        try:
            backend = self._mok_record(rec, buf, inp)
            res = buf.dispatch(inp.x, inp.idx, inp.w)
            self._check_rows(s.name, "mok", inp, res.tokens, res.probs, res.tokens_per_expert)
            self.check(s.name, "mok", "src_rank/src_token == oracle",
                       torch.equal(res.src_rank.cpu(), inp.layout.src_rank.cpu())
                       and torch.equal(res.src_token.cpu(), inp.layout.src_token.cpu()))
            if "alltoall_tokens" in ref:
                self.check(s.name, "mok", "dispatch tokens == alltoall rows (bitwise)",
                           C.bitwise_equal(res.tokens, ref["alltoall_tokens"]))
            y = buf.combine(inp.expert_out, res.handle)
            self.check(s.name, "mok", "combine == contract-order oracle (bitwise)",
                       C.bitwise_equal(y, orc["y_contract"]), f"rel err {C.rel_err(y, orc['y_contract']):.2e}")
            if "alltoall_y" in ref:
                err = C.rel_err(y, ref["alltoall_y"])
                self.check(s.name, "mok", "combine ~= alltoall combine (bf16 tol)", err < COMBINE_TOL,
                           f"rel err {err:.2e}")
            self._mok_vs_reference(buf, backend, inp, res, y)
            if s.name == a.sm_sweep_shape and a.sweep:
                self.keep[s.name] = {"tokens": res.tokens, "y": y}
            fns = {"dispatch": lambda: buf.dispatch(inp.x, inp.idx, inp.w),
                   "combine": lambda: buf.combine(inp.expert_out, res.handle)}
            try:
                rc = buf.dispatch(inp.x, handle=res.handle)
            except (TypeError, NotImplementedError) as e:
                fns["dispatch_cached"] = f"Buffer.dispatch(x, handle=...) not available ({type(e).__name__}: {e})"
            except Exception as e:  # noqa: BLE001
                self.check(s.name, "mok", "cached dispatch runs", False, f"{type(e).__name__}: {e}")
                fns["dispatch_cached"] = f"failed: {type(e).__name__}: {e}"
            else:
                self.check(s.name, "mok", "cached dispatch == dispatch (bitwise)",
                           C.bitwise_equal(rc.tokens if hasattr(rc, "tokens") else rc, res.tokens))
                fns["dispatch_cached"] = lambda: buf.dispatch(inp.x, handle=res.handle)
            if not a.no_bwd:
                x_r = inp.x.detach().clone().requires_grad_(True)
                w_r = inp.w.detach().clone().requires_grad_(True)
                r2 = buf.dispatch(x_r, inp.idx, w_r)
                gx, gw = torch.autograd.grad([r2.tokens, r2.probs], [x_r, w_r],
                                             [inp.grad_tokens, inp.grad_probs], retain_graph=True)
                self.check(s.name, "mok", "dispatch bwd grad_x == contract-order oracle (bitwise)",
                           C.bitwise_equal(gx, orc["gx_contract"]),
                           f"rel err {C.rel_err(gx, orc['gx_contract']):.2e}")
                self.check(s.name, "mok", "dispatch bwd grad_topk_weights == oracle (bitwise)",
                           C.bitwise_equal(gw, inp.exp_grad_w))
                fns["dispatch_bwd"] = lambda: torch.autograd.grad(
                    [r2.tokens, r2.probs], [x_r, w_r], [inp.grad_tokens, inp.grad_probs], retain_graph=True)
                self._combine_bwd(s.name, "mok", buf.combine, res.handle, inp, fns)
            self._time_ops(rec, fns)
        finally:
            self.sync()
            buf.destroy()

    def _mok_vs_reference(self, buf, backend, inp, res, y):
        s = inp.shape
        if backend == "reference":   # nothing to compare: a skip, not a passed check
            self.skip(f"{s.name}/mok cuda == reference check", "mok ran on the reference backend itself")
            return
        if s.tokens > self.args.ref_check_max_tokens:
            self.skip(f"{s.name}/mok reference check", f"T={s.tokens} > --ref-check-max-tokens")
            return
        rbuf = self.make_mok(s, "reference")
        try:
            rres = rbuf.dispatch(inp.x, inp.idx, inp.w)
            self.check(s.name, "mok", "cuda dispatch == reference backend (bitwise)",
                       C.bitwise_equal(res.tokens, rres.tokens) and C.bitwise_equal(res.probs, rres.probs))
            ry = rbuf.combine(inp.expert_out, rres.handle)
            self.check(s.name, "mok", "cuda combine == reference backend (bitwise)", C.bitwise_equal(y, ry))
        finally:
            rbuf.destroy()

    def _run_mok_fp8(self, inp, orc, ref, rec):
        """MoK's FP8 dispatch (megatron_mok/fp8.py): every rank's tokens quantized once, outside
        the timing (1x128 blocks, float32 scales: DeepEP's FP8 input), then dispatched as packed
        FP8 rows. "dispatch" includes the pack (one copy of [T, P] bytes, also timed alone as
        "pack_us"). Combine stays in the Buffer's dtype (the mok row); the FP8 rows have no
        backward."""
        from megatron_mok import fp8
        s, a = inp.shape, self.args
        buf = self.make_mok(s, a.mok_backend, a.mok_num_sms)
        try:
            self._mok_record(rec, buf, inp)
            block = fp8_block(s.hidden)
            pairs = [fp8.quantize(x, block) for x in inp.all_x]
            pair = pairs[self.rank]
            rec["variant"] = f"1x{block}"
            res = buf.dispatch(pair, inp.idx, inp.w)
            want = C.gather_rows([fp8.pack(*p) for p in pairs], inp.layout)
            H, sb = s.hidden, pair[1].shape[1] * 4
            rows_fp8, row_scales = res.tokens
            self.check(s.name, "mok_fp8", "fp8 rows == quantized oracle rows (bytes)",
                       torch.equal(rows_fp8.contiguous().view(torch.uint8), want[:, :H])
                       and torch.equal(row_scales.contiguous().view(torch.uint8), want[:, H:H + sb]),
                       f"rows {tuple(rows_fp8.shape)} vs {tuple(want.shape)}")
            self.check(s.name, "mok_fp8", "dispatch probs == oracle (bitwise)",
                       C.bitwise_equal(res.probs.float(), inp.exp_probs))
            self.check(s.name, "mok_fp8", "tokens_per_expert == oracle",
                       torch.equal(res.tokens_per_expert.to(torch.int64).cpu(), inp.layout.tokens_per_expert.cpu()))
            rc = buf.dispatch(pair, handle=res.handle)
            self.check(s.name, "mok_fp8", "cached fp8 dispatch == fp8 dispatch (bytes)",
                       torch.equal(rc.tokens[0].contiguous().view(torch.uint8), rows_fp8.contiguous().view(torch.uint8))
                       and torch.equal(rc.tokens[1].contiguous().view(torch.uint8),
                                       row_scales.contiguous().view(torch.uint8)))
            err = C.rel_err(fp8.dequantize(rows_fp8, row_scales, torch.float32), inp.exp_tokens.float())
            rec["dequant_rel_err"] = err
            self.check(s.name, "mok_fp8", "dequantized rows ~= bf16 rows (E4M3 tolerance)", err < 0.07,
                       f"rel err {err:.2e}")
            rec["pack_us"] = self.time(lambda: fp8.pack(*pair)).get("median_us")
            bf16_only = "bf16 only: combine runs in the Buffer's dtype (the mok row)"
            fns = {"dispatch": lambda: buf.dispatch(pair, inp.idx, inp.w),
                   "dispatch_cached": lambda: buf.dispatch(pair, handle=res.handle),
                   "combine": bf16_only,
                   "dispatch_bwd": "n/a (--no-bwd)",
                   "combine_bwd": bf16_only}
            if not a.no_bwd:
                # The FP8 rows have no gradient; the backward carries the prob gradients only.
                w_r = inp.w.detach().clone().requires_grad_(True)
                r2 = buf.dispatch(pair, inp.idx, w_r)
                gw, = torch.autograd.grad([r2.probs], [w_r], [inp.grad_probs], retain_graph=True)
                self.check(s.name, "mok_fp8", "dispatch bwd grad_topk_weights == oracle (bitwise)",
                           C.bitwise_equal(gw, inp.exp_grad_w))
                fns["dispatch_bwd"] = lambda: torch.autograd.grad([r2.probs], [w_r], [inp.grad_probs],
                                                                  retain_graph=True)
                # Same-run A/B (NOTES #56), both called on the backend directly (no autograd
                # time): the prob gradients alone, and session 22's way, a full combine of zero rows.
                backend = buf._backend_for(pair[0])
                zeros = torch.zeros(r2.handle.num_out_rows, s.hidden, dtype=inp.x.dtype, device=inp.x.device)
                rec["dispatch_bwd_prob_grads_us"] = self.time(
                    lambda: backend.combine_prob_grads(r2.handle, inp.grad_probs)).get("median_us")
                rec["dispatch_bwd_full_combine_us"] = self.time(
                    lambda: backend.combine(zeros, r2.handle, grad_probs=inp.grad_probs)).get("median_us")
            self._time_ops(rec, fns)
            if "dispatch_bwd_full_combine_us" in rec:
                us = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
                self.log(f"{s.name} mok_fp8 dispatch bwd: {us(rec['ops']['dispatch_bwd'].get('median_us'))} us "
                         f"through autograd; on the backend: prob gradients only "
                         f"{us(rec['dispatch_bwd_prob_grads_us'])} us, as a full combine of zero rows "
                         f"{us(rec['dispatch_bwd_full_combine_us'])} us")
        finally:
            self.sync()
            buf.destroy()

    # deepep ----------------------------------------------------------------
    def _run_deepep(self, inp, orc, ref, rec):
        from baselines.deepep import DeepEP
        s, a = inp.shape, self.args
        if getattr(self, "deepep", None) is None:
            max_h = max(C.SHAPES_BY_NAME[n].hidden for n in a.shape_names)
            self.deepep = DeepEP(self.group, s.experts, max_h, num_sms=a.deepep_sms)
        dp = self.deepep
        if dp.E != s.experts:
            raise Unavailable("DeepEP buffer was built for another expert count")
        rec["num_sms"] = a.deepep_sms
        idx = dp.convert_idx(inp.idx)
        res = dp.dispatch(inp.x, idx, inp.w)
        tokens, probs, tpe, _ = dp.rows(res, s.tokens)
        self._check_rows(s.name, "deepep", inp, tokens, probs, tpe, " (after local permute)")
        xin = dp.combine_input(res, inp.expert_out, s.tokens)
        y = dp.combine(xin, res)
        err = C.rel_err(y, orc["y_exact"])
        self.check(s.name, "deepep", "combine ~= float64 oracle", err < COMBINE_TOL, f"rel err {err:.2e}")
        if "alltoall_y" in ref:
            err = C.rel_err(y, ref["alltoall_y"])
            self.check(s.name, "deepep", "combine ~= alltoall combine (bf16 tol)", err < COMBINE_TOL,
                       f"rel err {err:.2e}")
        rc = dp.dispatch_cached(inp.x, res)
        self.check(s.name, "deepep", "cached dispatch == dispatch (bitwise)", C.bitwise_equal(rc, res.recv_x))
        why = "DeepEP has no autograd; Megatron's flex backward runs these same kernels (combine / cached dispatch)"
        self._time_ops(rec, {
            "dispatch": lambda: dp.dispatch(inp.x, idx, inp.w),
            "dispatch_cached": lambda: dp.dispatch_cached(inp.x, res),
            "combine": lambda: dp.combine(xin, res),
            "dispatch_bwd": why, "combine_bwd": why,
        })

    # -------------------------------------------------------------- a shape
    def run_shape(self, shape: C.Shape, systems):
        """Run ``systems`` on ``shape``. Baselines run in a first pass over all shapes and
        MoK in a second one, so a crash of the new kernels cannot take the baseline data
        with it; the alltoall outputs of the first pass are kept for MoK's cross-checks."""
        self.log(f"--- shape {shape.name}: {shape.describe()}, {self.world} ranks: {', '.join(systems)}")
        inp = ShapeInputs(shape, self.rank, self.world, self.device)
        rs = next((r for r in self.shapes if r["name"] == shape.name), None)
        if rs is None:
            rs = shape_record(inp, self.peer_bw.get("gbps"))
            self.shapes.append(rs)
            self.fingerprints[shape.name] = inp.fingerprint
            nb = rs["nvlink_bytes"]
            self.log(f"    NVLink bytes busiest direction: dedup {nb['dedup']['max_rank_direction'] / 1e6:.1f} MB, "
                     f"per-expert copies {nb['copies']['max_rank_direction'] / 1e6:.1f} MB; "
                     f"rows/rank {rs['rows_per_rank']}"
                     + (f"; floor {rs['floor_us']:.1f} us" if rs["floor_us"] else "")
                     + (f"; hot/mean {rs['hot_load_over_mean']:.2f}" if shape.skew_hot else ""))
        elif self.fingerprints.get(shape.name) != inp.fingerprint:
            self.check(shape.name, "inputs", "regenerated inputs identical", False,
                       f"{inp.fingerprint} vs {self.fingerprints.get(shape.name)}")
        orc = inp.oracles()
        ref = self.refs.setdefault(shape.name, {})
        for name in systems:
            if not self.want(name):
                continue
            if self.over_budget():
                self.skip(f"{shape.name}/{name}", f"time budget {self.args.budget:.0f}s spent")
                continue
            self.run_system(name, inp, orc, ref, rs)
        del inp, orc, ref
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------- SM sweep
    def run_sm_sweep(self):
        a = self.args
        if not a.sweep:
            return
        if self.cpu:
            self.skip("mok SM sweep", "cpu smoke")
            return
        if not self.want("mok"):
            self.skip("mok SM sweep", "mok not available")
            return
        if "cuda" not in self.systems["mok"].get("backends", []):
            self.skip("mok SM sweep", "mok cuda backend not available (num_sms is a cuda knob)")
            return
        sname = a.sm_sweep_shape
        if sname not in C.SHAPES_BY_NAME:
            self.skip("mok SM sweep", f"unknown shape {sname}")
            return
        shape = C.SHAPES_BY_NAME[sname]
        self.log(f"--- mok SM sweep on {sname}: num_sms {a.sweep}")
        inp = ShapeInputs(shape, self.rank, self.world, self.device)
        rs = next((r for r in self.shapes if r["name"] == sname), None) or shape_record(inp, self.peer_bw.get("gbps"))
        base = self.keep.get(sname)
        for n in a.sweep:
            if self.over_budget():
                self.skip(f"SM sweep num_sms={n}", "time budget spent")
                continue
            rec = {"shape": sname, "system": "mok", "variant": f"num_sms={n}", "num_sms": n,
                   "status": "ok", "ops": {}, "error": None, "backend": "cuda"}
            ok = True
            try:
                buf = self.make_mok(shape, "cuda", n)
                try:
                    res = buf.dispatch(inp.x, inp.idx, inp.w)
                    y = buf.combine(inp.expert_out, res.handle)
                    if base is not None:
                        self.check(sname, f"mok num_sms={n}", "dispatch == default num_sms (bitwise)",
                                   C.bitwise_equal(res.tokens, base["tokens"]))
                        self.check(sname, f"mok num_sms={n}", "combine == default num_sms (bitwise)",
                                   C.bitwise_equal(y, base["y"]))
                    else:
                        self._check_rows(sname, f"mok num_sms={n}", inp, res.tokens, res.probs, res.tokens_per_expert)
                    self._time_ops(rec, {"dispatch": lambda: buf.dispatch(inp.x, inp.idx, inp.w),
                                         "combine": lambda: buf.combine(inp.expert_out, res.handle)})
                finally:
                    self.sync()
                    buf.destroy()
            except Exception as e:  # noqa: BLE001
                ok = False
                rec.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
                print(f"!!!! SM sweep num_sms={n} failed on rank {self.rank}: {rec['error']}", flush=True)
            if not C.all_ranks_ok(ok, self.group, self.device) and ok:
                rec.update(status="failed", error="failed on another rank")
            self._add_floor(rec, rs)
            self.sm_sweep.append(rec)
            self._print_rec(rec, rs)
        del inp
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------ symmetric-memory phase
    def run_symm_phase(self, out_dir):
        if not self.want("symm_a2a"):
            return
        # torch's all_to_all_vdev_2d takes at most SYMM_A2A_MAX_LOCAL_EXPERTS experts per rank;
        # a larger shape would only fail in the child, after NVSHMEM start-up (which once hung
        # past its cap instead: run s4-4), so such shapes are not sent to it at all.
        shapes = [n for n in self.args.shape_names
                  if C.SHAPES_BY_NAME[n].experts // self.world <= SYMM_A2A_MAX_LOCAL_EXPERTS]
        for n in self.args.shape_names:
            if n not in shapes:
                self.skip(f"{n}/symm_a2a", f"{C.SHAPES_BY_NAME[n].experts // self.world} experts per rank; "
                          f"torch's all_to_all_vdev_2d takes at most {SYMM_A2A_MAX_LOCAL_EXPERTS}")
        if not shapes:
            self.systems["symm_a2a"].update(
                available=False, reason=f"every shape has more than {SYMM_A2A_MAX_LOCAL_EXPERTS} experts per rank "
                                        "(torch's all_to_all_vdev_2d limit)")
            return
        # its own cap: NVSHMEM start-up plus two ops per shape; MoK still follows
        remaining = min(150.0, self.args.budget + 40 - (time.perf_counter() - self.t0))
        if remaining < 30:
            self.skip("symm_a2a", "time budget spent")
            return
        self.log(f"--- symm_a2a: starting NVSHMEM child processes (timeout {remaining:.0f}s)")
        port = [C.free_port() if self.rank == 0 else 0]
        dist.broadcast_object_list(port, src=0, group=self.group)
        child_out = os.path.join(out_dir, f".symm_child_r{self.rank}.json")
        if os.path.exists(child_out):
            os.remove(child_out)
        a = self.args
        cmd = [sys.executable, os.path.abspath(__file__), "--phase", "symm",
               "--child-rank", str(self.rank), "--child-world", str(self.world),
               "--child-port", str(port[0]), "--child-device", str(self.local_rank),
               "--child-out", child_out, "--shapes", ",".join(shapes),
               "--iters", str(a.iters), "--warmup", str(a.warmup), "--child-t0", str(self.log.t0),
               "--budget-s", str(max(10.0, remaining - 15.0))]
        env = {k: v for k, v in os.environ.items()
               if not (k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                             "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                       or k.startswith("TORCHELASTIC"))}
        env.update(C.SAFE_ENV)
        env.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")   # one node: no IB probing
        env["PYTHONUNBUFFERED"] = "1"
        proc = subprocess.Popen(cmd, env=env)
        try:
            rc = proc.wait(timeout=remaining)
            err = None if rc == 0 else f"child exited with code {rc}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            err = f"timed out after {remaining:.0f}s"
        child = None
        if os.path.exists(child_out):
            try:
                import json
                with open(child_out) as f:
                    child = json.load(f)
                os.remove(child_out)
            except Exception as e:  # noqa: BLE001
                err = (err or "") + f"; unreadable child output: {e}"
        ok = C.all_ranks_ok(err is None and child is not None, self.group, self.device)
        if child is not None:
            self.checks.items.extend(child.get("checks", []))
            self.skipped.extend(child.get("skipped", []))
            rs_by = {r["name"]: r for r in self.shapes}
            for rec in child.get("results", []):
                if rec["shape"] in rs_by:
                    self._add_floor(rec, rs_by[rec["shape"]])
                self.results.append(rec)
            for name, fp in child.get("fingerprints", {}).items():
                if name in self.fingerprints:
                    same = self.fingerprints[name] == fp
                    self.check(name, "symm_a2a", "child saw the same inputs as the main phase", same,
                               f"{fp} vs {self.fingerprints[name]}")
            if child.get("unavailable"):
                self.systems["symm_a2a"].update(available=False, reason=child["unavailable"])
        if not ok:
            reason = err or "failed on another rank"
            self.systems["symm_a2a"]["error"] = reason
            self.log(f"symm_a2a phase problem: {reason}")
            if child is None:
                self.results.append({"shape": "*", "system": "symm_a2a", "variant": "", "status": "failed",
                                     "ops": {}, "error": reason})


# ------------------------------------------------------------------ symm child
def symm_child(args):
    """One rank of the NVSHMEM phase: alltoall (reference) + symm_a2a on every shape."""
    C.set_safe_env()
    rank, world = args.child_rank, args.child_world
    device = torch.device("cuda", args.child_device)
    torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.child_port))
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.dist_timeout_s))
    group = dist.group.WORLD
    log = C.Progress(rank, t0=args.child_t0, prefix=" [symm]")
    checks = C.CheckLog(rank)
    out = {"results": [], "checks": checks.items, "skipped": [], "fingerprints": {}, "unavailable": None}
    shapes = [C.SHAPES_BY_NAME[n] for n in args.shape_names]
    from baselines.symm_a2a import SymmA2A
    try:
        # symmetric sizes: the largest case over all shapes and ranks (every rank knows all routing)
        max_in = max_out = 0
        for s in shapes:
            idx_all = [C.make_routing(s, r, world, device)[0] for r in range(world)]
            max_in = max(max_in, s.tokens * s.topk)
            max_out = max(max_out, max(C.local_rows(idx_all, world, s.experts)))
        max_h = max(s.hidden for s in shapes)
        sy = SymmA2A(group, shapes[0].experts, max_in, max_out, max_h, device)
        log(f"NVSHMEM buffers: in {max_in} rows, out {sy.max_out_rows} rows, H<={max_h}")
    except Exception as e:  # noqa: BLE001
        out["unavailable"] = f"{type(e).__name__}: {e}"
        log(f"symm_a2a unavailable: {out['unavailable']}")
        if rank == 0:
            C.write_json(args.child_out, out)
        dist.destroy_process_group()
        return
    t_child = time.perf_counter()
    for s in shapes:
        late = torch.tensor([1 if time.perf_counter() - t_child > args.budget else 0], device=device)
        dist.all_reduce(late, op=dist.ReduceOp.MAX)
        if late.item():
            out["skipped"].append({"what": f"{s.name}/symm_a2a", "reason": "time budget spent"})
            continue
        if s.experts != sy.E:
            out["skipped"].append({"what": f"{s.name}/symm_a2a", "reason": "other expert count"})
            continue
        rec = {"shape": s.name, "system": "symm_a2a", "variant": "", "status": "ok", "ops": {}, "error": None}
        ok = True
        try:
            inp = ShapeInputs(s, rank, world, device)
            out["fingerprints"][s.name] = inp.fingerprint
            y_exact = C.exact_combine(inp.x, inp.idx, s.experts, which=0)
            d = AlltoAllDispatcher(group, s.experts, s.topk, device)
            rm, pr = routing_from_topk(inp.idx, inp.w, s.experts)
            ares = d.dispatch(inp.x, rm, pr)
            ay = d.combine(inp.expert_out, ares.handle)
            res = sy.dispatch(inp.x, inp.idx, inp.w)
            tokens, probs, tpe = sy.rows(res)
            for name, passed in (
                    ("dispatch tokens == oracle rows (bitwise)", C.bitwise_equal(tokens, inp.exp_tokens)),
                    ("dispatch probs == oracle (bitwise)", C.bitwise_equal(probs, inp.exp_probs)),
                    ("tokens_per_expert == oracle", torch.equal(tpe.cpu(), inp.layout.tokens_per_expert.cpu())),
                    ("dispatch tokens == alltoall rows (bitwise)", C.bitwise_equal(tokens, ares.tokens))):
                checks.add(s.name, "symm_a2a", name, passed)
            sy.place_expert_out(res, inp.expert_out)
            y = sy.combine(res)
            err = C.rel_err(y, y_exact)
            checks.add(s.name, "symm_a2a", "combine ~= float64 oracle", err < COMBINE_TOL, f"rel err {err:.2e}")
            err = C.rel_err(y, ay)
            checks.add(s.name, "symm_a2a", "combine ~= alltoall combine (bf16 tol)", err < COMBINE_TOL,
                       f"rel err {err:.2e}")
            del ares, ay
            why = "no autograd wrapper here; the backward runs the opposite op (see combine / dispatch)"
            # combine first: dispatch timing overwrites the expert rows in the output buffer
            rec["ops"]["combine"] = C.time_op(lambda: sy.combine(res), group, device, args.iters, args.warmup)
            rec["ops"]["dispatch"] = C.time_op(lambda: sy.dispatch(inp.x, inp.idx, inp.w), group, device,
                                               args.iters, args.warmup)
            rec["ops"]["dispatch_cached"] = {"unavailable": "no cached-layout mode (splits are exchanged on the device)"}
            rec["ops"]["dispatch_bwd"] = {"unavailable": why}
            rec["ops"]["combine_bwd"] = {"unavailable": why}
        except Exception as e:  # noqa: BLE001
            ok = False
            rec.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
            print(f"!!!! {s.name} / symm_a2a failed on rank {rank}: {rec['error']}\n{rec['traceback']}", flush=True)
        if not C.all_ranks_ok(ok, group, device) and ok:
            rec.update(status="failed", error="failed on another rank")
        torch.cuda.synchronize(device)
        out["results"].append(rec)
        t = rec["ops"]
        log(f"{s.name:6s} | symm_a2a | {rec['status']} | "
            + " | ".join(f"{op} {C.fmt_us(t[op]['median_us'])}" for op in ("dispatch", "combine")
                         if op in t and "median_us" in t[op]) + (f" | {rec['error']}" if rec["error"] else ""))
        torch.cuda.empty_cache()
    if rank == 0:
        C.write_json(args.child_out, out)
    else:
        C.write_json(args.child_out, {"results": [], "checks": checks.items, "skipped": [], "fingerprints": {}})
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------- main flow
def gather_checks(bench: Bench):
    """All ranks' check records on rank 0."""
    objs = [None] * bench.world
    dist.all_gather_object(objs, bench.checks.items, group=bench.group)
    merged = []
    for items in objs:
        merged.extend(items)
    return merged


def worker(rank, world, local_rank, args, cpu):
    C.set_safe_env()
    args = resolve_config(args, cpu)
    shared = args.shared_gpu and not cpu
    problem = C.shared_gpu_problem(world, torch.cuda.device_count()) if shared else None
    if problem:
        raise SystemExit(problem)
    if cpu:
        backend = "gloo"
        torch.set_num_threads(1)   # two ranks share the CPU: no oversubscription
    else:
        torch.cuda.set_device(C.gpu_of(local_rank, shared))
        backend = "gloo" if shared else "nccl"   # NCCL refuses two ranks on one GPU
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.dist_timeout_s))
    bench = Bench(args, rank, world, local_rank, cpu)
    out_dir = os.path.abspath(args.out)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    dist.barrier()
    mode = "cpu smoke" if cpu else ("gpu shared (dry run)" if shared else "gpu")
    bench.log(f"bench_dispatch_combine: mode={mode}, {world} ranks ({backend}), shapes {args.shape_names}, "
              f"{args.iters} timed calls after {args.warmup} warm-up, budget {args.budget:.0f}s")
    if cpu:
        bench.log("CPU SMOKE: tiny shapes, reference backend, correctness only -- times are no claims")
    if shared:
        bench.log("SHARED-GPU DRY RUN: the ranks time-slice one GPU, no NVLink -- times are no claims")
    info = C.env_info(args.argv, args.commit, world, backend)
    bench.probe_systems()
    if (bench.want("mok") or bench.want("mok_fp8")) and cpu and args.mok_backend == "auto":
        args.mok_backend = "reference"

    def snapshot(final=False):
        checks = gather_checks(bench)
        if rank != 0:
            return None
        doc = {
            "schema": C.SCHEMA,
            "mode": mode,
            "timing_claims": not (cpu or shared),
            "complete": final,
            "env": info,
            "config": {"shapes": args.shape_names, "systems": args.system_list, "iters": args.iters,
                       "warmup": args.warmup, "sm_sweep": args.sweep, "mok_backend": args.mok_backend,
                       "mok_num_sms": args.mok_num_sms, "deepep_sms": args.deepep_sms, "quick": args.quick,
                       "budget_s": args.budget,
                       "timing": ("per call: host clock after a barrier" if cpu else
                                  f"per call: CUDA events after a device barrier ({backend} all_reduce)")
                       + "; per-call MAX over ranks; median of those", "combine_tol": COMBINE_TOL},
            "peer_bandwidth": bench.peer_bw,
            "systems": bench.systems,
            "shapes": bench.shapes,
            "results": bench.results,
            "sm_sweep": bench.sm_sweep,
            "checks": checks,
            "checks_failed": [c for c in checks if not c["passed"]],
            "checks_passed": all(c["passed"] for c in checks) and len(checks) > 0,
            "skipped": bench.skipped,
            "wall_s": bench.log.elapsed(),
        }
        C.write_json(os.path.join(out_dir, RESULT_STEM + ".json"), doc)
        return doc

    bench.measure_peer_bw()
    # pass 1: the baselines on every shape; then the NVSHMEM children; pass 2: MoK
    baselines = [n for n in ("alltoall", "deepep") if bench.want(n)]
    for name in args.shape_names:
        if not baselines:
            break
        if bench.over_budget():
            bench.skip(f"shape {name} (baselines)", f"time budget {args.budget:.0f}s spent")
            continue
        bench.run_shape(C.SHAPES_BY_NAME[name], baselines)
        snapshot()
    if not (cpu or shared):
        bench.run_symm_phase(out_dir)
        snapshot()
    for name in args.shape_names:
        mok_systems = [n for n in ("mok", "mok_fp8") if bench.want(n)]
        if not mok_systems:
            break
        if bench.over_budget():
            bench.skip(f"shape {name} (mok)", f"time budget {args.budget:.0f}s spent")
            continue
        bench.run_shape(C.SHAPES_BY_NAME[name], mok_systems)
        snapshot()
    bench.refs.clear()
    bench.run_sm_sweep()
    doc = snapshot(final=True)
    if rank == 0:
        try:
            import plot_results
            paths = plot_results.render(doc, out_dir, RESULT_STEM)
            print("\n" + plot_results.summary_text(doc), flush=True)
            for k, v in paths.items():
                print(f"{k}: {v}", flush=True)
        except Exception:  # noqa: BLE001  (the JSON is already written)
            print("!!!! rendering the table/plot failed:\n" + traceback.format_exc(), flush=True)
        if not doc["checks_passed"]:
            print(f"\n!!!! {len(doc['checks_failed'])} CORRECTNESS CHECK(S) FAILED -- see 'checks_failed' in "
                  f"{os.path.join(out_dir, RESULT_STEM + '.json')}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _spawn_entry(local_rank, world, port, args, cpu):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    worker(local_rank, world, local_rank, args, cpu)


def main(argv=None):
    args = parse_args(argv)
    if args.phase == "symm":
        args = resolve_config(args, cpu=False)
        return symm_child(args)
    cpu = args.cpu or not torch.cuda.is_available()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:     # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return worker(rank, world, local_rank, args, cpu)
    if cpu:
        nproc = args.nproc or 2
    else:
        nproc = args.nproc or (2 if args.shared_gpu else min(2, torch.cuda.device_count()))
        if nproc < 1 or (nproc < 2 and args.nproc != 1):
            raise SystemExit("need at least 2 GPUs (or --nproc 1: one GPU, world size 1, no NVLink "
                             "traffic; --shared-gpu: a dry run of 2 ranks on one GPU; or --cpu for "
                             "the smoke test)")
    import torch.multiprocessing as mp
    mp.spawn(_spawn_entry, args=(nproc, C.free_port(), args, cpu), nprocs=nproc, join=True)


if __name__ == "__main__":
    main()

"""Shared pieces of the dispatch/combine benchmarks: safe environment, launch helpers,
seeded inputs, the contract oracle, exact NVLink byte counts, timing and JSON output.

Every rank builds every rank's routing (and, where a check needs it, every rank's tokens)
from one seed, so each rank knows its expected output without extra communication.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

# NVLink multicast can take a host's GPUs out of service on the lent machines: these three
# must be set before torch.distributed, NCCL, NVSHMEM or symmetric memory are touched.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def set_safe_env() -> None:
    """Force the no-multicast settings (overriding anything inherited)."""
    os.environ.update(SAFE_ENV)


set_safe_env()

import torch  # noqa: E402  (after the environment is fixed)
import torch.distributed as dist  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO_ROOT, "benchmarks")
DEFAULT_OUT = os.path.join(BENCH_DIR, "results")
SCHEMA = "mok-bench-dispatch-combine/1"


# ------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """One benchmark case. ``skew_hot``: number of hot experts (0 = uniform routing);
    ``skew_factor``: their target load over the mean; ``unrouted_frac``: share of slots
    set to -1 (exercised only by the CPU smoke shapes)."""

    name: str
    tokens: int
    hidden: int
    experts: int = 256
    topk: int = 8
    skew_hot: int = 0
    skew_factor: float = 0.0
    unrouted_frac: float = 0.0
    seed: int = 1234

    def describe(self) -> str:
        s = f"T={self.tokens} H={self.hidden} E={self.experts} K={self.topk}"
        if self.skew_hot:
            s += f" skew({self.skew_hot} hot ~{self.skew_factor:g}x)"
        if self.unrouted_frac:
            s += f" unrouted={self.unrouted_frac:g}"
        return s


GPU_SHAPES = [
    Shape("dsv3", 4096, 7168),
    Shape("t8192", 8192, 7168, seed=1235),
    Shape("h4096", 4096, 4096, seed=1236),
    Shape("t128", 128, 7168, seed=1237),
    Shape("t512", 512, 7168, seed=1238),
    Shape("t1024", 1024, 7168, seed=1239),
    Shape("skew", 4096, 7168, skew_hot=8, skew_factor=6.0, seed=1240),
]
QUICK_SHAPES = ["dsv3", "t128", "skew"]
CPU_SHAPES = [
    Shape("cpu_uniform", 48, 64, experts=8, topk=3, seed=11),
    Shape("cpu_unrouted", 40, 32, experts=8, topk=2, unrouted_frac=0.25, seed=12),
    Shape("cpu_skew", 64, 64, experts=8, topk=2, skew_hot=1, skew_factor=3.0, seed=13),
    Shape("cpu_tiny", 3, 16, experts=4, topk=2, seed=14),
]
SHAPES_BY_NAME = {s.name: s for s in GPU_SHAPES + CPU_SHAPES}


# ------------------------------------------------------------------------- environment
# A sleep kernel of this many cycles (~200 us at H200 clocks), queued before a timed graph
# replay's start event, keeps the GPU busy while the host launches the replay, so the events
# count device time only (benchmarks/NOTES.md (KK); longer than the launches of every rank's
# replay from one thread).
BUSY_CYCLES = 400_000


def parse_settings(text: str):
    """``"A=1,B=2;C=0;"`` -> ``[{"A": "1", "B": "2"}, {"C": "0"}, {}]`` (an empty item: defaults):
    the environment settings that the one-process A/B tools (scripts/profile_graph_chain.py,
    scripts/profile_host_calls.py) create one Buffer each under."""
    out = []
    for item in text.split(";"):
        env = {}
        for pair in filter(None, (p.strip() for p in item.split(","))):
            if "=" not in pair:
                raise ValueError(f"setting {pair!r} is not VAR=value")
            k, v = pair.split("=", 1)
            env[k.strip()] = v.strip()
        out.append(env)
    return out


def settings_label(env) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(env.items())) or "defaults"


class with_env:
    """``with with_env({"MOK_PDL": "0"}): buf = Buffer(...)``: the variables set inside, the
    previous values (or their absence) restored after. The backend reads its switches when a
    Buffer is created, so Buffers made under different settings live side by side."""

    def __init__(self, env):
        self.env = dict(env)

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        return False


def git_commit() -> str:
    # MOK_COMMIT wins: a lent GPU machine gets a copy of the working tree whose .git may be a
    # stale snapshot, so the launcher passes the commit it sent.
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode != 0:
            return "unknown (no git checkout)"
        commit = out.stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__})"


def env_info(command: List[str], commit_override: Optional[str], world_size: int,
             backend: str) -> Dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit_override or git_commit(),
        "command": " ".join(command),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "dist_backend": backend,
        "world_size": world_size,
        "gpu_model": None,
        "gpu_count": 0,
        "safe_env": {k: os.environ.get(k) for k in SAFE_ENV},
    }
    if torch.cuda.is_available():
        info["gpu_model"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        p = torch.cuda.get_device_properties(0)
        info["gpu_sms"] = p.multi_processor_count
        try:
            info["nccl_version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001
            info["nccl_version"] = None
    return info


def shared_gpu_problem(world: int, gpus: int) -> Optional[str]:
    """Why ``--shared-gpu`` (ranks as processes sharing the GPUs there are: a dry run) does not
    apply (``None``: it does): its labels say the ranks time-slice shared GPUs, which is only
    true with fewer GPUs than ranks."""
    if gpus < 1:
        return "--shared-gpu needs a CUDA GPU (use --cpu for the smoke test)"
    if gpus >= world:
        return (f"--shared-gpu is for fewer GPUs than ranks; here {gpus} GPU(s) for {world} ranks "
                "give each rank its own: run without it (a timed run)")
    return None


def gpu_of(local_rank: int, shared: bool) -> int:
    """A rank's GPU: its own, or in a shared-GPU dry run the one it shares (``r % GPUs``)."""
    return local_rank % torch.cuda.device_count() if shared else local_rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Progress:
    """Rank-0 progress lines with elapsed seconds, flushed at once."""

    def __init__(self, rank: int, t0: Optional[float] = None, prefix: str = ""):
        self.rank, self.t0, self.prefix = rank, t0 or time.perf_counter(), prefix

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str, all_ranks: bool = False) -> None:
        if self.rank == 0 or all_ranks:
            tag = f"[{self.elapsed():7.1f}s]{self.prefix}"
            if all_ranks:
                tag += f" r{self.rank}"
            print(f"{tag} {msg}", flush=True)


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, (torch.dtype, torch.device)):
        return str(o)
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return repr(o)


# ---------------------------------------------------------------------------- inputs
def _gen(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _seed(shape: Shape, rank: int, what: str) -> int:
    tag = {"route": 1, "weights": 2, "x": 3, "unrouted": 4, "grad_y": 5}[what]
    return (shape.seed * 1_000_003 + rank * 101 + tag) % (2 ** 62)


def skew_bias(shape: Shape) -> float:
    """Score bias of the hot experts so that each receives ~``skew_factor`` x the mean load
    under ``topk`` of uniform [0, 1) scores: a hot expert is picked with probability
    ~ factor*K/E, i.e. when its score + bias clears the (1 - K/E) quantile."""
    p_hot = min(0.95, shape.skew_factor * shape.topk / shape.experts)
    thresh = 1.0 - shape.topk / shape.experts
    return max(0.0, thresh - (1.0 - p_hot))


def hot_experts(shape: Shape, world: int) -> List[int]:
    """Hot experts sit on rank 0 (the first ones), so skew also unbalances the ranks."""
    return list(range(min(shape.skew_hot, shape.experts)))


def make_routing(shape: Shape, rank: int, world: int, device) -> tuple:
    """``(topk_idx [T,K] int64, topk_weights [T,K] float32)`` of ``rank``; same on any rank."""
    device = torch.device(device)
    T, E, K = shape.tokens, shape.experts, shape.topk
    scores = torch.rand(T, E, generator=_gen(device, _seed(shape, rank, "route")), device=device)
    if shape.skew_hot:
        scores[:, hot_experts(shape, world)] += skew_bias(shape)
    idx = scores.topk(K, dim=1).indices.to(torch.int64)
    if shape.unrouted_frac:
        drop = torch.rand(T, K, generator=_gen(device, _seed(shape, rank, "unrouted")),
                          device=device) < shape.unrouted_frac
        idx = idx.masked_fill(drop, -1)
    w = torch.rand(T, K, generator=_gen(device, _seed(shape, rank, "weights")), device=device)
    return idx.contiguous(), w.to(torch.float32).contiguous()


def make_x(shape: Shape, rank: int, device, dtype=torch.bfloat16) -> torch.Tensor:
    device = torch.device(device)
    x = torch.randn(shape.tokens, shape.hidden, generator=_gen(device, _seed(shape, rank, "x")),
                    device=device, dtype=torch.float32)
    return x.to(dtype).contiguous()


def make_grad_y(shape: Shape, rank: int, device, dtype=torch.bfloat16) -> torch.Tensor:
    device = torch.device(device)
    g = torch.randn(shape.tokens, shape.hidden, generator=_gen(device, _seed(shape, rank, "grad_y")),
                    device=device, dtype=torch.float32)
    return g.to(dtype).contiguous()


def expert_scale(num_experts: int, which: int, device) -> torch.Tensor:
    """Per-expert scale of the stand-in expert (exact in bf16: k/8 for small k)."""
    e = torch.arange(num_experts, device=device)
    if which == 0:
        return 0.5 + (e % 8).to(torch.float32) * 0.125
    return -1.0 + (e % 5).to(torch.float32) * 0.25 + 0.125


def expert_fn(rows: torch.Tensor, row_expert: torch.Tensor, num_experts: int, which: int = 0):
    """Stand-in expert: ``bf16(row * scale[expert])``; deterministic and computable on any
    rank from the source token, so combine can be checked exactly."""
    s = expert_scale(num_experts, which, rows.device)[row_expert]
    return (rows.float() * s[:, None]).to(rows.dtype)


# ------------------------------------------------------------------------------ oracle
@dataclass
class Layout:
    """Expected contract rows on one rank (see docs/CONTRACT.md, "Rows")."""

    src_rank: torch.Tensor       # [R] int64
    src_token: torch.Tensor      # [R] int64
    slot: torch.Tensor           # [R] int64 (k)
    local_expert: torch.Tensor   # [R] int64
    tokens_per_expert: torch.Tensor  # [E_local] int64

    @property
    def num_rows(self) -> int:
        return int(self.src_rank.numel())


def expected_layout(all_idx: List[torch.Tensor], rank: int, world: int, num_experts: int,
                    t_max: int) -> Layout:
    """Rows this rank must receive: local expert asc, then source rank, token, slot."""
    el = num_experts // world
    srcs, toks, ks, exps = [], [], [], []
    for s, idx in enumerate(all_idx):
        valid = (idx >= 0) & (torch.div(idx, el, rounding_mode="floor") == rank)
        t, k = valid.nonzero(as_tuple=True)
        srcs.append(torch.full_like(t, s))
        toks.append(t)
        ks.append(k)
        exps.append(idx[t, k] - rank * el)
    src, tok, k, e = (torch.cat(v).to(torch.int64) for v in (srcs, toks, ks, exps))
    K = all_idx[0].shape[1] if all_idx[0].dim() == 2 else 1
    key = ((e * world + src) * max(t_max, 1) + tok) * max(K, 1) + k
    order = torch.argsort(key, stable=True)
    tpe = torch.bincount(e, minlength=el)[:el].to(torch.int64)
    return Layout(src[order], tok[order], k[order], e[order], tpe)


def gather_rows(all_rows: List[torch.Tensor], layout: Layout) -> torch.Tensor:
    """``all_rows[src_rank[i]][src_token[i]]`` for every expected row."""
    if layout.num_rows == 0:
        return all_rows[0].new_empty((0, *all_rows[0].shape[1:]))
    out = all_rows[0].new_empty((layout.num_rows, *all_rows[0].shape[1:]))
    for s, rows in enumerate(all_rows):
        m = layout.src_rank == s
        if m.any():
            out[m] = rows.index_select(0, layout.src_token[m])
    return out


def gather_probs(all_w: List[torch.Tensor], layout: Layout) -> torch.Tensor:
    out = torch.empty(layout.num_rows, dtype=torch.float32, device=all_w[0].device)
    for s, w in enumerate(all_w):
        m = layout.src_rank == s
        if m.any():
            out[m] = w[layout.src_token[m], layout.slot[m]]
    return out


def contract_combine(x_own: torch.Tensor, idx_own: torch.Tensor, num_experts: int, world: int,
                     which: int = 0, partial_dtype=None) -> torch.Tensor:
    """Combine of the stand-in expert outputs, summed in the contract's exact order and
    rounding: per destination rank an fp32 sum (local expert asc, then k) rounded once to
    ``partial_dtype``; then the partials summed in rank order in fp32, rounded to x's dtype."""
    T, K = idx_own.shape
    H = x_own.shape[1]
    dtype = x_own.dtype
    partial_dtype = partial_dtype or dtype
    el = num_experts // world
    valid = idx_own >= 0
    e = idx_own.clamp(min=0)
    dest = torch.div(e, el, rounding_mode="floor")
    # Sort each token's slots by (global expert = dest rank, local expert; then k): the
    # contract's summation order. Unrouted slots go last and into a dummy rank `world`.
    karange = torch.arange(K, device=e.device)
    key = torch.where(valid, e * K + karange, torch.full_like(e, num_experts * K + K))
    order = torch.argsort(key, dim=1, stable=True)
    partial = torch.zeros(T, world + 1, H, dtype=torch.float32, device=x_own.device)
    scale = expert_scale(num_experts, which, x_own.device)
    xf = x_own.float()
    for j in range(K):
        kk = order[:, j:j + 1]
        ej = e.gather(1, kk)[:, 0]
        vj = valid.gather(1, kk)[:, 0]
        val = (xf * scale[ej][:, None]).to(dtype).float()
        dj = torch.where(vj, dest.gather(1, kk)[:, 0], torch.full_like(ej, world))
        # one element per (token, rank) per step: a plain sequential fp32 add in slot order
        partial.scatter_add_(1, dj[:, None, None].expand(T, 1, H), val[:, None, :])
    partial = partial[:, :world].to(partial_dtype).float()
    has = torch.zeros(T, world + 1, dtype=torch.bool, device=x_own.device)
    has.scatter_(1, torch.where(valid, dest, torch.full_like(dest, world)), True)
    acc = torch.zeros(T, H, dtype=torch.float32, device=x_own.device)
    for d in range(world):
        acc = torch.where(has[:, d, None], acc + partial[:, d], acc)
    return acc.to(dtype)


def exact_combine(x_own: torch.Tensor, idx_own: torch.Tensor, num_experts: int,
                  which: int = 0) -> torch.Tensor:
    """float64 sum of the stand-in expert outputs per token (the tolerance reference)."""
    valid = idx_own >= 0
    e = idx_own.clamp(min=0)
    scale = expert_scale(num_experts, which, x_own.device)
    acc = torch.zeros(x_own.shape, dtype=torch.float64, device=x_own.device)
    for k in range(idx_own.shape[1]):
        val = (x_own.float() * scale[e[:, k]][:, None]).to(x_own.dtype).double()
        acc += torch.where(valid[:, k, None], val, torch.zeros_like(val))
    return acc


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a64, r64 = a.double(), ref.double()
    if not torch.isfinite(a64).all():
        return float("inf")
    den = r64.norm().item()
    num = (a64 - r64).norm().item()
    return num / den if den > 0 else num


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits: floats compared as integers of their size, so -0.0 differs
    from +0.0 and a NaN equals the same NaN (``torch.equal`` says the opposite of both)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    if a.dtype.is_floating_point:
        it = _SAME_SIZE_INT[a.element_size()]
        return bool(torch.equal(a.contiguous().view(it), b.contiguous().view(it)))
    return bool(torch.equal(a, b))


# ------------------------------------------------------------------------ byte counts
def nvlink_bytes(all_idx: List[torch.Tensor], world: int, num_experts: int, hidden: int,
                 elem_bytes: int) -> Dict:
    """Token bytes that must cross between ranks, counted exactly from the routing.

    ``dedup[s][d]``: one copy per (token of s, destination rank d != s) -- what a
    per-rank deduplicating dispatcher (MoK, DeepEP) moves. ``copies[s][d]``: one copy per
    (token, expert on d != s) slot -- what Megatron's ``alltoall`` moves. Combine moves the
    same counts back. Metadata (indices, probs, counts) is not counted.
    """
    el = num_experts // world
    row = hidden * elem_bytes
    dedup = [[0] * world for _ in range(world)]
    copies = [[0] * world for _ in range(world)]
    for s, idx in enumerate(all_idx):
        valid = idx >= 0
        dest = torch.div(idx.clamp(min=0), el, rounding_mode="floor")
        for d in range(world):
            if d == s:
                continue
            hit = valid & (dest == d)
            dedup[s][d] = int(hit.any(dim=1).sum().item()) * row
            copies[s][d] = int(hit.sum().item()) * row

    def summary(m):
        out_b = [sum(m[s]) for s in range(world)]
        in_b = [sum(m[s][d] for s in range(world)) for d in range(world)]
        return {
            "matrix": m,
            "total": sum(out_b),
            "per_rank_out": out_b,
            "per_rank_in": in_b,
            # The busiest rank's busier direction bounds the time at a per-direction rate.
            "max_rank_direction": max(out_b + in_b) if world > 1 else 0,
        }

    return {"dedup": summary(dedup), "copies": summary(copies), "row_bytes": row}


def local_rows(all_idx: List[torch.Tensor], world: int, num_experts: int) -> List[int]:
    el = num_experts // world
    out = [0] * world
    for idx in all_idx:
        v = idx[idx >= 0]
        for d in range(world):
            out[d] += int(((v // el) == d).sum().item())
    return out


# ------------------------------------------------------------------------------ timing
def _barrier(group, device) -> None:
    if device.type == "cuda":
        # A device-side all_reduce: the current stream waits for it, so the start event of
        # the next call is recorded when every rank has arrived.
        t = torch.zeros(1, device=device)
        dist.all_reduce(t, group=group)
    else:
        dist.barrier(group=group)


def time_op(fn: Callable[[], object], group, device, iters: int, warmup: int,
            busy_cycles: int = 0) -> Dict:
    """Per-call time on the slowest rank: each call is timed on every rank (CUDA events,
    or the host clock on CPU) after a barrier; per call the MAX over ranks is taken; the
    median of those is reported. Host synchronisations inside ``fn`` are part of its time.
    ``busy_cycles`` (CUDA): a sleep kernel of that many cycles is queued after the barrier and
    before the start event, so the host's launch of ``fn`` happens while the GPU is busy and
    the events count device time only (graph replays: NOTES (KK))."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            _barrier(group, device)
            if busy_cycles:
                torch.cuda._sleep(busy_cycles)
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(device)
        own = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    else:
        own = []
        for _ in range(iters):
            _barrier(group, device)
            t0 = time.perf_counter()
            fn()
            own.append((time.perf_counter() - t0) * 1e6)
    t = torch.tensor(own, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    t_max = t.clone()
    dist.all_reduce(t_max, op=dist.ReduceOp.MAX, group=group)
    vals = sorted(t_max.tolist())
    return {
        "median_us": statistics.median(vals),
        "min_us": vals[0],
        "p10_us": vals[int(0.1 * (len(vals) - 1))],
        "p90_us": vals[int(0.9 * (len(vals) - 1))],
        "own_median_us": statistics.median(own),
        "iters": iters,
        "warmup": warmup,
    }


def all_ranks_ok(ok: bool, group, device) -> bool:
    """True only if ``ok`` on every rank (keeps ranks in step after a local failure)."""
    t = torch.tensor([0 if ok else 1], dtype=torch.int32,
                     device=device if torch.device(device).type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item()) == 0


def fmt_us(v) -> str:
    if v is None:
        return "—"
    if v >= 1000:
        return f"{v / 1000:.2f} ms"
    return f"{v:.1f} us"


@dataclass
class CheckLog:
    """Correctness checks: printed loudly on failure, all kept for the JSON."""

    rank: int
    items: List[Dict] = field(default_factory=list)

    def add(self, shape: str, system: str, name: str, passed: bool, detail: str = "") -> bool:
        self.items.append({"shape": shape, "system": system, "check": name,
                           "passed": bool(passed), "detail": detail, "rank": self.rank})
        if not passed:
            bar = "!" * 78
            print(f"\n{bar}\n!! CHECK FAILED (rank {self.rank}) {shape} / {system} / {name}: "
                  f"{detail}\n{bar}\n", flush=True)
        return passed

"""MoE dispatch/combine over torch symmetric memory's device-side all-to-all
(``torch.ops.symm_mem.all_to_all_vdev_2d`` / ``all_to_all_vdev_2d_offset``, NVSHMEM backend).

No host synchronisation: split sizes are exchanged on the device. Like Megatron's
``alltoall`` it moves one copy per (token, expert) slot; its output is already expert-major
(local expert, then source rank, then token), with ``major_align`` padding between experts.

dispatch: stable argsort of the flattened ``topk_idx`` by expert -> ``index_select`` of
the ``T*K`` rows into the symmetric input buffer -> ``bincount`` splits -> one
``all_to_all_vdev_2d`` for the tokens and one for the probs.
combine: ``all_to_all_vdev_2d_offset`` of the (padded, expert-major) expert outputs back to
the permuted order -> ``scatter_add_`` into ``[T, H]`` (as Megatron's ``unpermute``).

NVSHMEM and the CUDA symmetric-memory backend cannot share a process (the backend is fixed
at the first allocation), so the benchmark runs this system in child processes of its own.
Buffers are symmetric: every rank allocates the same sizes, taken from the routing that all
ranks know, so nothing has to be guessed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import Unavailable

MAJOR_ALIGN = 1


def check_available() -> None:
    """Raise :class:`Unavailable` with the reason when this system cannot run here."""
    if not torch.cuda.is_available():
        raise Unavailable("needs CUDA")
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"torch.distributed._symmetric_memory missing: {e}")
    for op in ("all_to_all_vdev_2d", "all_to_all_vdev_2d_offset"):
        if not hasattr(torch.ops.symm_mem, op):
            raise Unavailable(f"torch.ops.symm_mem.{op} not in torch {torch.__version__}")
    if not symm_mem.is_nvshmem_available():
        raise Unavailable("NVSHMEM is not available in this torch build/runtime")


@dataclass(eq=False)
class SymmResult:
    out_rows: torch.Tensor     # [rows_cap, H] view of the symmetric output (padded layout)
    out_probs: torch.Tensor    # [rows_cap] float32
    out_so: torch.Tensor       # [2, E] splits (row 0) / offsets (row 1), expert-major (e, src)
    tok: torch.Tensor          # [T*K] source token of each permuted row
    valid_sorted: torch.Tensor  # [T*K] whether permuted row j is routed
    num_tokens: int


class SymmA2A:
    """Owns the symmetric buffers (sized for the largest case) and runs dispatch/combine."""

    def __init__(self, group, num_experts: int, max_in_rows: int, max_out_rows: int,
                 max_hidden: int, device, dtype=torch.bfloat16):
        os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
        # NVSHMEM reads its heap size when it initialises (at the first allocation, or when
        # probed): make room for every buffer below, with margin, before anything touches it.
        elem = torch.tensor([], dtype=dtype).element_size()
        need = ((2 * max_in_rows + max_out_rows + num_experts * MAJOR_ALIGN) * max_hidden * elem
                + (max_in_rows + max_out_rows + num_experts * MAJOR_ALIGN) * 4 + (64 << 20))
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(int(need * 1.25) + (512 << 20)))
        check_available()
        import torch.distributed._symmetric_memory as symm_mem
        self.symm_mem = symm_mem
        try:
            symm_mem.set_backend("NVSHMEM")
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"symm_mem.set_backend('NVSHMEM') failed: {e}")
        self.group = group
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(self.group_name)
            except Exception:  # noqa: BLE001  (deprecated/no-op in newer torch)
                pass
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.E = num_experts
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_hidden = max_hidden
        self.max_in_rows = max_in_rows
        self.max_out_rows = max_out_rows + num_experts * MAJOR_ALIGN  # room for the padding
        dev = self.device
        # Flat element buffers, viewed per shape as [rows, H] (storage offset 0 each time).
        self.inp = symm_mem.empty(max_in_rows * max_hidden, dtype=dtype, device=dev)
        self.out = symm_mem.empty(self.max_out_rows * max_hidden, dtype=dtype, device=dev)
        self.comb = symm_mem.empty(max_in_rows * max_hidden, dtype=dtype, device=dev)
        self.pin = symm_mem.empty(max_in_rows, dtype=torch.float32, device=dev)
        self.pout = symm_mem.empty(self.max_out_rows, dtype=torch.float32, device=dev)
        self.in_splits = symm_mem.empty(num_experts, dtype=torch.int64, device=dev)
        self.out_so = symm_mem.empty((2, num_experts), dtype=torch.int64, device=dev)
        self.pout_so = symm_mem.empty((2, num_experts), dtype=torch.int64, device=dev)
        self.comb_so = symm_mem.empty((2, num_experts), dtype=torch.int64, device=dev)
        for t in (self.inp, self.out, self.comb, self.pin, self.pout, self.in_splits,
                  self.out_so, self.pout_so, self.comb_so):
            symm_mem.rendezvous(t, self.group_name)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> SymmResult:
        T, K = topk_idx.shape
        H = x.shape[1]
        n = T * K
        if n > self.max_in_rows or H > self.max_hidden:
            raise ValueError(f"SymmA2A buffers too small for T*K={n}, H={H}")
        flat = topk_idx.reshape(-1)
        key = torch.where(flat >= 0, flat, torch.full_like(flat, self.E))
        order = torch.argsort(key, stable=True)          # expert-major, token ascending
        tok = torch.div(order, K, rounding_mode="floor")
        inp = self.inp[: n * H].view(n, H)
        torch.index_select(x, 0, tok, out=inp)
        torch.index_select(topk_weights.reshape(-1), 0, order, out=self.pin[:n])
        self.in_splits.copy_(torch.bincount(key, minlength=self.E + 1)[: self.E])
        out = self.out[: self.max_out_rows * H].view(self.max_out_rows, H)
        torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, self.in_splits, self.out_so,
                                              self.group_name, major_align=MAJOR_ALIGN)
        torch.ops.symm_mem.all_to_all_vdev_2d(self.pin[:n], self.pout, self.in_splits, self.pout_so,
                                              self.group_name, major_align=MAJOR_ALIGN)
        return SymmResult(out, self.pout, self.out_so, tok, key.index_select(0, order) < self.E, T)

    # --------------------------------------------------------- helpers (untimed)
    def row_index(self, res: SymmResult) -> torch.Tensor:
        """Indices into ``res.out_rows`` of the real rows, in contract order."""
        so = res.out_so.cpu()
        idx = [torch.arange(int(so[1, c]), int(so[1, c]) + int(so[0, c])) for c in range(self.E)]
        return torch.cat(idx).to(self.device)

    def rows(self, res: SymmResult):
        ridx = self.row_index(res)
        el = self.E // self.world
        tpe = res.out_so[0].view(el, self.world).sum(dim=1)
        return res.out_rows.index_select(0, ridx), res.out_probs.index_select(0, ridx), tpe

    def place_expert_out(self, res: SymmResult, expert_out: torch.Tensor) -> None:
        """Write contract-order expert outputs into the padded output layout (in place)."""
        res.out_rows.index_copy_(0, self.row_index(res), expert_out)

    # ------------------------------------------------------------------- combine
    def combine(self, res: SymmResult) -> torch.Tensor:
        H = res.out_rows.shape[1]
        T, n = res.num_tokens, res.tok.numel()
        comb = self.comb[: n * H].view(n, H)
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(res.out_rows, comb, res.out_so, self.comb_so,
                                                     self.group_name)
        # rows past the routed ones (unrouted slots) land in a dummy token row T
        dst = torch.where(res.valid_sorted, res.tok, torch.full_like(res.tok, T))
        y = torch.zeros(T + 1, H, dtype=comb.dtype, device=comb.device)
        y.scatter_add_(0, dst.unsqueeze(1).expand(-1, H), comb)
        return y[:T]

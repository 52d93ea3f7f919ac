// megatron_mok/_host_ops: the host side of a static-shape dispatch, a cached dispatch and a
// combine (forward, or the backward's with prob gradients) as one C++ call each, and an eager
// dispatch's as two (before and after its host read of R) (benchmarks/NOTES.md items 75-77).
// Optional: built against the torch it will run with (megatron_mok/cuda/host_ops.py builds and
// loads it; scripts/setup.sh runs it); without it the CUDA backend does the same in Python.
//
// Why C++: a 128-token static dispatch's Python between the Buffer and the library call is ~27
// us of ~1-2 us operations (five torch.empty, four views, the ctypes conversion of 25
// arguments; NOTES items 72-74). Here each allocation is an at::empty and each view a C++ call.
//
// It links no MoK code: the library's functions come in as addresses taken from the loaded
// C library (ctypes), typed by mok_api.h's own declarations, so the C ABI stays the one
// interface and a changed signature breaks this build instead of its calls. Nothing here
// decides anything: roles, steps, modes and every check stay in the Python backend, which
// passes them in. A library error comes back as its return code (the backend raises with
// mok_last_error(), as for its own calls); a failed allocation raises torch's error.

#include <torch/extension.h>

#include <cstdint>

#include "mok_api.h"

namespace {

using DispatchLaunchFn = decltype(&mok_dispatch_launch);
using LayoutFn = decltype(&mok_dispatch_layout);
using CombineFn = decltype(&mok_combine);

// The C ABI version this file was compiled against: host_ops.py refuses a build whose version
// differs from the loaded library's (the addresses would be called with the wrong arguments).
constexpr int kAbiVersion = MOK_ABI_VERSION;

// torch.__version__ of the build (host_ops.py passes it): the loader refuses a build made for
// another torch, whose C++ ABI may differ without failing the import.
#ifndef MOK_TORCH_VERSION
#error "build with -DMOK_TORCH_VERSION=\"<torch.__version__>\" (megatron_mok/cuda/host_ops.py)"
#endif

// The backend's _ptr: an empty tensor's address is passed as null.
void* ptr_or_null(const at::Tensor& t) { return t.numel() ? t.data_ptr() : nullptr; }

// The library's row_bytes: one row of x ([T, H]).
int row_bytes_of(const at::Tensor& x) { return static_cast<int>(x.size(1) * x.element_size()); }

// Token rows [cap, H] of x's dtype on x's device (CudaBackend._rows_like).
at::Tensor token_rows(const at::Tensor& x, int64_t cap) {
  return at::empty({cap, x.size(1)}, at::TensorOptions().device(x.device()).dtype(x.scalar_type()));
}

// A dispatch's per-row outputs for `cap` rows on x's device (CudaBackend._rows_like and
// _row_outputs): token rows [cap, H] of x's dtype, probs [cap] f32, and the sources, two [cap]
// i64 rows (rank, token) of one [2, cap] tensor.
struct RowOutputs {
  at::Tensor tokens, probs, src;
  explicit RowOutputs(const at::Tensor& x, int64_t cap) {
    const auto on_dev = at::TensorOptions().device(x.device());
    tokens = token_rows(x, cap);
    probs = at::empty({cap}, on_dev.dtype(at::kFloat));
    src = at::empty({2, cap}, on_dev.dtype(at::kLong));
  }
  // The backend's _row_ptrs: null for no rows.
  int64_t* src_rank() const { return src.size(1) ? src.data_ptr<int64_t>() : nullptr; }
  int64_t* src_token() const { return src.size(1) ? src.data_ptr<int64_t>() + src.size(1) : nullptr; }
  float* probs_ptr() const { return static_cast<float*>(ptr_or_null(probs)); }
};


// A static-shape dispatch (CudaBackend._dispatch_static's Python path, which stays the
// reference): allocates every output for `cap` rows on x's device, queues `steps` through
// mok_dispatch_launch (one library call) and returns
//   (rc, tokens [cap, H] x.dtype, probs [cap] f32, src_rank [cap] i64, src_token [cap] i64,
//    tokens_per_expert [E] i64, num_rows_device [1] i64, rows_received [1] i64 or None
//    (drop_over_cap only), scratch [scratch_bytes] u8)
// src_rank / src_token are the rows of one [2, cap] tensor and the three count views slices
// of one [E + 2] tensor, as in Python. x: [T, H] rows, contiguous and 16-byte aligned (the
// backend's _rows did both); topk_idx int32 or int64, topk_weights float32, both [T, K].
py::tuple dispatch_static(uintptr_t fn, uintptr_t ctx, uintptr_t stream, int steps,
                          int64_t scratch_bytes, const at::Tensor& x, const at::Tensor& topk_idx,
                          const at::Tensor& topk_weights, int num_experts, int num_local_experts,
                          int64_t cap, int num_blocks, int num_producers, int transfer_mode,
                          int64_t rows_per_expert, bool drop_over_cap) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(x.dim() == 2, "x must be [T, H]");
  const auto on_dev = at::TensorOptions().device(x.device());
  at::Tensor scratch = at::empty({scratch_bytes}, on_dev.dtype(at::kByte));
  at::Tensor tpe = at::empty({num_local_experts + 2}, on_dev.dtype(at::kLong));
  const RowOutputs rows(x, cap);
  const at::Tensor idx = topk_idx.contiguous();
  const at::Tensor w = topk_weights.contiguous();
  int rc;
  {
    // ctypes drops the GIL around a foreign call; so does this (loopback ranks are threads).
    py::gil_scoped_release no_gil;
    rc = reinterpret_cast<DispatchLaunchFn>(fn)(
        reinterpret_cast<MokContext*>(ctx), reinterpret_cast<void*>(stream), steps,
        scratch.data_ptr(), ptr_or_null(idx), idx.scalar_type() == at::kLong ? 1 : 0,
        static_cast<const float*>(ptr_or_null(w)), static_cast<int>(x.size(0)), num_experts,
        tpe.data_ptr<int64_t>(), rows.src_rank(), rows.src_token(), rows.probs_ptr(), /*pad=*/1,
        ptr_or_null(x), /*x2=*/nullptr, ptr_or_null(rows.tokens), cap, num_blocks, num_producers,
        transfer_mode, rows_per_expert, row_bytes_of(x), /*two_sources=*/0, drop_over_cap ? 1 : 0);
  }
  const int64_t E = num_local_experts;
  return py::make_tuple(rc, rows.tokens, rows.probs, rows.src.select(0, 0), rows.src.select(0, 1),
                        tpe.narrow(0, 0, E), tpe.narrow(0, E, 1),
                        drop_over_cap ? py::cast(tpe.narrow(0, E + 1, 1)) : py::none(), scratch);
  END_HANDLE_TH_ERRORS_PYBIND
}

// An eager dispatch's first half (CudaBackend._dispatch_eager_ops; the Python path is
// CudaBackend._layout): scratch [scratch_bytes] u8 and the counts [E + 2] i64 allocated on x's
// device, mok_dispatch_layout queued (an eager call: no receive budget, drop_over_cap 0).
// Returns (rc, scratch, tokens_per_expert [E], num_rows_device [1]), the views the handle keeps.
// The host then reads R (Python), and dispatch_rows queues the rest.
py::tuple dispatch_layout(uintptr_t fn, uintptr_t ctx, uintptr_t stream, int64_t scratch_bytes,
                          const at::Tensor& x, const at::Tensor& topk_idx,
                          const at::Tensor& topk_weights, int num_experts, int num_local_experts,
                          int64_t cap, int64_t spec_cap, bool write_report,
                          int64_t rows_per_expert) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(x.dim() == 2, "x must be [T, H]");
  const auto on_dev = at::TensorOptions().device(x.device());
  at::Tensor scratch = at::empty({scratch_bytes}, on_dev.dtype(at::kByte));
  at::Tensor tpe = at::empty({num_local_experts + 2}, on_dev.dtype(at::kLong));
  const at::Tensor idx = topk_idx.contiguous();
  const at::Tensor w = topk_weights.contiguous();
  int rc;
  {
    py::gil_scoped_release no_gil;
    rc = reinterpret_cast<LayoutFn>(fn)(
        reinterpret_cast<MokContext*>(ctx), reinterpret_cast<void*>(stream), scratch.data_ptr(),
        ptr_or_null(idx), idx.scalar_type() == at::kLong ? 1 : 0,
        static_cast<const float*>(ptr_or_null(w)), static_cast<int>(x.size(0)), num_experts,
        tpe.data_ptr<int64_t>(), cap, spec_cap, write_report ? 1 : 0, rows_per_expert,
        row_bytes_of(x), /*two_sources=*/0, /*drop_over_cap=*/0);
  }
  const int64_t E = num_local_experts;
  return py::make_tuple(rc, scratch, tpe.narrow(0, 0, E), tpe.narrow(0, E, 1));
  END_HANDLE_TH_ERRORS_PYBIND
}

// An eager dispatch's second half (after the host knows the rows, `cap`): token rows
// [cap, H] x.dtype, probs [cap] f32 and sources (two [cap] i64 rows of one [2, cap] tensor)
// allocated, then `steps` (fill and transfer) queued by mok_dispatch_launch on the layout's
// `scratch`, without routing or counts (the layout has them). Returns (rc, tokens, probs,
// src_rank, src_token). CudaBackend._launch with idx, w and tpe None is the Python path.
py::tuple dispatch_rows(uintptr_t fn, uintptr_t ctx, uintptr_t stream, int steps,
                        const at::Tensor& scratch, const at::Tensor& x, int num_experts, int64_t cap,
                        int num_blocks, int num_producers, int transfer_mode,
                        int64_t rows_per_expert, bool drop_over_cap) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(x.dim() == 2, "x must be [T, H]");
  const RowOutputs rows(x, cap);
  int rc;
  {
    py::gil_scoped_release no_gil;
    rc = reinterpret_cast<DispatchLaunchFn>(fn)(
        reinterpret_cast<MokContext*>(ctx), reinterpret_cast<void*>(stream), steps,
        ptr_or_null(scratch), /*topk_idx=*/nullptr, /*idx_is_64=*/0, /*topk_weights=*/nullptr,
        static_cast<int>(x.size(0)), num_experts, /*tokens_per_expert=*/nullptr, rows.src_rank(),
        rows.src_token(), rows.probs_ptr(), /*pad=*/1, ptr_or_null(x), /*x2=*/nullptr,
        ptr_or_null(rows.tokens), cap, num_blocks, num_producers, transfer_mode, rows_per_expert,
        row_bytes_of(x), /*two_sources=*/0, drop_over_cap ? 1 : 0);
  }
  return py::make_tuple(rc, rows.tokens, rows.probs, rows.src.select(0, 0), rows.src.select(0, 1));
  END_HANDLE_TH_ERRORS_PYBIND
}

// A cached dispatch (CudaBackend.dispatch_cached's Python path; the combine's backward in
// training): token rows [cap, H] of x's dtype allocated, then `steps` (the transfer, after the
// copy-engine staging when on) queued by mok_dispatch_launch on the handle's `scratch`, without
// routing, counts or per-row outputs (the forward's layout and fill have them). `num_tokens`:
// the handle's (x's rows). Returns (rc, tokens).
py::tuple dispatch_cached(uintptr_t fn, uintptr_t ctx, uintptr_t stream, int steps,
                          const at::Tensor& scratch, const at::Tensor& x, int64_t num_tokens,
                          int num_experts, int64_t cap, int num_blocks, int num_producers,
                          int transfer_mode, int64_t rows_per_expert) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(x.dim() == 2, "x must be [T, H]");
  at::Tensor tokens = token_rows(x, cap);
  int rc;
  {
    py::gil_scoped_release no_gil;
    rc = reinterpret_cast<DispatchLaunchFn>(fn)(
        reinterpret_cast<MokContext*>(ctx), reinterpret_cast<void*>(stream), steps,
        scratch.data_ptr(), /*topk_idx=*/nullptr, /*idx_is_64=*/0, /*topk_weights=*/nullptr,
        static_cast<int>(num_tokens), num_experts, /*tokens_per_expert=*/nullptr,
        /*src_rank=*/nullptr, /*src_token=*/nullptr, /*probs=*/nullptr, /*pad=*/1, ptr_or_null(x),
        /*x2=*/nullptr, ptr_or_null(tokens), cap, num_blocks, num_producers, transfer_mode,
        rows_per_expert, row_bytes_of(x), /*two_sources=*/0, /*drop_over_cap=*/0);
  }
  return py::make_tuple(rc, tokens);
  END_HANDLE_TH_ERRORS_PYBIND
}

// A combine (CudaBackend.combine's Python path): y [T, hidden] of `y_dtype` on expert_out's
// device; with `grad_probs` ([R] prob gradients: the dispatch's backward) also grad_w [T, topk]
// f32, and the gradients as float32 and contiguous (a copy only where they are not), an empty
// one replaced by one zero (a rank with no rows must still pass a pointer: null means "no prob
// gradients", and its peers would then read stale side values; the fuzzer's s36-2 case). Then
// mok_combine. Returns (rc, y, grad_w or None).
py::tuple combine(uintptr_t fn, uintptr_t ctx, uintptr_t stream, uintptr_t scratch,
                  const at::Tensor& expert_out, int64_t num_tokens, at::ScalarType y_dtype,
                  int64_t row_cap, int dtype_code, int partial_code, int num_blocks,
                  int num_producers, const std::optional<at::Tensor>& grad_probs, int64_t topk) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(expert_out.dim() == 2, "expert_out must be [R, H]");
  const int64_t hidden = expert_out.size(1);
  at::Tensor y = at::empty({num_tokens, hidden}, expert_out.options().dtype(y_dtype));
  at::Tensor grad_w, probs;
  if (grad_probs.has_value()) {
    const auto f32 = expert_out.options().dtype(at::kFloat);
    grad_w = at::empty({num_tokens, topk}, f32);
    probs = grad_probs->to(at::kFloat).contiguous();
    if (probs.numel() == 0) probs = at::zeros({1}, f32);
  }
  int rc;
  {
    py::gil_scoped_release no_gil;
    rc = reinterpret_cast<CombineFn>(fn)(
        reinterpret_cast<MokContext*>(ctx), reinterpret_cast<void*>(stream),
        reinterpret_cast<void*>(scratch), ptr_or_null(expert_out),
        probs.defined() ? static_cast<const float*>(probs.data_ptr()) : nullptr,
        static_cast<int>(num_tokens), ptr_or_null(y),
        grad_w.defined() ? static_cast<float*>(ptr_or_null(grad_w)) : nullptr, row_cap,
        dtype_code, partial_code, num_blocks, num_producers, static_cast<int>(hidden));
  }
  return py::make_tuple(rc, y, grad_w.defined() ? py::cast(grad_w) : py::none());
  END_HANDLE_TH_ERRORS_PYBIND
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_mok host ops: the host side of MoK's dispatches and combines in C++";
  m.attr("abi_version") = kAbiVersion;
  m.attr("torch_version") = MOK_TORCH_VERSION;
  m.def("dispatch_static", &dispatch_static);
  m.def("dispatch_layout", &dispatch_layout);
  m.def("dispatch_rows", &dispatch_rows);
  m.def("dispatch_cached", &dispatch_cached);
  m.def("combine", &combine);
}

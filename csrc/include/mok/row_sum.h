// Row sums of the combine: a lane reduces U groups of 8 elements of a task's rows in fp32, in
// row order, from +0.0 (the contract's order). Shared by the combine kernel and the SM-ceiling
// microbenchmark (benchmarks/micro), which measures this exact loop.
#pragma once

#include "device.h"

namespace mok {

constexpr int U = kCombineUnroll;  // 8-element groups per lane per step

template <int kU>
__device__ __forceinline__ void zero(float (&a)[kU][kCombineVec]) {
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int e = 0; e < kCombineVec; ++e) a[u][e] = 0.f;
}

__device__ __forceinline__ bool group_live(int v0, int u, int H) {
  return v0 + u * kWarpSize * kCombineVec < H;
}

// acc += the task's rows (in row order) at groups v0 + u*256. Loads go out kRows rows at a
// time, all before their adds, so kRows * U loads per lane are in flight.
template <typename T, int kRows, int kU>
__device__ __forceinline__ void sum_rows(float (&acc)[kU][kCombineVec], const T* base,
                                         const int32_t* rows, int K, int64_t row_cap, int v0, int H) {
  for (int k0 = 0; k0 < K; k0 += kRows) {
    Raw8<T> raw[kRows][kU];
    bool live[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = k0 + r < K ? rows[k0 + r] : -1;
      live[r] = row >= 0 && row < row_cap;
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (live[r] && group_live(v0, u, H))
          load_raw(raw[r][u], base + static_cast<size_t>(row) * H + v0 + u * kWarpSize * kCombineVec);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (live[r] && group_live(v0, u, H)) add_raw<T>(acc[u], raw[r][u]);
    if (!live[kRows - 1]) break;  // rows are packed first: a dead slot ends the list
  }
}

// Rows of one task held in registers: a task of a top-K token with K <= kHeldRows has at most
// kHeldRows rows here. Loading the ids once per task (not once per step, as sum_rows must)
// keeps every step's data loads independent of any other load (benchmarks/NOTES.md #11).
constexpr int kHeldRows = 8;

struct HeldRows {
  int row[kHeldRows];  // packed: live rows first, -1 after
  int n;               // live rows
  __device__ __forceinline__ void load(const int32_t* rows, int K) {
    n = 0;
#pragma unroll
    for (int r = 0; r < kHeldRows; ++r) {
      row[r] = r < K ? rows[r] : -1;
      n += row[r] >= 0;
    }
  }
};

// acc += the held rows (row order) at groups v0 + u*256, kBatch rows' loads in flight at once.
// Rows at or past row_cap (static-shape overflow, reported elsewhere) are skipped.
template <typename T, int kBatch, int kU>
__device__ __forceinline__ void sum_held_rows(float (&acc)[kU][kCombineVec], const T* base,
                                              const HeldRows& h, int64_t row_cap, int v0, int H) {
#pragma unroll
  for (int b = 0; b < kHeldRows; b += kBatch) {
    if (b >= h.n) break;
    Raw8<T> raw[kBatch][kU];
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      const bool live = b + r < h.n && h.row[b + r] < row_cap;
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (live && group_live(v0, u, H))
          load_raw(raw[r][u], base + static_cast<size_t>(h.row[b + r]) * H + v0 + u * kWarpSize * kCombineVec);
    }
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      const bool live = b + r < h.n && h.row[b + r] < row_cap;
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (live && group_live(v0, u, H)) add_raw<T>(acc[u], raw[r][u]);
    }
  }
}

}  // namespace mok

// Included only from kernels/combine_transfer.cu; uses only the mok/ headers.
// Holds the shared-memory row stream: RowStream, WarpRing, StreamIssue, stream_rows.
#pragma once

namespace mok {
namespace {

// Shared memory of the consume loop (and of the streamed produce phase before it): per warp,
// a ring of row slots. A slot holds one row's (expert row or remote partial) data for one
// piece: kConsumeUnroll groups x 32 lanes x 16 B per bf16 group (32 B when the tokens or the
// partials are fp32). 16 warps x 14 KB = 224 KB.
template <typename T, typename P>
struct RowStream {
  static constexpr int kVecs = Raw8<T>::kVecs > Raw8<P>::kVecs ? Raw8<T>::kVecs : Raw8<P>::kVecs;
  static constexpr int kSlotInt4 = kConsumeUnroll * kWarpSize * kVecs;  // 16-byte words per slot
  static constexpr int kWarpBytes = 14 * 1024;
  static constexpr int kSlots = kWarpBytes / (kSlotInt4 * 16);  // 14 (16-bit data) or 7 at 2 groups
  // Own rows a token may have for them to be streamed (with its partial, within the ring).
  static constexpr int kMaxOwn = kHeldRows < kSlots - 1 ? kHeldRows : kSlots - 1;
  static constexpr size_t kSmemBytes = static_cast<size_t>(kCombineThreads / kWarpSize) * kWarpBytes;
};

// cp.async.wait_group takes an immediate: wait until at most `n` groups are pending (above 7
// it waits for 7, and below 0 for all: both only wait longer).
__device__ __forceinline__ void cp_async_wait_at_most(int n) {
  switch (n) {
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default:
      if (n >= 7) cp_async_wait<7>();
      else cp_async_wait<0>();
      break;
  }
}

// A warp's ring of RowStream slots in shared memory, as this lane's shared-memory addresses: a
// slot's group u starts kGroupBytes * u after the lane's address of the slot. Each side of a
// stream walks the ring with one 32-bit address (next), so a load or copy costs no address
// arithmetic beyond an immediate offset (the index-based version spent ~5 instructions per
// load: NOTES.md #24). Used by the consume loop and by the streamed produce phase.
template <typename T, typename P>
struct WarpRing {
  using RS = RowStream<T, P>;
  static constexpr int kSlots = RS::kSlots;
  static constexpr unsigned kSlotBytes = RS::kSlotInt4 * 16;
  static constexpr unsigned kGroupBytes = kWarpSize * RS::kVecs * 16;
  unsigned begin, end;
  __device__ explicit WarpRing(int4* smem) {
    begin = static_cast<unsigned>(__cvta_generic_to_shared(
                smem + static_cast<size_t>(threadIdx.x / kWarpSize) * kSlots * RS::kSlotInt4)) +
            (threadIdx.x % kWarpSize) * RS::kVecs * 16;
    end = begin + kSlots * kSlotBytes;
  }
  // The address n slots after `addr` (n <= kSlots), wrapped.
  __device__ unsigned next(unsigned addr, int n) const {
    addr += n * kSlotBytes;
    return addr >= end ? addr - kSlots * kSlotBytes : addr;
  }
  // Copies one piece (kConsumeUnroll groups at element v0 of this lane) of each of n rows into
  // the n slots from `dst`: lane r's `lane_base` is row r's address, so a row's copies are a
  // shuffle, one 64-bit add and unpredicated cp.asyncs with immediate offsets (dead groups are
  // zero-filled). E: the rows' element type (T for expert rows, P for staged partials). Returns
  // the slot after them.
  template <typename E = T>
  __device__ unsigned copy_rows(unsigned dst, unsigned long long lane_base, int n, int v0, int H) const {
    constexpr int Uc = kConsumeUnroll;
    const unsigned voff = static_cast<unsigned>(v0) * sizeof(E);  // a row is far shorter than 4 GiB
    bool live[Uc];
#pragma unroll
    for (int u = 0; u < Uc; ++u) live[u] = group_live(v0, u, H);
    for (int j = 0; j < n; ++j) {
      const char* row = reinterpret_cast<const char*>(__shfl_sync(0xffffffffu, lane_base, j)) + voff;
#pragma unroll
      for (int u = 0; u < Uc; ++u) {
        const int4* src = reinterpret_cast<const int4*>(row + u * kWarpSize * kCombineVec * sizeof(E));
#pragma unroll
        for (int w = 0; w < Raw8<E>::kVecs; ++w) cp_async_16_shared_if(dst + u * kGroupBytes + 16 * w, src + w, live[u]);
      }
      dst = next(dst, 1);
    }
    return dst;
  }
  // acc += the n rows' piece in the n slots from `src` (row order). Every group is summed, live
  // or not: a dead group's words were zero-filled by its copy and its sums are never stored, so
  // the loop needs no branch per group. E as in copy_rows. Returns the slot after them.
  template <typename E = T>
  __device__ unsigned sum_rows(float (&acc)[kConsumeUnroll][kCombineVec], unsigned src, int n) const {
    for (int j = 0; j < n; ++j) {
#pragma unroll
      for (int u = 0; u < kConsumeUnroll; ++u) {
        Raw8<E> r;
        load_raw_shared(r, src + u * kGroupBytes);
        add_raw<E>(acc[u], r);
      }
      src = next(src, 1);
    }
    return src;
  }
};

// The issue side of a warp's stream: the next piece is step `st` of item `k` (a task or a token of
// S steps), `ahead` pieces are issued and not yet summed, the ring's free slots start at `addr`.
struct StreamIssue {
  int k = 0, st = 0, ahead = 0, free_slots;
  unsigned addr;
  template <typename Ring>
  __device__ explicit StreamIssue(const Ring& ring) : free_slots(Ring::kSlots), addr(ring.begin) {}
  // Copies the next piece of n rows (lane j: row j's address) of element type E, commits it as
  // one group and moves on to the following piece.
  template <typename E, typename Ring>
  __device__ __forceinline__ void piece(const Ring& ring, unsigned long long lane_base, int n, int S, int H) {
    addr = ring.template copy_rows<E>(addr, lane_base, n, st * kWarpSize * kCombineVec * kConsumeUnroll +
                                                               static_cast<int>(threadIdx.x % kWarpSize) * kCombineVec, H);
    cp_async_commit();
    free_slots -= n;
    ++ahead;
    if (++st == S) {
      st = 0;
      ++k;
    }
  }
};

// The own rows of one of my tokens as the stream takes them, read by the whole warp at once:
// lane r gets row r in `lane_row`. The live rows (0 <= row < row_cap) are a prefix (rows are
// packed first and ascend), so these are the rows sum_rows adds, in its order. Returns their
// count, or -1 when there are more than kMax (then they are summed from global memory).
template <int kMax>
__device__ __forceinline__ int stream_rows(const int32_t* rows, int K, int64_t row_cap, int& lane_row) {
  const int lane = threadIdx.x % kWarpSize;
  lane_row = rows != nullptr && lane < K ? rows[lane] : -1;
  const bool live = lane_row >= 0 && lane_row < row_cap;
  const unsigned dead = __ballot_sync(0xffffffffu, !live);
  const int n = dead == 0 ? kWarpSize : __ffs(dead) - 1;
  return n > kMax ? -1 : n;
}

}  // namespace
}  // namespace mok

// Slot reuse and publication on a staging ring (dispatch and combine rings share these).
// A slot is overwritten only after every reader of its previous generation released it; the
// check happens here, right before the overwrite, so a ring that never wraps never waits.
#pragma once

#include "device.h"

namespace mok {

// Ring slots of one call's chunks: chunk k of call `seq` (k < chunks per call, cpc) has generation
// seq * cpc + k and lives in slot (seq * cpc + k) % N. The 64-bit product's remainder is taken
// once per call (start); per chunk it is 32-bit arithmetic, because a 64-bit remainder is a
// ~70-instruction subroutine call (benchmarks/NOTES.md #22 found several per token in a loop).
struct CallSlots {
  int N;          // chunks in the ring
  uint32_t base;  // (seq * cpc) % N

  __device__ void start(uint64_t seq, int64_t cpc) {
    base = static_cast<uint32_t>((seq * static_cast<uint64_t>(cpc)) % static_cast<uint64_t>(N));
  }
  __device__ int slot(int k) const {
    uint32_t x = base + static_cast<uint32_t>(k);  // < N + cpc
    const uint32_t n = static_cast<uint32_t>(N);
    if (x >= n) x -= n;
    if (x >= n) x %= n;  // only when a call spans more than the ring
    return static_cast<int>(x);
  }
};

// Warp-wide (every lane calls it): wait until the readers of generation `gen[slot]` (the
// slot's previous content) released it. False on timeout/abort: the caller stops. `g` (the
// generation about to be written) and `what` only label an error report. Used directly where
// warps of many blocks write rows of one slot (the phased combine): each checks before its
// first write.
__device__ inline bool ring_slot_acquire_warp(const CommContext& c, const RingView& r, int64_t slot,
                                              uint64_t g, int32_t what) {
  const uint64_t prev = r.gen[slot], prev_readers = r.readers[slot];
  bool ok = true;
  if (prev != 0)
    for (int reader = threadIdx.x % kWarpSize; reader < c.world; reader += kWarpSize)
      if ((prev_readers >> reader) & 1)
        ok = ok && wait_geq(c, r.released + static_cast<size_t>(reader) * r.num_chunks + slot, prev,
                            reader, what, static_cast<int64_t>(g));
  // A vote orders no memory: the warp barrier puts every lane's acquire before every lane's
  // stores into the slot that follow (session 29's memory-model review, B2; free).
  __syncwarp();
  return __all_sync(0xffffffffu, ok);
}

// Block-wide (every thread of the block calls it): the same check, made by warp 0 for the
// block (a slot that belongs to one block).
__device__ inline bool ring_slot_acquire(const CommContext& c, const RingView& r, int64_t slot,
                                         uint64_t g, int32_t what) {
  __shared__ int ok;
  if (threadIdx.x < kWarpSize) {
    const bool res = ring_slot_acquire_warp(c, r, slot, g, what);
    if (threadIdx.x == 0) ok = res;
  }
  __syncthreads();
  const bool res = ok != 0;
  __syncthreads();  // `ok` is reused by the next call
  return res;
}

// The grid's last warp, before it releases every chunk its call read (calls that fit in the
// ring release once per call): false after an error (some reads never ran, so nothing is
// released; the Buffer is unusable anyway). Otherwise every lane's release stores after it come
// after lane 0 saw the grid's last count (the warp barrier orders them) and after the other
// warps' fences that preceded their counts.
__device__ inline bool begin_call_release(const CommContext& c) {
  if (__shfl_sync(0xffffffffu, aborted(c) ? 1 : 0, 0)) return false;  // one answer for the warp
  __syncwarp();
  __threadfence_system();
  return true;
}

// One thread, after the block's writes to the slot (and a __syncthreads): record generation g
// and its readers (for the next reuse check), then publish the slot with one release store of
// `ready` (g + 1 on the combine ring; dispatch_ready(g, ...) on the dispatch ring).
__device__ inline void ring_slot_publish(const RingView& r, int64_t slot, uint64_t g, uint64_t readers,
                                         uint64_t ready) {
  r.gen[slot] = g + 1;
  r.readers[slot] = readers;
  __threadfence_system();
  st_release_sys(r.ready + slot, ready);
}
__device__ inline void ring_slot_publish(const RingView& r, int64_t slot, uint64_t g, uint64_t readers) {
  ring_slot_publish(r, slot, g, readers, g + 1);
}

// A dispatch ring slot's `ready` value carries, beside its generation, the row format of the
// call that staged it (config.h, row_format: size in 16-byte vectors, one source or two):
// (g + 1) << kRowTagBits | row_format. A consumer waits for dispatch_ready_min(g) and compares
// the tag with its own format, so a rank whose peer staged rows of another size or layout (an
// FP8 pair against tokens, also in a cached dispatch, which runs no layout to compare them)
// reports a configuration mismatch instead of reading rows at the wrong pitch. The value that
// ends a wait is exactly generation g's (a slot is not staged again before its readers release
// it), so the check costs no load. Rows are under kMaxRowBytes (mok_create checks).
constexpr uint64_t kRowTagMask = (1ull << kRowTagBits) - 1;
__device__ inline uint64_t dispatch_ready(uint64_t g, int32_t row_format) {
  return ((g + 1) << kRowTagBits) | static_cast<uint64_t>(row_format);
}
__device__ inline uint64_t dispatch_ready_min(uint64_t g) { return (g + 1) << kRowTagBits; }
// The row format staged with a dispatch slot whose wait ended on `ready`.
__device__ inline int32_t dispatch_ready_format(uint64_t ready) { return static_cast<int32_t>(ready & kRowTagMask); }
// What a producer stores in its dispatch slots' `ready` when its copy-engine staging is about to
// run without the slots' previous readers having released them (it aborted, or the check timed
// out: a kernel cannot cancel the copy queued behind it; NOTES item 37, B1). Above every
// generation, so a reader's wait for any generation ends on it; no row format has this tag, so
// the reader reports kPeerStopped instead of reading rows the copy may be overwriting.
constexpr uint64_t kReadyPoisoned = ~0ull;

// A flag read without waiting: is what it guards published (generation `target` or later), and
// not poisoned?
__device__ inline bool is_published(uint64_t v, uint64_t target) { return v >= target && v != kReadyPoisoned; }

// A wait for a peer's published flag (its routing slot's meta_ready, a combine ring slot's ready:
// generation + 1) that also recognises the poison of a peer that stopped after an error of its
// own (kernels/stop_rank.cu): wait_geq ends on it, as it is above every generation, and the
// caller must not read what the flag guards. Then this reports kPeerStopped (peer, `what`, the
// generation waited for) and returns false, as after a timeout. The dispatch ring's readers
// compare the value they saw themselves (it also carries the row format).
__device__ inline bool wait_published(const CommContext& c, const uint64_t* flag, uint64_t target,
                                      int32_t peer, int32_t what, int64_t detail) {
  uint64_t v;
  if (!wait_geq(c, flag, target, peer, what, detail, &v)) return false;
  if (v != kReadyPoisoned) return true;
  report_error(c, kPeerStopped, peer, what, detail);
  return false;
}

}  // namespace mok

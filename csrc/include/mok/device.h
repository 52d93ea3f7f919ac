// Device helpers shared by the kernels: spin-waits that time out and report, and the
// 8-element load/store/convert used by the combine sums.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdio>

#include "config.h"
#include "ptx.h"
#include "workspace.h"

namespace mok {

// Everything a kernel needs to reach any rank's workspace. Passed by value.
struct PeerTable {
  char* base[kMaxRanks];
};

struct CommContext {
  Workspace ws;
  PeerTable peers;
  int32_t rank;
  int32_t world;
  uint64_t timeout_ns;
  // Host side only: launch this context's kernels with programmatic dependent launch (PDL,
  // launch_kernel in launch.h). Off for loopback groups (megatron_mok/cuda/backend.py), where
  // ranks are streams of one GPU: a rank's early-resident blocks could hold the SMs a peer
  // rank's kernel needs to make progress.
  int32_t pdl;

  __host__ __device__ char* local() const { return peers.base[rank]; }
  __device__ ErrorReport* error() const { return ws.error_at(local()); }
  __device__ SeqCounters* counters() const { return ws.counters_at(local()); }
};

// Blocks [first, first + count) of a transfer kernel's grid play one role (produce or
// consume); a block may play both in turn (the phased combine).
struct Role {
  int first, count;
  __device__ int index() const { return static_cast<int>(blockIdx.x) - first; }
};

// Diagnostics: block b's first-warp start and last-warp end (globaltimer ns) of the latest
// transfer kernel, in the workspace's trace region; read by CudaBackend.read_trace().
__device__ inline void trace_warp(const CommContext& c, bool start) {
  if (threadIdx.x % kWarpSize != 0 || blockIdx.x >= kTraceBlocks) return;
  unsigned long long* tr = reinterpret_cast<unsigned long long*>(c.local() + c.ws.trace) + 2 * blockIdx.x;
  const unsigned long long now = globaltimer_ns();
  if (start) {
    if (threadIdx.x == 0) tr[0] = now;
  } else {
    atomicMax(&tr[1], now);
  }
}

// Diagnostics: the end of a block's first phase (phased kernels), in trace row
// kTraceBlocks / 2 + block (so only for grids of up to kTraceBlocks / 2 blocks).
__device__ inline void trace_phase_end(const CommContext& c) {
  if (threadIdx.x % kWarpSize != 0 || blockIdx.x >= kTraceBlocks / 2) return;
  unsigned long long* tr = reinterpret_cast<unsigned long long*>(c.local() + c.ws.trace) +
                           2 * (kTraceBlocks / 2 + blockIdx.x);
  atomicMax(&tr[1], globaltimer_ns());
}

// Diagnostics (MOK_LAYOUT_STAMPS builds): thread 0 of the block writes the globaltimer (ns) as
// stamp `k` of its block in the trace region's second half (stamp builds make it twice as large):
// words 512 + [region * 256 + block * kStampsPerBlock + k]
// (region 0: the layout kernels, 1: the fill; blocks numbered x-fastest over the grid; only
// the first 16 blocks of each). Call it where every thread of the block passes (it syncs
// nothing itself). Compiled out of normal builds.
enum LayoutStamp {
  kStEntry = 0,          // after the PDL wait
  kStPubSlotFree = 1,    // publish: the routing slot's previous readers are done
  kStPubCopied = 2,      // publish: my chunk's routing copied (and the token masks built)
  kStPubSendScan = 3,    // publish: the send-side positions written, before the arrival
  kStPubPrefix = 4,      // publish (last block): the chunk prefixes written
  kStPubReleased = 5,    // publish (last block): the release store
  kStCountReady = 6,     // count: the source's routing is ready
  kStCountCopied = 7,    // count: the chunk's ids in shared memory
  kStCountDone = 8,      // count: histogram written, before the arrival
  kStScanRows = 9,       // scan (last block): rows scanned
  kStScanTasks = 10,     // scan: tasks scanned
  kStScanEnd = 11,       // scan: totals written
  kStFillLoaded = 1,     // fill: the experts' first rows loaded
  kStFillRows = 2,       // fill: phase 1 (rows) done
  kStFillTasks = 3,      // fill: phase 2 (tasks) done
  kStFillReleased = 4,   // fill: the routing release (its arrival) done
  kStFillEnd = 5,        // fill: padding rows written
};
__device__ inline void layout_stamp(const CommContext& c, int region, int k) {
  if constexpr (kLayoutStamps) {
    const int b = static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x);
    if (threadIdx.x != 0 || b >= 256 / kStampsPerBlock) return;
    unsigned long long* tr = reinterpret_cast<unsigned long long*>(c.local() + c.ws.trace) + 2 * kTraceBlocks;
    tr[region * 256 + b * kStampsPerBlock + k] = globaltimer_ns();
  }
}

// Diagnostics (MOK_DISPATCH_CLOCKS builds): what a pulling warp's cycles went to. Trace row
// kTraceBlocks - kDClockKinds + kind holds {sum of cycles, number of warps}; those rows are free
// when the grid has at most kTraceBlocks / 2 - kDClockKinds blocks (phase ends use rows
// kTraceBlocks / 2 + b).
enum DispatchClock {
  kDClockSetupLocal = 0,   // task lookup of a local task (index loads)
  kDClockSetupRemote = 1,  // the same for a remote task, its chunk's ready flag included
  kDClockLoadLocal = 2,    // from issuing a round's loads to their arrival, local source
  kDClockLoadRemote = 3,   // the same over NVLink
  kDClockStore = 4,        // issuing a round's stores
  kDClockTotal = 5,
  kDClockKinds = 6
};
// Lane 0 of a warp adds `cycles` to trace row kTraceBlocks - n_kinds + kind ({sum of cycles,
// number of warps}); only for grids that leave those rows free (phase ends use rows
// kTraceBlocks / 2 + b).
__device__ inline void clock_row_add(const CommContext& c, int n_kinds, int kind, long long cycles) {
  if (threadIdx.x % kWarpSize != 0 || static_cast<int>(gridDim.x) > kTraceBlocks / 2 - n_kinds) return;
  unsigned long long* row =
      reinterpret_cast<unsigned long long*>(c.local() + c.ws.trace) + 2 * (kTraceBlocks - n_kinds + kind);
  atomicAdd(&row[0], static_cast<unsigned long long>(cycles));
  atomicAdd(&row[1], 1ull);
}
__device__ inline void dispatch_clock_add(const CommContext& c, int kind, long long cycles) {
  clock_row_add(c, kDClockKinds, kind, cycles);
}

// Diagnostics (MOK_CONSUME_CLOCKS builds): what a combine consume warp's cycles went to.
enum ConsumeClock {
  kCClockTokenSetup = 0,   // a token's rows, positions and lane cache (its partial wait excluded)
  kCClockPartialWait = 1,  // waiting until the token's remote partials are staged
  kCClockIssue = 2,        // try_issue: planning tokens ahead and issuing their pieces' copies
  kCClockCopyWait = 3,     // cp.async.wait_group for the piece about to be summed
  kCClockOwnSum = 4,       // summing the own rows from shared memory and rounding the partial
  kCClockRankSum = 5,      // the rank-order sum, y stores, handing the slots back
  kCClockTokenTail = 6,    // prob gradients and the per-token release (when not at the end)
  kCClockTotal = 7,
  kCClockKinds = 8
};

// Called once per warp when it has finished its share of a kernel: the last warp of the grid
// advances the call number `seq`. No block barrier, so warps that stopped early on an error
// simply never count (the Buffer is unusable after an error anyway).
// Returns true, in every lane, in the grid's last warp.
__device__ inline bool warp_done_advance(uint32_t* warps_done, uint64_t* seq, uint64_t* seq2 = nullptr) {
  __syncwarp();
  int last = 0;
  if (threadIdx.x % kWarpSize == 0) {
    const uint32_t total = gridDim.x * gridDim.y * (blockDim.x / kWarpSize);
    __threadfence();
    if (atomicAdd(warps_done, 1u) + 1 == total) {
      *warps_done = 0;
      *seq += 1;
      if (seq2 != nullptr) *seq2 += 1;
      __threadfence();
      last = 1;
    }
  }
  return __shfl_sync(0xffffffffu, last, 0) != 0;
}

// The same for a kernel whose blocks finish as a whole: called by every thread after a block
// barrier, one arrival per block. Returns true, in thread 0 only, in the grid's last block.
__device__ inline bool block_done_advance(uint32_t* blocks_done, uint64_t* seq) {
  if (threadIdx.x != 0) return false;
  __threadfence();
  if (atomicAdd(blocks_done, 1u) + 1 != gridDim.x * gridDim.y) return false;
  *blocks_done = 0;
  *seq += 1;
  __threadfence();
  return true;
}

// Diagnostics: true for the first wait of kind `what` on this rank to time out (printed) or to
// be given up after another error (recorded in ErrorReport::abandoned).
__device__ inline bool note_wait(ErrorReport* e, int32_t what) {
  const unsigned long long bit = 1ull << (static_cast<uint32_t>(what) & 63u);
  return (atomicOr(reinterpret_cast<unsigned long long*>(&e->waits_noted), bit) & bit) == 0;
}

// A wait given up because of another error: the first of its kind is kept for the report.
__device__ inline void note_abandoned(ErrorReport* e, int32_t peer, int32_t what, int64_t detail) {
  if (what >= 0 && what < kWaitKindCount && note_wait(e, what)) {
    e->abandoned[what].peer = peer;
    e->abandoned[what].detail = detail;
  }
}

// Data errors (a bad expert id, static-shape rows past max_recv_tokens, an expert's rows past
// rows_per_expert) leave the protocol intact: the call completes on every rank, and the host
// raises at its next read.
__device__ inline bool is_data_error(int32_t code) {
  return code == kBadExpert || code == kRecvOverflow || code == kExpertOverflow;
}

// Record the first error of this rank's kernels; later ones only abort. One exception: an error
// that breaks the protocol (a timeout, a peer stopped, a mismatch) replaces a data error recorded
// before it. `aborted` reads the code, so if a data error kept it, every later wait of this rank
// (under a CUDA graph, or between check_errors calls, nothing reads the report in between) would
// run to its own timeout instead of giving up at once: a missing peer would cost one timeout per
// waiting kernel instead of one in all, and this rank would never stop (NOTES item 46). The data
// error's own report is lost; the error that needs acting on is the protocol's.
__device__ inline void report_error(const CommContext& c, int32_t code, int32_t peer,
                                    int32_t what, int64_t detail) {
  ErrorReport* e = c.error();
  int32_t prev = atomicCAS(&e->code, 0, code);
  while (is_data_error(prev) && !is_data_error(code)) {   // (is_data_error(0) is false)
    const int32_t seen = atomicCAS(&e->code, prev, code);
    if (seen == prev) {
      prev = 0;   // this thread now owns the report
      break;
    }
    prev = seen;   // another error won in between: escalate from it if it is a data error too
  }
  if (prev == 0) {
    e->rank = c.rank;
    e->peer = peer;
    e->what = what;
    e->detail = detail;
    __threadfence_system();
    if (code == kTimeout && note_wait(e, what))
      printf("[megatron_mok] rank %d: timed out after %llu ns waiting for peer %d (wait kind %d, "
             "detail %lld)\n", c.rank, (unsigned long long)c.timeout_ns, peer, what, (long long)detail);
  }
}

// True once this rank's kernels reported an error that breaks the protocol (a timeout): spin
// waits give up and kernels skip their work. Data errors (is_data_error) do not abort: a bad
// expert id is dropped like -1, static-shape rows past max_recv_tokens are not written, and
// neither are an expert's rows past rows_per_expert; every rank's call then completes and the
// host raises at its next read.
__device__ inline bool aborted(const CommContext& c) {
  const int32_t code = ld_volatile(&c.error()->code);
  return code != kOk && !is_data_error(code);
}

// Spin until *flag >= target (acquire, system scope). False on timeout or abort: the caller
// must stop its work and return. `seen` (optional): the value that satisfied the wait.
__device__ inline bool wait_geq(const CommContext& c, const uint64_t* flag, uint64_t target,
                                int32_t peer, int32_t what, int64_t detail, uint64_t* seen = nullptr) {
  uint64_t v = ld_acquire_sys(flag);
  if (v >= target) {
    if (seen != nullptr) *seen = v;
    return true;
  }
  const uint64_t start = globaltimer_ns();
  // Back off between polls: hundreds of warps spinning on a peer's flag would otherwise flood
  // NVLink with small reads and slow down the very transfer they wait for.
  unsigned sleep_ns = kPollSleepMinNs;
  for (int polls = 1;; ++polls) {
    __nanosleep(sleep_ns);
    sleep_ns = min(sleep_ns * 2, kPollSleepMaxNs);
#if MOK_POLL_RELAXED
    v = ld_relaxed_sys(flag);
    // The flag only grows (a generation, or the poison above them all), so the acquire that
    // orders this thread's later reads after the publisher's writes still sees >= target.
    if (v >= target) v = ld_acquire_sys(flag);
#else
    v = ld_acquire_sys(flag);
#endif
    if (v >= target) {
      if (seen != nullptr) *seen = v;
      return true;
    }
    if (polls % kPollsPerClockRead == 0) {
      if (aborted(c)) {
        note_abandoned(c.error(), peer, what, detail);
        return false;
      }
      if (globaltimer_ns() - start > c.timeout_ns) {
        report_error(c, kTimeout, peer, what, detail);
        return false;
      }
    }
  }
}

// ---- 8-element vectors in float32 -----------------------------------------------------
template <typename T>
struct Vec8;

template <>
struct Vec8<__nv_bfloat16> {
  __device__ static void load(const __nv_bfloat16* p, float* f) {
    int4 v = ld_stream_16(reinterpret_cast<const int4*>(p));
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
  __device__ static void store(__nv_bfloat16* p, const float* f) {
    int4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<int4*>(p) = v;
  }
};

template <>
struct Vec8<__half> {
  __device__ static void load(const __half* p, float* f) {
    int4 v = ld_stream_16(reinterpret_cast<const int4*>(p));
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t = __half22float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
  __device__ static void store(__half* p, const float* f) {
    int4 v;
    __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<int4*>(p) = v;
  }
};

template <>
struct Vec8<float> {
  __device__ static void load(const float* p, float* f) {
    int4 a = ld_stream_16(reinterpret_cast<const int4*>(p));
    int4 b = ld_stream_16(reinterpret_cast<const int4*>(p) + 1);
    const float* fa = reinterpret_cast<const float*>(&a);
    const float* fb = reinterpret_cast<const float*>(&b);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[i] = fa[i];
      f[4 + i] = fb[i];
    }
  }
  __device__ static void store(float* p, const float* f) {
    int4 a, b;
    float* fa = reinterpret_cast<float*>(&a);
    float* fb = reinterpret_cast<float*>(&b);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      fa[i] = f[i];
      fb[i] = f[4 + i];
    }
    reinterpret_cast<int4*>(p)[0] = a;
    reinterpret_cast<int4*>(p)[1] = b;
  }
};

// Round f to T and back: the partial sum as the owner will see it.
template <typename T>
__device__ inline float round_to(float f);
template <>
__device__ inline float round_to<__nv_bfloat16>(float f) { return __bfloat162float(__float2bfloat16_rn(f)); }
template <>
__device__ inline float round_to<__half>(float f) { return __half2float(__float2half_rn(f)); }
template <>
__device__ inline float round_to<float>(float f) { return f; }

// 8 elements of T as raw 16-byte vectors: loaded now, converted later, so that many loads
// can be in flight before the first one is used.
template <typename T>
struct Raw8 {
  static constexpr int kVecs = sizeof(T) * 8 / 16;
  int4 v[kVecs];
};

template <typename T>
__device__ __forceinline__ void load_raw(Raw8<T>& r, const T* p) {
#pragma unroll
  for (int i = 0; i < Raw8<T>::kVecs; ++i) r.v[i] = ld_stream_16(reinterpret_cast<const int4*>(p) + i);
}

template <typename T>
__device__ __forceinline__ void add_raw(float* acc, const Raw8<T>& r);

template <>
__device__ __forceinline__ void add_raw<__nv_bfloat16>(float* acc, const Raw8<__nv_bfloat16>& r) {
  // A bf16 is the top half of the float with the same value, so each half of a 32-bit word
  // becomes a float with one shift or one mask (exact, as __bfloat1622float2): the intrinsic
  // spends a PRMT and an IMAD on the upper half (NOTES.md #24).
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&r.v[0]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += __uint_as_float(w[i] << 16);
    acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void add_raw<__half>(float* acc, const Raw8<__half>& r) {
  const __half2* h = reinterpret_cast<const __half2*>(&r.v[0]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(h[i]);
    acc[2 * i] += t.x;
    acc[2 * i + 1] += t.y;
  }
}

template <>
__device__ __forceinline__ void add_raw<float>(float* acc, const Raw8<float>& r) {
  const float* f = reinterpret_cast<const float*>(&r.v[0]);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] += f[i];
}

// 16 bytes from a shared-memory address (as __cvta_generic_to_shared gives): a loop over ring
// slots then advances one 32-bit address instead of rebuilding a generic pointer per load.
// Volatile: it must stay after the cp.async wait that makes the data visible.
__device__ __forceinline__ int4 ld_shared_16(unsigned addr) {
  int4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

template <typename T>
__device__ __forceinline__ void load_raw_shared(Raw8<T>& r, unsigned addr) {
#pragma unroll
  for (int i = 0; i < Raw8<T>::kVecs; ++i) r.v[i] = ld_shared_16(addr + 16 * i);
}

// Asynchronous 16-byte global -> shared copy (no registers held while in flight; L2 only) to a
// shared-memory address (as __cvta_generic_to_shared gives), reading `gmem` only when `live`
// (else the 16 bytes are zero-filled and nothing is read): one unpredicated instruction, so the
// copies of a row share one address computation and take the group offsets as immediates.
__device__ __forceinline__ void cp_async_16_shared_if(unsigned smem, const void* gmem, bool live) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(live ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// The last chunk generation a warp saw ready, per rank: lane d holds rank d's (ranks >= 32
// are not cached). A warp's chunks from one rank only move forward, so one number per rank
// is enough. Every lane of the warp must make the same calls (the value moves by shuffle);
// two registers per lane instead of one per rank.
struct SeenGens {
  uint64_t g = 0;
  // True when generation `gen` of rank d is known to be ready.
  __device__ bool has(int d, uint64_t gen) const {
    const uint64_t v = __shfl_sync(0xffffffffu, g, d % kWarpSize);
    return d < kWarpSize && v > gen;
  }
  __device__ void set(int d, uint64_t gen) {
    if (static_cast<int>(threadIdx.x % kWarpSize) == d) g = gen + 1;
  }
};

__device__ inline unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

}  // namespace mok

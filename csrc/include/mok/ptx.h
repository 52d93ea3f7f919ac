// Memory-ordering primitives, named after what they do (as DeepEP's utils.cuh).
#pragma once

#include <cstdint>

namespace mok {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Polls of a flag before the one that acquires it (wait_geq under MOK_POLL_RELAXED): no CCTL of
// the SM's L1 per poll.
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int32_t ld_volatile(const int32_t* p) {
  int32_t v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// 16-byte coherent load of data another GPU wrote: no L1 allocation, so a ring
// slot re-filled later in the same kernel is never served stale from L1.
__device__ __forceinline__ int4 ld_stream_16(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void st_16(int4* p, int4 v) { *p = v; }

// Programmatic dependent launch (Hopper; benchmarks/NOTES.md #48). Every kernel of the library
// calls this first, before it reads anything: `griddepcontrol.wait` returns once the grids it
// depends on (the kernel before it on the stream, when launched with the PDL attribute) have
// completed and their writes are visible (at once for a plain launch); then
// `launch_dependents` lets the next PDL-launched kernel of the stream be scheduled while this
// one runs: its blocks become resident and wait here, so the launch and the block ramp of a
// short kernel chain overlap the kernel before instead of following it. Triggered after the
// wait, not before: at most two grids of a chain are resident at once.
__device__ __forceinline__ void pdl_wait_then_release_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace mok

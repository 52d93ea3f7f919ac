// How fast can N SMs move the two data patterns of MoK's transfer kernels, with no ring, flag
// or layout logic around them? This bounds what dispatch/combine can reach at a given SM budget
// (the performance issue asks for <= 24 SMs), independently of NVLink.
//
//   rep  dispatch's fused permute: read one 14336-byte token row (bf16, H = 7168) and write it
//        to K expert-major rows (K = 4: a top-8 token has ~4 rows on each of 2 ranks).
//   red  combine's expert-side reduction: read K = 4 rows, sum in fp32, write one bf16 row.
//
// Each with 16-byte register copies (what the kernels did up to 38ac10a) and with bulk copies
// (cp.async.bulk into shared memory, completed on mbarriers; stores straight from shared memory),
// the source local (HBM) or on the peer GPU (NVLink; both GPUs pulling from each other at once).
//
// Build + run (one GPU, or two with peer access):  bash benchmarks/micro/run_sm_ceiling.sh OUT_DIR
// Prints one JSON object (every case, every SM count) on stdout.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "mok/bulk.h"
#include "mok/row_sum.h"
#include "mok/ptx.h"

using namespace mok;

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));        \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

constexpr int kRowBytes = 14336;  // H = 7168 bf16
constexpr int kK = 4;

// Task i reads source row src_row(i) from local (i even or mode 0) or remote (mode 1; or odd i in mode 2).
struct Src {
  const char* local;
  const char* remote;
  int mode;  // 0 all local, 1 all remote, 2 alternate
  __device__ const char* row(int i) const {
    if (mode == 0) return local + static_cast<size_t>(i) * kRowBytes;
    if (mode == 1) return remote + static_cast<size_t>(i) * kRowBytes;
    return ((i & 1) ? remote : local) + static_cast<size_t>(i >> 1) * kRowBytes;
  }
};

// ---------------------------------------------------------------------------------- rep
template <int U>
__global__ void __launch_bounds__(1024, 1)
    rep_reg(Src src, char* dst, const int* map, int n_tasks, int K) {
  const int lane = threadIdx.x % 32;
  const int n_warps = gridDim.x * (blockDim.x / 32);
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  constexpr int vpr = kRowBytes / 16;
  for (int t = warp; t < n_tasks; t += n_warps) {
    const int4* s = reinterpret_cast<const int4*>(src.row(t));
    for (int base = lane; base < vpr; base += 32 * U) {
      int4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + u * 32 < vpr) v[u] = ld_stream_16(s + base + u * 32);
      for (int k = 0; k < K; ++k) {
        int4* d = reinterpret_cast<int4*>(dst + static_cast<size_t>(map[t * K + k]) * kRowBytes);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (base + u * 32 < vpr) d[base + u * 32] = v[u];
      }
    }
  }
}

// One warp per block; lane 0 issues everything: loads of `stages` pieces in flight, each stored
// to its K rows straight from shared memory as soon as it lands. The lanes fetch the
// destination rows of the next 32 items together, so lane 0 never waits on a global load.
// Several warps per block (blockDim.x / 32) run independent pipelines of `stages` stages each.
__global__ void rep_bulk(Src src, char* dst, const int* map, int n_tasks, int K, int piece, int stages) {
  extern __shared__ __align__(128) char smem[];
  const int lane = threadIdx.x % 32, wib = threadIdx.x / 32, nwb = blockDim.x / 32;
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem) + wib * stages;
  char* buf = smem + 1024 + static_cast<size_t>(wib) * stages * piece;
  const int ppr = kRowBytes / piece;
  const int n_items_all = n_tasks * ppr;
  const int vb = blockIdx.x * nwb + wib, nvb = gridDim.x * nwb;  // this warp's "virtual block"
  const int n = (n_items_all - vb + nvb - 1) / nvb;
  if (lane == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(&bar[s], 1);
    fence_mbar_init();
  }
  __syncwarp();
  auto item = [&](int j) { return vb + j * nvb; };
  auto issue = [&](int j) {
    const int it = item(j), st = j % stages;
    mbar_expect_tx(&bar[st], piece);
    bulk_load(buf + static_cast<size_t>(st) * piece, src.row(it / ppr) + (it % ppr) * piece, piece, &bar[st]);
  };
  if (lane == 0)
    for (int j = 0; j < min(stages, n); ++j) issue(j);
  int rows[kK] = {0, 0, 0, 0};
  for (int j = 0; j < n; ++j) {
    const int st = j % stages, it = item(j);
    if (j % 32 == 0) {
      const int mine = j + lane;
      if (mine < n) {
        const int t = item(mine) / ppr;
        for (int k = 0; k < K; ++k) rows[k] = map[t * K + k];
      }
    }
    int r[kK];
#pragma unroll
    for (int k = 0; k < kK; ++k) r[k] = __shfl_sync(0xffffffffu, rows[k], j % 32);
    if (lane == 0) {
      mbar_wait(&bar[st], (j / stages) & 1);
      for (int k = 0; k < K; ++k)
        bulk_store(dst + static_cast<size_t>(r[k]) * kRowBytes + (it % ppr) * piece,
                   buf + static_cast<size_t>(st) * piece, piece);
      bulk_commit();
      if (j >= 1 && j - 1 + stages < n) {
        bulk_wait_read<1>();  // item j-1's stores have read its stage
        issue(j - 1 + stages);
      }
    }
  }
  if (lane == 0) bulk_wait_all();
}

// ---------------------------------------------------------------------------------- red
template <int U>
__global__ void __launch_bounds__(512, 1)
    red_reg(const __nv_bfloat16* rows, __nv_bfloat16* out, const int* map, int n_tasks) {
  constexpr int H = kRowBytes / 2;
  const int lane = threadIdx.x % 32;
  const int n_warps = gridDim.x * (blockDim.x / 32);
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  for (int t = warp; t < n_tasks; t += n_warps) {
    for (int v0 = lane * 8; v0 < H; v0 += 32 * 8 * U) {
      int4 raw[kK][U];
#pragma unroll
      for (int k = 0; k < kK; ++k)
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (v0 + u * 256 < H)
            raw[k][u] = ld_stream_16(reinterpret_cast<const int4*>(rows + static_cast<size_t>(map[t * kK + k]) * H + v0 + u * 256));
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (v0 + u * 256 >= H) continue;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int k = 0; k < kK; ++k) {
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw[k][u]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float2 f = __bfloat1622float2(h[i]);
            acc[2 * i] += f.x;
            acc[2 * i + 1] += f.y;
          }
        }
        int4 o;
        __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
        for (int i = 0; i < 4; ++i) oh[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
        *reinterpret_cast<int4*>(out + static_cast<size_t>(t) * H + v0 + u * 256) = o;
      }
    }
  }
}

// Warp 0 lane 0 loads the K row pieces of an item into a stage; warps 1.. sum them from shared
// memory and store the bf16 result; full/empty mbarriers hand stages back and forth.
__global__ void red_bulk(const char* rows, char* out, const int* map, int n_tasks, int piece, int stages) {
  extern __shared__ __align__(128) char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + stages;
  char* buf = smem + 1024;
  const int consumers = blockDim.x / 32 - 1;
  const int ppr = kRowBytes / piece;
  const int n_items_all = n_tasks * ppr;
  const int n = (n_items_all - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) / gridDim.x;
  const size_t stage_bytes = static_cast<size_t>(kK) * piece;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], consumers);
    }
    fence_mbar_init();
  }
  __syncthreads();
  auto item = [&](int j) { return static_cast<int>(blockIdx.x) + j * static_cast<int>(gridDim.x); };
  auto rows_base = [&](int row) { return rows + static_cast<size_t>(row) * kRowBytes; };
  if (threadIdx.x / 32 == 0) {
    const int lane = threadIdx.x;
    int rows[kK] = {0, 0, 0, 0};
    for (int j = 0; j < n; ++j) {
      const int st = j % stages, it = item(j);
      if (j % 32 == 0 && j + lane < n) {
        const int t = item(j + lane) / ppr;
#pragma unroll
        for (int k = 0; k < kK; ++k) rows[k] = map[t * kK + k];
      }
      int r[kK];
#pragma unroll
      for (int k = 0; k < kK; ++k) r[k] = __shfl_sync(0xffffffffu, rows[k], j % 32);
      if (lane == 0) {
        if (j >= stages) mbar_wait(&empty[st], ((j / stages) - 1) & 1);
        mbar_expect_tx(&full[st], kK * piece);
        for (int k = 0; k < kK; ++k)
          bulk_load(buf + st * stage_bytes + k * piece,
                    rows_base(r[k]) + (it % ppr) * piece, piece, &full[st]);
      }
    }
    return;
  }
  const int c = threadIdx.x - 32, nc = consumers * 32;
  const int vecs = piece / 16;
  for (int j = 0; j < n; ++j) {
    const int st = j % stages, it = item(j), t = it / ppr;
    mbar_wait(&full[st], (j / stages) & 1);
    for (int v = c; v < vecs; v += nc) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        int4 r = reinterpret_cast<const int4*>(buf + st * stage_bytes + k * piece)[v];
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float2 f = __bfloat1622float2(h[i]);
          acc[2 * i] += f.x;
          acc[2 * i + 1] += f.y;
        }
      }
      int4 o;
      __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int i = 0; i < 4; ++i) oh[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      reinterpret_cast<int4*>(out + static_cast<size_t>(t) * kRowBytes + (it % ppr) * piece)[v] = o;
    }
    __syncwarp();
    if (threadIdx.x % 32 == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(&empty[st])) : "memory");
  }
}

// The combine's own loop (mok/row_sum.h): a task has 1-8 rows (as a top-8 token on one of two
// ranks), listed in task_rows [n_tasks, 8] with -1 padding; kRows rows' loads per batch.
template <int kRows>
__global__ void __launch_bounds__(512, 1)
    red_rows(const __nv_bfloat16* rows, __nv_bfloat16* out, const int* task_rows, int n_tasks) {
  constexpr int H = kRowBytes / 2;
  const int lane = threadIdx.x % 32;
  const int n_warps = gridDim.x * (blockDim.x / 32);
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  for (int t = warp; t < n_tasks; t += n_warps) {
    for (int v0 = lane * 8; v0 < H; v0 += 32 * 8 * U) {
      float acc[U][kCombineVec];
      zero(acc);
      sum_rows<__nv_bfloat16, kRows>(acc, rows, task_rows + t * 8, 8, 1ll << 40, v0, H);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (group_live(v0, u, H)) Vec8<__nv_bfloat16>::store(out + static_cast<size_t>(t) * H + v0 + u * 256, acc[u]);
    }
  }
}

// The same with the task's row ids held in registers (mok/row_sum.h sum_held_rows).
template <int kBatch>
__global__ void __launch_bounds__(512, 1)
    red_held(const __nv_bfloat16* rows, __nv_bfloat16* out, const int* task_rows, int n_tasks) {
  constexpr int H = kRowBytes / 2;
  const int lane = threadIdx.x % 32;
  const int n_warps = gridDim.x * (blockDim.x / 32);
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  for (int t = warp; t < n_tasks; t += n_warps) {
    HeldRows hr;
    hr.load(task_rows + t * 8, 8);
    for (int v0 = lane * 8; v0 < H; v0 += 32 * 8 * U) {
      float acc[U][kCombineVec];
      zero(acc);
      sum_held_rows<__nv_bfloat16, kBatch>(acc, rows, hr, 1ll << 40, v0, H);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (group_live(v0, u, H)) Vec8<__nv_bfloat16>::store(out + static_cast<size_t>(t) * H + v0 + u * 256, acc[u]);
    }
  }
}

// ---------------------------------------------------------------------------------- host
struct Dev {
  int id;
  char* src;      // 8192 source rows (local pool)
  char* dst;      // 32768 rows
  int* map;       // 32768 destinations
  int* task_rows; // [8192, 8] rows of each task (1-8, -1 padded), ~4 on average
  cudaStream_t s;
  cudaEvent_t a, b;
};

static std::vector<Dev> g_devs;

// Time `launch(dev)` run on `n_dev` devices at once; median over iters of the slowest device, us.
template <typename F>
static double time_us(int n_dev, F launch, int iters = 15, int warm = 3) {
  std::vector<double> t;
  for (int i = 0; i < warm + iters; ++i) {
    for (int d = 0; d < n_dev; ++d) {
      CK(cudaSetDevice(g_devs[d].id));
      CK(cudaEventRecord(g_devs[d].a, g_devs[d].s));
      launch(g_devs[d], d);
      CK(cudaGetLastError());
      CK(cudaEventRecord(g_devs[d].b, g_devs[d].s));
    }
    double worst = 0;
    for (int d = 0; d < n_dev; ++d) {
      CK(cudaSetDevice(g_devs[d].id));
      CK(cudaEventSynchronize(g_devs[d].b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, g_devs[d].a, g_devs[d].b));
      worst = std::max(worst, ms * 1e3);
    }
    if (i >= warm) t.push_back(worst);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  std::vector<int> sms = {8, 16, 24, 32, 48, 66, 132};
  int n_gpu = 0;
  CK(cudaGetDeviceCount(&n_gpu));
  n_gpu = std::min(n_gpu, 2);
  const int kSrcRows = 8192, kDstRows = kSrcRows * kK;
  for (int d = 0; d < n_gpu; ++d) {
    Dev v{};
    v.id = d;
    CK(cudaSetDevice(d));
    CK(cudaMalloc(&v.src, static_cast<size_t>(kSrcRows) * kRowBytes));
    CK(cudaMalloc(&v.dst, static_cast<size_t>(kDstRows) * kRowBytes));
    CK(cudaMalloc(&v.map, kDstRows * sizeof(int)));
    // Random bf16 in [-1, 1): never time on zeros.
    std::vector<__nv_bfloat16> h(static_cast<size_t>(kSrcRows) * kRowBytes / 2);
    std::mt19937 rng(1234 + d);
    std::uniform_real_distribution<float> U(-1.f, 1.f);
    for (auto& x : h) x = __float2bfloat16(U(rng));
    CK(cudaMemcpy(v.src, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(v.dst, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    std::vector<int> m(kDstRows);
    for (int i = 0; i < kDstRows; ++i) m[i] = i;
    std::shuffle(m.begin(), m.end(), rng);
    CK(cudaMemcpy(v.map, m.data(), m.size() * 4, cudaMemcpyHostToDevice));
    {
      // Rows per task: how many of a token's 8 distinct experts (of 256) are among 128 local ones.
      std::vector<int> tr(static_cast<size_t>(kSrcRows) * 8, -1);
      int next = 0;
      for (int t = 0; t < kSrcRows; ++t) {
        int n = 0;
        do {
          std::vector<int> e(256);
          for (int i = 0; i < 256; ++i) e[i] = i;
          std::shuffle(e.begin(), e.end(), rng);
          n = 0;
          for (int i = 0; i < 8; ++i) n += e[i] < 128;
        } while (n == 0);
        for (int k = 0; k < n; ++k) tr[t * 8 + k] = m[(next++) % kDstRows];
      }
      CK(cudaMalloc(&v.task_rows, tr.size() * 4));
      CK(cudaMemcpy(v.task_rows, tr.data(), tr.size() * 4, cudaMemcpyHostToDevice));
    }
    CK(cudaStreamCreateWithFlags(&v.s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&v.a));
    CK(cudaEventCreate(&v.b));
    g_devs.push_back(v);
  }
  if (n_gpu == 2) {
    CK(cudaSetDevice(0));
    CK(cudaDeviceEnablePeerAccess(1, 0));
    CK(cudaSetDevice(1));
    CK(cudaDeviceEnablePeerAccess(0, 0));
  }
  int max_sms = 0;
  CK(cudaDeviceGetAttribute(&max_sms, cudaDevAttrMultiProcessorCount, 0));
  const int smem_max = 226 * 1024;
  for (int d = 0; d < n_gpu; ++d) {  // a function attribute is per device
    CK(cudaSetDevice(d));
    CK(cudaFuncSetAttribute(rep_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
    CK(cudaFuncSetAttribute(red_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));

  struct Case {
    std::string name, what;
    int n_dev;
    double read_mb, write_mb, nvlink_mb;  // per device per call
    std::function<void(Dev&, int, int)> launch;  // (dev, dev index, sms)
  };
  std::vector<Case> cases;
  auto src_for = [&](int d, int mode) {
    Src s{g_devs[d].src, n_gpu == 2 ? g_devs[1 - d].src : g_devs[d].src, mode};
    return s;
  };
  const double row_mb = kRowBytes / 1e6;
  // Local: 8192 source rows -> 32768 rows (dispatch's 470 MB of writes, all from HBM).
  cases.push_back({"rep_reg_u4_local", "16B register copies, 4 in flight/lane, 1024 thr", 1,
                   kSrcRows * row_mb, kDstRows * row_mb, 0,
                   [&](Dev& v, int d, int n) { rep_reg<4><<<n, 1024, 0, v.s>>>(src_for(d, 0), v.dst, v.map, kSrcRows, kK); }});
  cases.push_back({"rep_reg_u8_local", "16B register copies, 8 in flight/lane, 1024 thr", 1,
                   kSrcRows * row_mb, kDstRows * row_mb, 0,
                   [&](Dev& v, int d, int n) { rep_reg<8><<<n, 1024, 0, v.s>>>(src_for(d, 0), v.dst, v.map, kSrcRows, kK); }});
  for (int nw : {4, 8}) {
    for (int piece : {kRowBytes, kRowBytes / 2}) {
      const int stages = (smem_max - 1024) / piece / nw;
      cases.push_back({"rep_bulk_local_w" + std::to_string(nw) + "_p" + std::to_string(piece),
                       std::to_string(nw) + " issuing warps x " + std::to_string(stages) + " stages", 1,
                       kSrcRows * row_mb, kDstRows * row_mb, 0,
                       [=](Dev& v, int d, int n) {
                         rep_bulk<<<n, 32 * nw, 1024 + nw * stages * piece, v.s>>>(src_for(d, 0), v.dst, v.map, kSrcRows, kK, piece, stages);
                       }});
    }
  }
  for (int piece : {kRowBytes, kRowBytes / 2, kRowBytes / 4}) {
    const int stages = std::min(64, (smem_max - 1024) / piece);
    cases.push_back({"rep_bulk_local_p" + std::to_string(piece), "bulk copies, " + std::to_string(stages) + " stages in flight/SM", 1,
                     kSrcRows * row_mb, kDstRows * row_mb, 0,
                     [=](Dev& v, int d, int n) {
                       rep_bulk<<<n, 32, 1024 + stages * piece, v.s>>>(src_for(d, 0), v.dst, v.map, kSrcRows, kK, piece, stages);
                     }});
  }
  cases.push_back({"red_reg_u2_local", "16B register loads, 4 rows x 2 in flight/lane, 512 thr", 1,
                   kDstRows * row_mb, kSrcRows * row_mb, 0,
                   [&](Dev& v, int d, int n) {
                     red_reg<2><<<n, 512, 0, v.s>>>(reinterpret_cast<const __nv_bfloat16*>(v.dst),
                                                    reinterpret_cast<__nv_bfloat16*>(v.src), v.map, kSrcRows);
                   }});
  // The combine's loops over tasks of 1-8 rows (~4 on average: reads ~32768 rows).
  using TaskKernel = void (*)(const __nv_bfloat16*, __nv_bfloat16*, const int*, int);
  auto add_task_case = [&](const char* name, const char* what, TaskKernel kernel) {
    cases.push_back({name, what, 1, kDstRows * row_mb, kSrcRows * row_mb, 0,
                     [&, kernel](Dev& v, int d, int n) {
                       kernel<<<n, 512, 0, v.s>>>(reinterpret_cast<const __nv_bfloat16*>(v.dst),
                                                  reinterpret_cast<__nv_bfloat16*>(v.src), v.task_rows, kSrcRows);
                     }});
  };
  add_task_case("red_rows2_var", "mok/row_sum.h loop, 1-8 rows per task, 2 rows per batch", red_rows<2>);
  add_task_case("red_rows4_var", "mok/row_sum.h loop, 1-8 rows per task, 4 rows per batch", red_rows<4>);
  add_task_case("red_rows8_var", "mok/row_sum.h loop, 1-8 rows per task, 8 rows per batch", red_rows<8>);
  add_task_case("red_held4_var", "row ids in registers, 1-8 rows per task, 4 rows per batch", red_held<4>);
  add_task_case("red_held8_var", "row ids in registers, 1-8 rows per task, 8 rows per batch", red_held<8>);
  for (int piece : {kRowBytes / 4, kRowBytes / 8}) {
    const int stages = std::min(32, (smem_max - 1024) / (kK * piece));
    cases.push_back({"red_bulk_local_p" + std::to_string(piece), "bulk loads, " + std::to_string(stages) + " stages of 4 pieces, 8 summing warps", 1,
                     kDstRows * row_mb, kSrcRows * row_mb, 0,
                     [=](Dev& v, int d, int n) {
                       red_bulk<<<n, 32 * 9, 1024 + stages * kK * piece, v.s>>>(v.dst, v.src, v.map, kSrcRows, piece, stages);
                     }});
  }
  if (n_gpu == 2) {
    // Remote: each GPU pulls 4096 rows of the other's memory and writes each to K rows.
    for (int K : {1, 4}) {
      cases.push_back({"rep_reg_u8_remote_k" + std::to_string(K), "register pull over NVLink, both GPUs", 2,
                       0, 4096.0 * K * row_mb, 4096 * row_mb,
                       [=](Dev& v, int d, int n) { rep_reg<8><<<n, 1024, 0, v.s>>>(src_for(d, 1), v.dst, v.map, 4096, K); }});
      cases.push_back({"rep_bulk_remote_k" + std::to_string(K), "bulk pull over NVLink (half rows, 31 stages), both GPUs", 2,
                       0, 4096.0 * K * row_mb, 4096 * row_mb,
                       [=](Dev& v, int d, int n) {
                         rep_bulk<<<n, 32, 1024 + 31 * (kRowBytes / 2), v.s>>>(src_for(d, 1), v.dst, v.map, 4096, K, kRowBytes / 2, 31);
                       }});
    }
    // Dispatch's mix: half the tasks local, half pulled; 470 MB written per GPU.
    cases.push_back({"rep_reg_u8_mixed", "register copies, local and pulled tasks alternating", 2,
                     4096 * row_mb, kDstRows * row_mb, 4096 * row_mb,
                     [&](Dev& v, int d, int n) { rep_reg<8><<<n, 1024, 0, v.s>>>(src_for(d, 2), v.dst, v.map, kSrcRows, kK); }});
    // The 2-GPU dispatch pull's own shape (standard shape, 2 ranks): 8192 tasks per GPU, half
    // local and half pulled, 2 rows each (235 MB written), 6 loads in flight per lane like the
    // kernel; and the same with every task local. Against the kernel's ~400 us (NOTES #28, #29),
    // this says how much is the data pattern and how much the protocol around it.
    cases.push_back({"rep_reg_u6_w2shape_mixed", "dispatch pull shape at W=2: 2 rows per task, half pulled", 2,
                     4096 * row_mb, 2.0 * kSrcRows * row_mb, 4096 * row_mb,
                     [&](Dev& v, int d, int n) { rep_reg<6><<<n, 1024, 0, v.s>>>(src_for(d, 2), v.dst, v.map, kSrcRows, 2); }});
    cases.push_back({"rep_reg_u6_w2shape_local", "dispatch pull shape at W=2, every task local", 2,
                     kSrcRows * row_mb, 2.0 * kSrcRows * row_mb, 0,
                     [&](Dev& v, int d, int n) { rep_reg<6><<<n, 1024, 0, v.s>>>(src_for(d, 0), v.dst, v.map, kSrcRows, 2); }});
    cases.push_back({"rep_bulk_mixed", "bulk copies (half rows, 31 stages), local and pulled alternating", 2,
                     4096 * row_mb, kDstRows * row_mb, 4096 * row_mb,
                     [=](Dev& v, int d, int n) {
                       rep_bulk<<<n, 32, 1024 + 31 * (kRowBytes / 2), v.s>>>(src_for(d, 2), v.dst, v.map, kSrcRows, kK, kRowBytes / 2, 31);
                     }});
  }

  printf("{\"gpu\": \"%s\", \"gpus\": %d, \"sm_count\": %d, \"row_bytes\": %d, \"K\": %d, \"cases\": [\n",
         prop.name, n_gpu, max_sms, kRowBytes, kK);
  bool first = true;
  const char* only = getenv("CEILING_CASES");  // comma-separated substrings; unset = all
  for (auto& c : cases) {
    if (only != nullptr) {
      bool hit = false;
      std::string list(only);
      size_t a = 0;
      while (a <= list.size()) {
        size_t b = list.find(',', a);
        if (b == std::string::npos) b = list.size();
        if (b > a && c.name.find(list.substr(a, b - a)) != std::string::npos) hit = true;
        a = b + 1;
      }
      if (!hit) continue;
    }
    for (int n : sms) {
      if (n > max_sms) continue;
      const double us = time_us(c.n_dev, [&](Dev& v, int d) { c.launch(v, d, n); });
      const double moved = c.read_mb + c.write_mb + c.nvlink_mb;
      printf("%s  {\"case\": \"%s\", \"what\": \"%s\", \"gpus\": %d, \"sms\": %d, \"us\": %.1f, "
             "\"read_MB\": %.1f, \"write_MB\": %.1f, \"nvlink_MB\": %.1f, \"GBps_total\": %.1f, "
             "\"GBps_per_sm\": %.1f, \"write_GBps\": %.1f}",
             first ? "" : ",\n", c.name.c_str(), c.what.c_str(), c.n_dev, n, us, c.read_mb, c.write_mb,
             c.nvlink_mb, moved / us * 1e3, moved / us * 1e3 / n, c.write_mb / us * 1e3);
      first = false;
      fflush(stdout);
      fprintf(stderr, "%-24s sms=%3d %9.1f us  %7.1f GB/s moved  %6.1f GB/s/SM  writes %7.1f GB/s\n",
              c.name.c_str(), n, us, moved / us * 1e3, moved / us * 1e3 / n, c.write_mb / us * 1e3);
    }
  }
  printf("\n]}\n");
  return 0;
}

// The FP8 dispatch's pack (megatron_mok/fp8.py): each token's FP8 row and its scales' row put
// side by side in one packed row, zero padding after, so that the dispatch moves one row per
// token. One launch of 16-byte copies. Before it: torch.cat (~160-210 us of host time per call,
// run s22-5), then two strided torch copies (~20 us of host time each at 128 tokens, 11-16 us of
// device time each at 4096 tokens, s22-6).
#include "mok/launch.h"

namespace mok {
namespace {

constexpr int kPackThreads = 256;

// Block b takes rows b, b + grid, ...; its threads take the row's 16-byte vectors. All widths are
// multiples of 16 bytes and every pointer is 16-byte aligned (checked by the API).
__global__ void __launch_bounds__(kPackThreads) pack_rows_kernel(int4* dst, int dst_vec, const int4* a, int a_vec,
                                                                 const int4* b, int b_vec, int64_t rows) {
  const int4 zero = make_int4(0, 0, 0, 0);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    int4* out = dst + r * dst_vec;
    const int4* ra = a + r * a_vec;
    const int4* rb = b + r * b_vec;
    for (int v = threadIdx.x; v < dst_vec; v += blockDim.x)
      out[v] = v < a_vec ? ra[v] : (v < a_vec + b_vec ? rb[v - a_vec] : zero);
  }
}

}  // namespace

cudaError_t launch_pack_rows(void* dst, int64_t dst_bytes, const void* a, int64_t a_bytes, const void* b,
                             int64_t b_bytes, int64_t rows, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  int dev = 0, sms = 0;
  if (cudaError_t e = cudaGetDevice(&dev)) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) return e;
  // Enough blocks to fill the GPU a few times over, never more than there are rows.
  const int64_t grid = rows < int64_t{8} * sms ? rows : int64_t{8} * sms;
  pack_rows_kernel<<<static_cast<unsigned>(grid), kPackThreads, 0, s>>>(
      static_cast<int4*>(dst), static_cast<int>(dst_bytes / 16), static_cast<const int4*>(a),
      static_cast<int>(a_bytes / 16), static_cast<const int4*>(b), static_cast<int>(b_bytes / 16), rows);
  return cudaGetLastError();
}

}  // namespace mok

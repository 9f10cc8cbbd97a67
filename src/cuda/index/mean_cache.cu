// Index stage, step 2 with a mean cache (MeanCache, sparse.h): the pooled means of the blocks that end before each
// sequence's chunk are read from the cache instead of pooled again.
#include <algorithm>

#include "cuda/common/check.h"
#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda::index_stage {
namespace {

// With a mean cache: the blocks that end before each sequence's chunk, copied from the cache (kRead), 4 dims a
// thread over every (row, KV head) with a grid-stride loop, and zero low-precision means for the rows past the real
// blocks (as pool_block writes them without a cache). Replaces a pooling CTA per cached block: at chunk 1024 x
// batch 8 (128K) those 65K CTAs, each a chain of dependent loads, took 176 of the 420 us of a selection.
// The cache holds real-unit float32 means; the low-precision copies are derived here, for FP8 the kernel's e4m3 ones
// with the descales of this call (device_args.cuh, to_kernel_mean), so they follow the call's scales.
// kWithV (the index's correction): the V means too; without it the index has none (the cache keeps its own).
template <typename T, bool kWithV>
__global__ void __launch_bounds__(256) copy_cached_means_kernel(SeqArgs seq, KVArgs kv, MeanCacheArgs cache,
                                                                int block_size, int num_kv_heads, int head_dim,
                                                                int64_t max_blocks, const int32_t* cu_blocks,
                                                                float* k_mean, float* v_mean, lowp_t<T>* k_mean_lowp,
                                                                lowp_t<T>* v_mean_lowp, T* k_kernel, T* v_kernel) {
  using L = lowp_t<T>;
  const int vecs = head_dim / 4;
  const int64_t per_row = int64_t(num_kv_heads) * vecs, n = max_blocks * per_row, total = cu_blocks[seq.batch];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t idx = i / per_row, rem = i % per_row;
    const int kvh = int(rem / vecs), d = int(rem % vecs) * 4;
    const int64_t out = (idx * num_kv_heads + kvh) * head_dim + d;
    union { L h[4]; uint2 u; } kl, vl;
    uint32_t k8 = 0, v8 = 0;  // FP8: four e4m3 bytes of the kernel's copies (zero past the real blocks)
    if (idx >= total) {
      for (int e = 0; e < 4; ++e) kl.h[e] = vl.h[e] = from_float<L>(0.f);  // vl: stored only with kWithV
    } else {
      const int b = find_sequence(cu_blocks, seq.batch, idx);
      const int64_t J = idx - cu_blocks[b];
      if (pool_action(cache, seq, b, J, block_size) != PoolAction::kRead) continue;  // pooled by the pooling kernel
      const int64_t slot = cache.slot(kv, b, J, block_size);
      float4 km = make_float4(0.f, 0.f, 0.f, 0.f), vm = km;  // a bad page id (reported): zero means
      if (slot >= 0) {
        const int64_t row = (slot * num_kv_heads + kvh) * head_dim + d;
        km.x = cache.k[row], km.y = cache.k[row + 1], km.z = cache.k[row + 2], km.w = cache.k[row + 3];
        if constexpr (kWithV)
          vm.x = cache.v[row], vm.y = cache.v[row + 1], vm.z = cache.v[row + 2], vm.w = cache.v[row + 3];
      }
      *reinterpret_cast<float4*>(k_mean + out) = km;  // workspace rows: 16-byte aligned
      kl.h[0] = from_float<L>(km.x), kl.h[1] = from_float<L>(km.y), kl.h[2] = from_float<L>(km.z);
      kl.h[3] = from_float<L>(km.w);
      if constexpr (kWithV) {
        *reinterpret_cast<float4*>(v_mean + out) = vm;
        vl.h[0] = from_float<L>(vm.x), vl.h[1] = from_float<L>(vm.y), vl.h[2] = from_float<L>(vm.z);
        vl.h[3] = from_float<L>(vm.w);
      }
      if constexpr (is_fp8_v<T>) {
        const float kd = kv.k_descale.at(b, kvh);
        const float ks[4] = {km.x, km.y, km.z, km.w};
        for (int e = 0; e < 4; ++e) k8 |= uint32_t(to_kernel_mean(ks[e], kd).__x) << (8 * e);
        if constexpr (kWithV) {
          const float vd = kv.v_descale.at(b, kvh);
          const float vs[4] = {vm.x, vm.y, vm.z, vm.w};
          for (int e = 0; e < 4; ++e) v8 |= uint32_t(to_kernel_mean(vs[e], vd).__x) << (8 * e);
        }
      }
    }
    *reinterpret_cast<uint2*>(k_mean_lowp + out) = kl.u;
    if constexpr (kWithV) *reinterpret_cast<uint2*>(v_mean_lowp + out) = vl.u;
    if constexpr (is_fp8_v<T>) {  // 4-byte aligned: out is a multiple of 4 elements
      *reinterpret_cast<uint32_t*>(k_kernel + out) = k8;
      if constexpr (kWithV) *reinterpret_cast<uint32_t*>(v_kernel + out) = v8;
    }
  }
}

}  // namespace

void launch_copy_cached_means(cudaStream_t stream, DType dtype, const SeqArgs& seq, const KVArgs& kv,
                              const MeanCacheArgs& cache, int block_size, int num_kv_heads, int head_dim,
                              int64_t max_blocks, const DeviceIndex& d) {
  if (cache.k == nullptr || max_blocks <= 0) return;
  const int64_t units = max_blocks * num_kv_heads * (head_dim / 4);
  const int grid = int(std::min<int64_t>((units + 255) / 256, int64_t(num_sms()) * 8));
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    auto kernel = d.correction ? copy_cached_means_kernel<T, true> : copy_cached_means_kernel<T, false>;
    kernel<<<grid, 256, 0, stream>>>(seq, kv, cache, block_size, num_kv_heads, head_dim, max_blocks, d.cu_blocks,
                                     d.k_mean, d.v_mean, static_cast<lowp_t<T>*>(d.k_mean_lowp),
                                     static_cast<lowp_t<T>*>(d.v_mean_lowp), static_cast<T*>(d.k_mean_kernel),
                                     static_cast<T*>(d.v_mean_kernel));
  };
  if (dtype == DType::kFloat8E4M3) launch(__nv_fp8_e4m3{});
  else if (dtype == DType::kBFloat16) launch(__nv_bfloat16{});
  else launch(__half{});
  check_cuda(cudaGetLastError(), "copy_cached_means_kernel launch");
}

}  // namespace sparse_prefill::cuda::index_stage

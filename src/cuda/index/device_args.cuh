// The index stage's shared device arguments (src/cuda/index/*.cu): where sequences, K/V, the mean cache and q live,
// the selection scalars, and the launchers build.cu calls (one per role file). CUDA translation units only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/geometry.h"
#include "cuda/common/device_checks.h"
#include "cuda/common/launch_inputs.h"
#include "cuda/index/index_stage.h"
#include "cuda/index/layout.h"

namespace sparse_prefill::cuda::index_stage {

struct SeqArgs {
  const int32_t* cu_q;
  const int32_t* cu_k;         // contiguous KV (else null)
  const int32_t* seqused_k;    // paged KV (else null)
  int batch;
  __device__ int64_t q_start(int b) const { return cu_q[b]; }
  __device__ int64_t q_len(int b) const { return cu_q[b + 1] - cu_q[b]; }
  __device__ int64_t k_start(int b) const { return cu_k ? cu_k[b] : 0; }
  __device__ int64_t k_len(int b) const { return cu_k ? cu_k[b + 1] - cu_k[b] : seqused_k[b]; }
};

// Largest b in [0, batch) with cu[b] <= idx (skips empty sequences).
__device__ inline int find_sequence(const int32_t* cu, int batch, int64_t idx) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu[mid] <= idx) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The selection tile of this CTA in a grid of (the tiles of every sequence, virtual KV heads): sequence b, tile t of
// its `tiles`, the lengths and off = k_len - q_len (bottom-right causal); b = -1 for the CTAs past the last tile.
struct SelectTile {
  int b, kvh;
  int64_t t, tiles, q_len, k_len, off;
};
__device__ __forceinline__ SelectTile select_tile(const SeqArgs& seq, const int32_t* cu_tiles) {
  SelectTile st{};
  const int64_t tile_idx = blockIdx.x;
  st.b = -1;
  if (tile_idx >= cu_tiles[seq.batch]) return st;
  st.kvh = blockIdx.y;
  st.b = find_sequence(cu_tiles, seq.batch, tile_idx);
  st.t = tile_idx - cu_tiles[st.b];
  st.tiles = cu_tiles[st.b + 1] - cu_tiles[st.b];
  st.q_len = seq.q_len(st.b), st.k_len = seq.k_len(st.b), st.off = st.k_len - st.q_len;
  return st;
}

// An FP8 descale as the kernels read it (Descale, launch_inputs.h): null = 1, strides in elements (0 broadcasts).
struct DescaleArg {
  const float* ptr = nullptr;
  int64_t stride[2] = {0, 0};
  __device__ float at(int b, int h) const { return ptr == nullptr ? 1.f : __ldg(ptr + b * stride[0] + h * stride[1]); }
};
inline DescaleArg descale_arg(const Descale& d) {
  DescaleArg a;
  a.ptr = d.ptr;
  a.stride[0] = d.stride[0];
  a.stride[1] = d.stride[1];
  return a;
}

struct KVArgs {
  const void* k;
  const void* v;
  DescaleArg k_descale, v_descale;  // FP8 only: key j of (b, kvh) is k[j] * k_descale(b, kvh)
  int64_t k_stride[3], v_stride[3];  // contiguous: row, head; paged: page, slot, head
  const int32_t* block_table;
  int64_t block_table_stride, block_table_col_stride;
  int64_t page_size;
  int64_t num_pages;   // block_table ids outside [0, num_pages) are skipped and reported (device_checks.h)
  DeviceError* err;

  // Page of key j of sequence b, or -1 (reported) for a bad id.
  __device__ int64_t page(int b, int64_t j) const {
    auto report = [&](int code, int64_t col, int64_t pg) {
      report_device_error(err, code, b, int(col), int(pg), int(num_pages));
    };
    return checked_page(*this, b, j, report);
  }

  // Element offsets of key j of sequence b at KV head h in K and V (k_start: the sequence's first row in a contiguous
  // K / V; unused when paged); false for a key on a bad page (reported; ko and vo untouched). The one place the index
  // stage's kernels resolve the two layouts. Callers that read K only ignore vo (dead code).
  __device__ __forceinline__ bool offsets(int b, int64_t k_start, int h, int64_t j, int64_t& ko, int64_t& vo) const {
    if (block_table) {
      const int64_t pg = page(b, j);
      if (pg < 0) return false;
      const int64_t slot = geometry::page_slot(j, page_size);
      ko = pg * k_stride[0] + slot * k_stride[1] + h * k_stride[2];
      vo = pg * v_stride[0] + slot * v_stride[1] + h * v_stride[2];
    } else {
      ko = (k_start + j) * k_stride[0] + h * k_stride[1];
      vo = (k_start + j) * v_stride[0] + h * v_stride[1];
    }
    return true;
  }
};

// Pooled-means cache (MeanCache, sparse.h); k == nullptr: none.
struct MeanCacheArgs {
  float* k = nullptr;
  float* v = nullptr;
  int slots_per_page = 1;  // geometry::mean_cache_slots_per_page
  // The pooling grid covers, per sequence, the chunk_blocks blocks from the first one its chunk touches (the only
  // ones to pool); copy_cached_means_kernel copies the others from the cache. 0: the grid covers every pooled row.
  int chunk_blocks = 0;

  // Cache slot of complete block J of sequence b (paged KV): the page of its last key; -1 for a bad page id.
  __device__ int64_t slot(const KVArgs& kv, int b, int64_t J, int block_size) const {
    const int64_t page = kv.page(b, (J + 1) * block_size - 1);
    if (page < 0) return -1;
    return geometry::mean_cache_slot(page, J, kv.page_size, block_size, slots_per_page);
  }
};

// What the pooling does with block J of sequence b: read it from the cache (complete, and ends before the call's
// chunk: written by an earlier chunk's call), or pool it (and store it when complete).
enum class PoolAction { kRead, kPoolStore, kPool };
__device__ inline PoolAction pool_action(const MeanCacheArgs& cache, const SeqArgs& seq, int b, int64_t J, int block_size) {
  if (cache.k == nullptr) return PoolAction::kPool;
  const int64_t end = (J + 1) * block_size, k_len = seq.k_len(b);
  if (end <= k_len - seq.q_len(b)) return PoolAction::kRead;
  return end <= k_len ? PoolAction::kPoolStore : PoolAction::kPool;
}

template <typename T>
__device__ float to_float(T x);
template <> __device__ inline float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ inline float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ inline float to_float<__nv_fp8_e4m3>(__nv_fp8_e4m3 x) { return float(x); }
template <typename T>
__device__ T from_float(float x);
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ inline __half from_float<__half>(float x) { return __float2half(x); }

// FP8 inputs (T = __nv_fp8_e4m3) keep three copies of the pooled means: float32 in real units (x * descale), the
// scorer's bf16 copy in real units (lowp_t), and the sparse kernel's e4m3 copy in raw units (to_kernel_mean). For
// bf16 / fp16 the two low-precision copies are one array in the input dtype.
template <typename T>
inline constexpr bool is_fp8_v = std::is_same_v<T, __nv_fp8_e4m3>;
template <typename T>
using lowp_t = std::conditional_t<is_fp8_v<T>, __nv_bfloat16, T>;

// max that propagates NaN (one FMNMX.NAN, the cost of fmaxf): the scorer's maxima see a NaN score (NaN policy of the
// selection, docs/semantics.md: a tile with a NaN score keeps every visible block).
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// A real-unit mean as the e4m3 correction operand: raw units of the same scale, round to nearest even, saturated to
// +-448 (so a mean never becomes NaN by overflow); 0 where the descale or the mean is 0 (no raw value represents it).
__device__ inline __nv_fp8_e4m3 to_kernel_mean(float mean_real, float descale) {
  __nv_fp8_e4m3 r;
  r.__x = (descale == 0.f || mean_real == 0.f) ? __nv_fp8_storage_t(0)
                                                : __nv_cvt_float_to_fp8(mean_real / descale, __NV_SATFINITE, __NV_E4M3);
  return r;
}

struct SelectArgs {
  float alpha;
  int block_size, sink, window, last_n;
  float scale_log2;  // softmax_scale * log2(e): energies are computed with exp2
};

struct QArgs {
  const void* q;
  int64_t stride_row, stride_head;
  bool vec16;  // 16-byte aligned base and strides that are multiples of 16 bytes: 16-byte copies of Q rows
  DescaleArg descale;  // FP8 only: query head h of sequence b is q * descale(b, h / g)
};

// The index stage's kernel arguments, derived from the call's packed inputs (launch_inputs.h) only.
inline SeqArgs seq_args(const LaunchInputs& li) {
  return SeqArgs{li.cu_seqlens_q, li.cu_seqlens_k, li.seqused_k, li.limits.batch};
}
// Rows that take 8-element loads (16 bytes of bf16 / fp16, 8 of e4m3): a 16-byte aligned base and strides (row, head;
// paged: page, slot, head) that are multiples of 8 elements.
inline bool rows_vec8(const void* base, const int64_t* stride, bool paged) {
  bool ok = reinterpret_cast<uintptr_t>(base) % 16 == 0;
  for (int i = 0; i < (paged ? 3 : 2); ++i) ok = ok && stride[i] % 8 == 0;
  return ok;
}
inline KVArgs kv_args(const LaunchInputs& li) {
  KVArgs kv{};
  kv.k = li.k;
  kv.v = li.v;
  for (int i = 0; i < 3; ++i) {
    kv.k_stride[i] = li.k_stride[i];
    kv.v_stride[i] = li.v_stride[i];
  }
  if (li.paged) {
    kv.block_table = li.block_table;
    kv.block_table_stride = li.block_table_stride[0];
    kv.block_table_col_stride = li.block_table_stride[1];
    kv.page_size = li.page_size;
    kv.num_pages = li.num_pages;
  }
  kv.err = device_error_word();
  kv.k_descale = descale_arg(li.k_descale);
  kv.v_descale = descale_arg(li.v_descale);
  return kv;
}
// vec16: the scorer's 16-byte copies of q rows (build.cu decides them from the base and strides).
inline QArgs q_args(const LaunchInputs& li, bool vec16) {
  return QArgs{li.q, li.q_stride[0], li.q_stride[1], vec16, descale_arg(li.q_descale)};
}

// The index stage's kernel instantiations: f(T{}, std::integral_constant<int, D>{}) for FP8 e4m3 at head dim 128
// (its only head dim, build.cu) and bfloat16 / float16 at head dim 64 or 128.
template <class F>
void with_index_types(DType dtype, int head_dim, F&& f) {
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  if (dtype == DType::kFloat8E4M3) {
    f(__nv_fp8_e4m3{}, D128{});
  } else if (dtype == DType::kBFloat16) {
    if (head_dim == 128) f(__nv_bfloat16{}, D128{}); else f(__nv_bfloat16{}, D64{});
  } else {
    if (head_dim == 128) f(__half{}, D128{}); else f(__half{}, D64{});
  }
}

// Launchers, one per role (each file's kernels stay private to it). All on `stream`, no host synchronisation.
// plan.cu: prefix sums of tiles, blocks and capacity over the batch into d; counters reset.
void launch_plan(cudaStream_t stream, const SeqArgs& seq, const SeqLimits& limits, const VirtualHeads& heads,
                 int block_size, const DeviceIndex& d);
// mean_cache.cu: the blocks that end before each sequence's chunk, copied from the cache (cache.k != nullptr).
void launch_copy_cached_means(cudaStream_t stream, DType dtype, const SeqArgs& seq, const KVArgs& kv,
                              const MeanCacheArgs& cache, int block_size, int num_kv_heads, int head_dim,
                              int64_t max_blocks, const DeviceIndex& d);
// pool.cu: block means of K and V over pool_rows rows (16-byte loads when vec16).
void launch_pooling(cudaStream_t stream, DType dtype, int head_dim, bool vec16, int64_t pool_rows, const SeqArgs& seq,
                    const KVArgs& kv, const MeanCacheArgs& cache, int block_size, int num_kv_heads,
                    const DeviceIndex& d);
// score_select.cu: the scorer and the keep rules for params.rule (the probe rows first for kProbeRowMax and
// kProbeRowMass).
void launch_select(cudaStream_t stream, const Problem& p, const SelectionParams& params, const Bounds& bd,
                   const VirtualHeads& heads, const SeqArgs& seq, const QArgs& qa, const KVArgs& kv,
                   const SelectArgs& sel, const DeviceIndex& d);
// probe.cu: SelectionRule::kProbeRowMax / kProbeRowMass (row_mass), the probe rows' bits (d.probe_bits), on the
// scorer's grid.
void launch_probe(cudaStream_t stream, DType dtype, int head_dim, dim3 grid, const SeqArgs& seq, const QArgs& qa,
                  const KVArgs& kv, const SelectArgs& sel, const VirtualHeads& heads, bool row_mass,
                  const DeviceIndex& d);
// key_basis.cu: SelectionRule::kKeyMax's operands (after the pooling: it reads the float32 means): the residuals'
// second moment (d.key_moment), the basis P of rank key_rank (d.key_basis), K' = P^T (k - k_mean) and each block's
// radius (d.key_proj, d.key_radius).
void launch_key_basis(cudaStream_t stream, const Problem& p, int key_rank, const Bounds& bd, const SeqArgs& seq,
                      const KVArgs& kv, int block_size, const DeviceIndex& d);
// key_max.cu: SelectionRule::kKeyMax, the scorer's limits checked, launch_key_basis, then the tile's keep bits
// (d.probe_bits) from the per-key block maxima on the residual basis.
void launch_key_max(cudaStream_t stream, const Problem& p, const SelectionParams& params, const Bounds& bd,
                    const VirtualHeads& heads, const SeqArgs& seq, const QArgs& qa, const KVArgs& kv,
                    const SelectArgs& sel, const DeviceIndex& d);
// exact_max.cu: SelectionRule::kExactMax, the scorer's limits checked, the keys' e4m3 units (d.exact_keys), then the
// tile's keep bits (d.probe_bits): the candidates of kRowMax at params.candidate_alpha and the blocks not fully
// visible to the tile, tested by their block maxima on e4m3 operands.
void launch_exact_max(cudaStream_t stream, const Problem& p, const SelectionParams& params, const Bounds& bd,
                      const VirtualHeads& heads, const SeqArgs& seq, const QArgs& qa, const KVArgs& kv,
                      const SelectArgs& sel, const DeviceIndex& d);
// union.cu: union mode, one list per (sequence, virtual KV head).
void launch_union(cudaStream_t stream, const SeqArgs& seq, const VirtualHeads& heads, int batch, int block_size,
                  int64_t nb_max, const DeviceIndex& d);
// dense_rule.cu: the dense rule (SelectionParams::dense_fraction) over the finished selection, after score or union.
void launch_dense_rule(cudaStream_t stream, const SeqArgs& seq, const VirtualHeads& heads, int block_size,
                       float dense_fraction, const Bounds& bd, const DeviceIndex& d);

}  // namespace sparse_prefill::cuda::index_stage

// Dense attention: the contract of docs/semantics.md.
#pragma once

#include "sparse_prefill/tensor.h"

namespace sparse_prefill {

// The head dims every call takes (q, k and v's last dimension), on every backend: the one list the checks, the Python
// package (sparse_prefill.HEAD_DIMS) and the engine adapters read.
inline constexpr int kHeadDims[] = {64, 128};

// What the CUDA kernels are built for beyond kHeadDims, declared once: src/cuda/support.cpp's checks read it, and the
// Python package exposes it (sparse_prefill.CUDA_LIMITS) to callers that choose a layout before they call (an engine's
// page size, an adapter's dtype or head-dim padding). The CPU reference takes every dtype, head dim and page size.
struct CudaLimits {
  // q, k, v dtypes of every CUDA kernel (float8_e4m3fn with its descales; no float32 kernels)
  static constexpr DType kDTypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3};
  // head dims of the block-sparse and the FP8 kernels (16-bit dense attention takes every kHeadDims)
  static constexpr int kSparseHeadDims[] = {128};
  // paged KV of the block-sparse, FP8 and split-KV kernels: page_size a multiple of it (TMA boxes of 64 rows); 16-bit
  // dense attention gathers any page size
  static constexpr int kPageMultiple = 64;
};

// Kernel choices the library otherwise makes from the shapes; benchmarks and tests pin them for A/B runs. The
// defaults are the measured best (docs/design/dense_kernel.md, docs/design/sparse_kernel.md).
struct LaunchOptions {
  enum class DensePath : int {
    kAuto = 0,         // the dense kernel, except short queries against long keys (decode, small chunks): PackGQA
                       // tiles with split-KV, below half a wave of dense tiles (attention(), docs/design/dense_kernel.md)
    kDenseKernel = 1,  // always the dense kernel (one 128-row tile per query head)
    kSplitKV = 2,      // PackGQA tiles with split-KV wherever that path applies (head dim 128, no window, more keys
                       // than queries, pages of a multiple of 64); the dense kernel elsewhere
  };
  DensePath dense_path = DensePath::kAuto;
  // Sparse launches of chunk shapes (max_seqlen_k > max_seqlen_q): split tiles heavier than an SM's share into
  // split-KV units, planned on the device. false: one unit per tile.
  bool split_kv = true;
  // Checked mode, for debugging and tests: before the launch, copy the device-resident index values (cu_seqlens_q/k,
  // seqused_k, block_table and, for sparse_attention over a caller's index view, its arrays) to the host and validate
  // them as CPU arrays are validated; after the launch, check_errors(stream). It synchronises the stream twice and
  // allocates host memory: never in an engine's hot path, never inside CUDA-graph capture. Off: no host read at all;
  // the kernels bound every access by construction and report a bad value through the device error word
  // (check_errors below).
  bool checked = false;
};

// The keys and values one call attends to, contiguous or paged, and the queries. Shared by dense attention, index
// building and sparse attention.
//   q:  [total_q, Hq, D]                                   sequence b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]
//   contiguous KV: k, v [total_k, Hkv, D] + cu_seqlens_k [B+1]
//   paged KV:      k, v [num_pages, page_size, Hkv, D] + block_table [B, max_pages] + seqused_k [B]
// Index tensors are int32. q, k, v share one dtype (float32, float16, bfloat16 or float8_e4m3fn) and one device; the
// last dimension of every tensor must be contiguous.
// FP8 (float8_e4m3fn q, k, v): the values attended to are x * descale, with q_descale, k_descale, v_descale float32
// [B, Hkv] of any strides (0 broadcasts; FA3's contract: query head h uses q_descale[b, h / (Hq / Hkv)]); a descale
// left out is 1. The output is bfloat16. Descales are refused for other dtypes. The CPU reference computes FP8 inputs
// (dequantised, then the exact math); CUDA runs dense FP8 attention for head dim 128 (contiguous KV or paged KV with
// page_size % 64 == 0) and raises NotImplementedError for the rest (other head dims and page sizes, sparse FP8).
struct AttentionInputs {
  TensorView q, k, v;
  TensorView cu_seqlens_q;
  std::optional<TensorView> cu_seqlens_k;
  std::optional<TensorView> block_table;
  std::optional<TensorView> seqused_k;
  int64_t max_seqlen_q = 0;  // upper bound of the per-sequence query lengths (checked on the CPU backend)
  int64_t max_seqlen_k = 0;  // upper bound of the per-sequence key lengths
  bool causal = true;        // bottom-right aligned: query i sees key j iff j <= i + (Lk - Lq)
  std::optional<float> softmax_scale;  // default 1/sqrt(D)
  int window_left = -1;      // sliding window (-1 = unbounded), same alignment as causal
  int window_right = -1;
  void* stream = nullptr;    // cudaStream_t for the CUDA backend; ignored on the CPU
  LaunchOptions options;     // CUDA kernel choices (ignored on the CPU)
  std::optional<TensorView> q_descale, k_descale, v_descale;  // FP8 inputs only, float32 [B, Hkv]

  bool paged() const { return block_table.has_value(); }
};

// Outputs: out [total_q, Hq, D] in q's dtype, bfloat16 for FP8 inputs (written in place), lse [Hq, total_q] float32
// (optional).
// workspace (optional, CUDA): scratch device memory of the call. attention() uses it on the path that runs short
// queries against long keys (decode, small chunks) on PackGQA tiles with split-KV (the float32 partials and the
// split plan); sparse_prefill() for the index and the launch state; sparse_attention() over a caller's index view for
// its prepared copies. Each entry point has a *_workspace_bytes() function computed from shapes and parameters alone.
// With a workspace the call allocates nothing, never synchronises the host and can be captured in a CUDA graph;
// without it the call takes a stream-ordered temporary (cudaMallocAsync). A contiguous 1-D array of any dtype on q's
// device, at least the bytes its *_workspace_bytes() function gives, 256-byte aligned, not used by another launch
// while the call runs. Ignored by the CPU backend.
struct AttentionOutputs {
  TensorView out;
  std::optional<TensorView> lse;
  std::optional<TensorView> workspace;
};

// Bytes of `workspace` the CUDA backend may use for head dim `head_dim` on the current CUDA device (~35 MB at 128 on
// an H200); 0 in a build without CUDA.
int64_t attention_workspace_bytes(int head_dim);

// out = softmax(q k^T * scale + mask) v. Rows that see no key get zeros and lse = -inf.
void attention(const AttentionInputs& in, const AttentionOutputs& outs);

// Whether the CUDA backend's FP8 (float8_e4m3fn) attention kernels, dense and block-sparse, are built for this head
// dim and KV layout (page_size 0: contiguous KV; else the page size of a paged cache): "" when they are, else why not
// (the NotImplementedError message a call would raise). By dimensions alone, for engines that set a layer up before
// its first call; the CPU reference computes every FP8 configuration.
std::string fp8_attention_support(int head_dim, int64_t page_size);

// Which kernel attention() runs for these inputs (after in.options): kDenseKernel or kSplitKV on CUDA; the CPU
// reference reports kDenseKernel. For tests and benchmarks; validates like attention().
LaunchOptions::DensePath attention_path(const AttentionInputs& in);

// Device-side checks (docs/engine.md, "Bad values on the device"). The CUDA kernels never read or write outside the
// arrays they are given, whatever the values of cu_seqlens, seqused_k, block_table or an index: a sequence whose values
// are out of range is skipped and its rows of out (and lse) come out NaN, a bad page or block id costs a zero-filled
// load and makes its tile's rows NaN. The first such violation on a device is recorded in a small device error word
// (one per device: no allocation, CUDA-graph safe, independent of workspaces). check_errors() synchronises `stream`
// (a cudaStream_t; nullptr: the legacy default stream) on the current device, reads and clears the word, and throws
// the ArgumentError naming the argument, e.g. "seqused_k: seqused_k[0] = 5000 exceeds the 16 rows that block_table
// row 0's pages hold". It reports violations of every stream of the device since the last check. A no-op in a build
// without CUDA or on a machine without a GPU.
void check_errors(void* stream = nullptr);

}  // namespace sparse_prefill

// Fusion policies: extra steps a tile runs besides its key blocks.
//   NoFusion:       none.
//   MeanCorrection: the block-sparse mean correction (docs/semantics.md). Each correction step (SparseBlockIterator:
//                   one per chunk of kBlockN pooled blocks holding a prunable block that is not listed) loads the
//                   chunk's pooled means as keys and values; the consumer adds log|B_J| to the logits of the blocks to
//                   correct and masks the rest. Runtime-off (no means given) it runs no step.
//   Descaled<Inner>: FP8 inputs; the per-(sequence, KV head) descales of q, k, v on top of the fusion Inner
//                   (Fp8Descale = Descaled over NoFusion, MeanCorrectionFp8 = Descaled over MeanCorrection).
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/attention/block_schedule.h"
#include "cuda/attention/fwd_problem.h"
#include "cuda/attention/fwd_args.h"

namespace sparse_prefill::cuda {

template <class Config>
struct NoFusion {
  static constexpr bool kSteps = false;
  static constexpr bool kDescale = false;  // Descaled: per-(sequence, KV head) scales of FP8 q, k, v
  struct Params {};
  template <class MakeTma, class KvParams>
  static Params to_params(const FwdArgs&, const SparseFwdArgs*, MakeTma&&, const KvParams&) { return {}; }
  __host__ __device__ static constexpr bool on(const Params&) { return false; }
  __host__ __device__ static constexpr int mean_rows(const Params&) { return 1; }

  struct Consumer {  // nothing per tile or per step
    template <class Storage, class Iterator>
    __device__ __forceinline__ void prepare_tile(Storage&, const Iterator&, int) {}
    template <class Storage, class Iterator>
    __device__ __forceinline__ void prepare_step(Storage&, const Iterator&, int) {}
  };
};

template <class Config>
struct MeanCorrection {
  static constexpr bool kSteps = true;
  static constexpr bool kDescale = false;
  static constexpr int kBlockN = Config::kBlockN;
  struct Params {
    typename Config::TmaKV tma_k_mean;  // pooled means [mean_rows, Hkv, D] in the input dtype (correction keys)
    typename Config::TmaKV tma_v_mean;
    int mean_rows;                      // rows of the pooled-means tensors (TMA zero-fills beyond)
    int correction;                     // 0: no means given, no correction step
    float corr_bias_full;               // log2(block_size) / scale_log2: log|B_J| in raw logit units
  };
  // make_tma(ptr, rows): a TMA descriptor of one (kBlockN, D) box over the contiguous [rows, Hkv, D].
  template <class MakeTma, class KvParams>
  static Params to_params(const FwdArgs& a, const SparseFwdArgs* s, MakeTma&& make_tma, const KvParams& kv) {
    Params p;
    const int mean_rows = int(std::max<int64_t>(s->mean_rows, 1));
    // Without correction no mean is ever loaded, but the descriptors need a valid domain: describe k instead.
    const bool have_means = sparse_correction_on(*s);
    p.tma_k_mean = have_means ? make_tma(s->k_mean, mean_rows) : kv.tma_k;
    p.tma_v_mean = have_means ? make_tma(s->v_mean, mean_rows) : kv.tma_v;
    p.mean_rows = have_means ? mean_rows : 1;
    p.correction = have_means ? 1 : 0;
    p.corr_bias_full = std::log2(float(s->block_size)) / (a.softmax_scale * float(M_LOG2E));
    return p;
  }
  __host__ __device__ static bool on(const Params& p) { return p.correction != 0; }
  __host__ __device__ static int mean_rows(const Params& p) { return p.mean_rows; }

  // Producer: one full box of kBlockN pooled means, rows cu_blocks[b] + chunk * kBlockN (read after the stage is
  // acquired, like every other load of the step).
  template <class Tma, class SmemX, class Pipeline, class PipelineState>
  __device__ __forceinline__ static void load(const Params& p, const Tma& tma, SmemX& sX, Pipeline& pipe,
                                              PipelineState& st, const FwdProblem& pr,
                                              const int32_t* const& cu_blocks, int b, int chunk, int kv_head) {
    using namespace cute;
    constexpr int kHeadDim = Config::kHeadDim;
    Tensor mX = tma.get_tma_tensor(make_shape(p.mean_rows, kHeadDim, pr.num_kv_heads_mem));
    pipe.producer_acquire(st);
    Tensor gX = local_tile(domain_offset(make_coord(cu_blocks[b] + chunk * kBlockN, _0{}), mX(_, _, kv_head)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_0{}, _0{}));
    auto [tXgX, tXsX] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(sX), group_modes<0, 2>(gX));
    copy(tma.with(*pipe.producer_get_barrier(st), 0), tXgX, tXsX(_, st.index()));
    ++st;
  }
  template <class... A>
  __device__ __forceinline__ static void load_k(const Params& p, A&&... a) { load(p, p.tma_k_mean, a...); }
  template <class... A>
  __device__ __forceinline__ static void load_v(const Params& p, A&&... a) { load(p, p.tma_v_mean, a...); }

  // Consumer: the listed bits of the current correction step's chunk. They are gathered right after its S GEMM is
  // issued (prepare_step), so their loads overlap the GEMM instead of delaying the softmax.
  struct Consumer {
    uint32_t listed[kBlockN / 32] = {0, 0, 0, 0};
    int corr_chunk = 0, corr_cursor = 0;

    // Bitmap of the listed blocks in the tile's first kMaxCorrChunks correction chunks (both warpgroups, named barrier
    // 5): the correction mask reads 4 words per step instead of walking the list in global memory. The first sync
    // also ensures the previous tile's correction steps are done with it.
    template <class Storage, class Iterator>
    __device__ __forceinline__ void prepare_tile(Storage& storage, const Iterator& iter, int mma_tidx) {
      const int words = sp_min(iter.n_chunks, Config::kMaxCorrChunks) * (kBlockN / 32);
      if (words > 0) {
        cutlass::arch::NamedBarrier::sync(Config::kNumMmaThreads, 5);
        for (int w = mma_tidx; w < words; w += Config::kNumMmaThreads) storage.listed_bits[w] = 0u;
        cutlass::arch::NamedBarrier::sync(Config::kNumMmaThreads, 5);
        for (int k = mma_tidx; k < iter.n_listed; k += Config::kNumMmaThreads) {
          const int J = __ldg(iter.ids + k);
          if (J >= 0 && J < words * 32) atomicOr(&storage.listed_bits[J / 32], 1u << (J % 32));
        }
        cutlass::arch::NamedBarrier::sync(Config::kNumMmaThreads, 5);
      }
    }
    template <class Storage, class Iterator>
    __device__ __forceinline__ void prepare_step(Storage& storage, const Iterator& iter, int i) {
      if (iter.is_corr(i)) {
        corr_chunk = iter.chunk(i);
        if (corr_chunk < Config::kMaxCorrChunks) {
          CUTE_UNROLL
          for (int w = 0; w < kBlockN / 32; ++w) listed[w] = storage.listed_bits[corr_chunk * (kBlockN / 32) + w];
        } else {
          iter.listed_bits(corr_chunk, listed, corr_cursor);
        }
      }
    }
    // Column j of the chunk is pooled block J = chunk * kBlockN + j. Blocks to correct (prunable, not listed) get
    // logit + log|B_J| (raw units: log2|B_J| / scale_log2), all other columns -inf. bias_scale: 1, or with FP8
    // descales (Descaled) 1 / (q_descale * k_descale), since the tile's logit scale is scale_log2 times that product.
    template <class TensorS, class TensorC, class Iterator>
    __device__ __forceinline__ void apply(const Params& p, const FwdProblem& pr, TensorS& S_rc, const TensorC& cS_rc,
                                          const Iterator& iter, int block_size, int k_len, float bias_scale) {
      using namespace cute;
      constexpr int kRows = decltype(size<0>(S_rc))::value;
      const int J0 = corr_chunk * kBlockN;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(S_rc); ++c) {
        const int j = get<1>(cS_rc(0, c));
        const int J = J0 + j;
        // Selects, not listed[j / 32]: j is a runtime value and a dynamically indexed array would go to local memory.
        const uint32_t word = j < 64 ? (j < 32 ? listed[0] : listed[1]) : (j < 96 ? listed[2] : listed[3]);
        const bool todo = J < iter.n_prunable && !((word >> (j % 32)) & 1u);
        const int cnt = sp_min(block_size, k_len - J * block_size);
        const float bias = (cnt == block_size ? p.corr_bias_full : __log2f(float(cnt)) / pr.scale_log2) * bias_scale;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) S_rc(r, c) = todo ? S_rc(r, c) + bias : -INFINITY;
      }
    }
  };
};

// FP8 inputs (docs/semantics.md "FP8 inputs"): q, k, v are x * descale with float32 descales [B, Hkv] of any strides
// (0 broadcasts; null = 1); query head h uses q_descale[b, h / g]. No steps of its own: the consumers fold
// q_descale * k_descale into the tile's softmax scale and v_descale into the final normalisation (kernel_sm90.h);
// Inner's steps (the mean correction's pooled means, e4m3 in the same raw units as k and v) run unchanged.
template <class Config, template <class> class Inner>
struct Descaled : Inner<Config> {
  using Base = Inner<Config>;
  static constexpr bool kDescale = true;
  struct Params : Base::Params {
    const float* q;
    const float* k;
    const float* v;
    int64_t q_stride[2], k_stride[2], v_stride[2];  // (batch, KV head), elements
  };
  template <class MakeTma, class KvParams>
  static Params to_params(const FwdArgs& a, const SparseFwdArgs* s, MakeTma&& make_tma, const KvParams& kv) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_params(a, s, make_tma, kv);
    p.q = a.in.q_descale.ptr;
    p.k = a.in.k_descale.ptr;
    p.v = a.in.v_descale.ptr;
    for (int i = 0; i < 2; ++i) {
      p.q_stride[i] = a.in.q_descale.stride[i];
      p.k_stride[i] = a.in.k_descale.stride[i];
      p.v_stride[i] = a.in.v_descale.stride[i];
    }
    return p;
  }
  struct Scales {
    float qk, v;
    int negative;  // -1, or the first negative descale: 0 q, 1 k, 2 v (kErrDescale; NaN and inf propagate)
  };
  __device__ __forceinline__ static float at(const float* d, const int64_t (&stride)[2], int b, int h) {
    return d == nullptr ? 1.f : __ldg(d + b * stride[0] + h * stride[1]);
  }
  template <class Work>
  __device__ __forceinline__ static Scales scales(const Params& p, const FwdProblem& pr, const Work& w) {
    const int h = w.kv_head_mem(pr);
    const float q = at(p.q, p.q_stride, w.batch, h), k = at(p.k, p.k_stride, w.batch, h);
    const float v = at(p.v, p.v_stride, w.batch, h);
    // The running max assumes a non-negative logit scale (softmax_scale > 0 is validated on the host).
    return {q * k, v, q < 0.f ? 0 : k < 0.f ? 1 : v < 0.f ? 2 : -1};
  }
};
template <class Config>
using Fp8Descale = Descaled<Config, NoFusion>;
template <class Config>
using MeanCorrectionFp8 = Descaled<Config, MeanCorrection>;

}  // namespace sparse_prefill::cuda

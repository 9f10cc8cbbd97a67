// Host side of the attention kernel: picks the variant (variants.h) of a launch, has its policies build the kernel
// parameters (TMA descriptors: host-only encode, no device sync, no allocation) and launches it. Included by exactly
// one translation unit per (dtype, head dim) (instantiations/).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/attention/variants.h"
#include "cuda/attention/fwd_args.h"

namespace sparse_prefill::cuda {

template <class Kernel>
void launch_fwd(const FwdArgs& a, const SparseFwdArgs* sparse) {
  using Config = typename Kernel::Config;
  const typename Kernel::Params params = Kernel::to_underlying_arguments(a, sparse);
  if (params.mainloop.problem.num_m_blocks == 0) return;
  static const cudaError_t attr_err =  // once per kernel; not a stream operation
      cudaFuncSetAttribute(fwd_device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes);
  if (attr_err != cudaSuccess)
    throw std::runtime_error(std::string("sparse_prefill cuda: cudaFuncSetAttribute: ") + cudaGetErrorString(attr_err));
  // Sparse: the counters (tile counter, plan) were zeroed and the plan built on the stream by run_split_plan.
  fwd_device_kernel<Kernel><<<Kernel::grid(params), Config::kNumThreads, Config::kSmemBytes,
                              static_cast<cudaStream_t>(a.in.stream)>>>(params);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("sparse_prefill cuda: forward launch failed: ") + cudaGetErrorString(err));
}

// Dense (sparse == nullptr) or block-sparse launch.
// kWithSparse = false instantiates the dense kernels only (head dim 64: the block-sparse path is built for 128).
template <class Element, int kHeadDim, bool kWithSparse = true>
void run_fwd(const FwdArgs& a, const SparseFwdArgs* sparse = nullptr) {
  using Config = FwdConfig<Element, kHeadDim>;
  if (!kWithSparse && sparse != nullptr)
    throw std::runtime_error("sparse_prefill cuda: no block-sparse kernel for head dim " + std::to_string(kHeadDim));
  if (a.total_q == 0 || a.batch == 0) return;
  // Paged KV: page_size % 64 == 0 the TMA KV source (whole or half boxes), other page sizes the cp.async gather.
  const bool gather = a.page_size() > 0 && a.page_size() % Config::kHalfN != 0;
  if (gather && sparse != nullptr)
    throw std::logic_error("sparse_prefill internal error: page_size: not a multiple of 64 reached the block-sparse "
                           "kernel (check_sparse_supported refuses it)");
  if constexpr (kWithSparse) {
    if (sparse != nullptr) {
      const SparseLaunchWorkspace& w = sparse->launch;
      // Planned implies persistent (split_planned); without counters the scheduler refuses the launch.
      const bool planned = w.counters != nullptr && w.plan;
      if (sparse_correction_on(*sparse))
        return planned ? launch_fwd<SparseSplitKvFwd<Config>>(a, sparse) : launch_fwd<SparseFwd<Config>>(a, sparse);
      return planned ? launch_fwd<SparseSplitKvNoCorrFwd<Config>>(a, sparse)
                     : launch_fwd<SparseNoCorrFwd<Config>>(a, sparse);
    }
  }
  if (gather) return launch_fwd<DensePagedGatherFwd<Config>>(a, nullptr);
  launch_fwd<DenseFwd<Config>>(a, nullptr);
}

// FP8 attention (float8_e4m3fn q, k, v; bfloat16 out), dense (sparse == nullptr) or block-sparse: contiguous KV or
// paged KV with page_size % 64 == 0 (check_attention_supported, cuda/support.cpp, refuses the rest before this point).
template <int kHeadDim>
void run_fwd_fp8(const FwdArgs& a, const SparseFwdArgs* sparse) {
  using Config = FwdConfigFp8<kHeadDim>;
  if (a.total_q == 0 || a.batch == 0) return;
  if (a.page_size() > 0 && a.page_size() % Config::kHalfN != 0)
    throw std::logic_error("sparse_prefill internal error: page_size: not a multiple of 64 reached the FP8 kernel "
                           "(check_attention_supported refuses it)");
  if (sparse != nullptr) {
    const SparseLaunchWorkspace& w = sparse->launch;
    if (w.counters != nullptr && w.plan) return launch_fwd<SparseSplitKvFp8Fwd<Config>>(a, sparse);
    return launch_fwd<SparseFp8Fwd<Config>>(a, sparse);
  }
  launch_fwd<DenseFp8Fwd<Config>>(a, nullptr);
}

}  // namespace sparse_prefill::cuda

// Facts about a call that the CUDA backend's layers read (the support checks, the entry points, the index stage):
// plain C++ on the Problem and the inputs, no CUDA headers. cuda_backend.h is the backend's face to the API layer;
// code inside the backend that needs only these includes this header, not the face.
#pragma once

#include <cstdint>

#include "core/problem.h"
#include "sparse_prefill/attention.h"

namespace sparse_prefill::cuda {

// Paged KV whose pages are too small for TMA boxes: only the dense kernel's cp.async gather producer loads it.
inline bool gathered_pages(const Problem& p) { return p.paged && p.page_size % CudaLimits::kPageMultiple != 0; }
inline bool is_fp8(const Problem& p) { return p.dtype == DType::kFloat8E4M3; }
// q as the 16-bit scorer's 4-byte cp.async reads it.
inline bool q_cp_async_aligned(const AttentionInputs& in) {
  return !((in.q.stride[0] | in.q.stride[1]) & 1 || reinterpret_cast<uintptr_t>(in.q.data) % 4);
}

}  // namespace sparse_prefill::cuda

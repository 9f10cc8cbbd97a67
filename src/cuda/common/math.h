// Numeric constants shared by host and device code of the CUDA backend.
#pragma once

namespace sparse_prefill::cuda {

// log2(e) (= M_LOG2E): softmax scales are carried in the log2 domain (exp(x) = exp2(x * kLog2e)).
constexpr double kLog2e = 1.4426950408889634;

}  // namespace sparse_prefill::cuda

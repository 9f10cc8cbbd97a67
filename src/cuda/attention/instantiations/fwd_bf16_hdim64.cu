// Forward kernel instantiation: bfloat16, head dim 64 (dense only; the block-sparse kernel is built for 128).
#include "cuda/attention/launch.h"

namespace sparse_prefill::cuda {
void run_fwd_bf16_hdim64(const FwdArgs& args, const SparseFwdArgs* sparse) {
  run_fwd<cutlass::bfloat16_t, 64, false>(args, sparse);
}
}  // namespace sparse_prefill::cuda

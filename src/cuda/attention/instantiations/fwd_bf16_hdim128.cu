// Forward kernel instantiation: bfloat16, head dim 128.
#include "cuda/attention/launch.h"

namespace sparse_prefill::cuda {
void run_fwd_bf16_hdim128(const FwdArgs& args, const SparseFwdArgs* sparse) {
  run_fwd<cutlass::bfloat16_t, 128>(args, sparse);
}
}  // namespace sparse_prefill::cuda

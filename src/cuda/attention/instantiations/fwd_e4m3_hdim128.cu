// Forward kernel instantiation: float8_e4m3fn q, k, v (bfloat16 out), head dim 128: DenseFp8Fwd, SparseFp8Fwd and
// SparseSplitKvFp8Fwd.
#include "cuda/attention/launch.h"

namespace sparse_prefill::cuda {
void run_fwd_e4m3_hdim128(const FwdArgs& args, const SparseFwdArgs* sparse) { run_fwd_fp8<128>(args, sparse); }
}  // namespace sparse_prefill::cuda

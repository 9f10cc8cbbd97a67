"""Two exact_max index builds on the topic workload at 32K (alpha 0.05): the launch ncu profiles (r19.sh, r22.sh take
the second). Run from the repository root."""
import sys

sys.path.insert(0, "bench")
import torch  # noqa: E402

import sparse_prefill as sp  # noqa: E402
from _common import topic  # noqa: E402

L = 32768
q, k, v = topic(L)
cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
for _ in range(2):
    sp.build_index(q, k, v, cu, cu, L, L, rule="exact_max", alpha=0.05)
torch.cuda.synchronize()

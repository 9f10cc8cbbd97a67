"""One sparse-attention launch at length L on the topic workload, for ncu / compute-sanitizer (the index is built and
the kernel warmed up first; the launch to profile is the last one).
Usage: ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:fwd_kernel python3 bench/profile_sparse.py 131072
       ... profile_sparse.py L corr|nocorr C B: the last C-query chunk of B L-token prompts (chunked prefill)"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import sp_cuda  # noqa: E402
from bench_sparse import SEL, topic  # noqa: E402

L = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
correction = len(sys.argv) > 2 and sys.argv[2] == "corr"
if len(sys.argv) > 4:  # chunk C batch B: the last chunk of B L-token prompts over a paged cache (bench_chunked.py)
    from bench_chunked import Cache  # noqa: E402
    C, B = int(sys.argv[3]), int(sys.argv[4])
    cache = Cache(L, B)
    q, cu_q, used, _, _ = cache.step(L - C, L)
    kw = dict(block_table=cache.block_table, seqused_k=used)
    ws = sp_cuda.index_workspace(q, cache.k, cache.v, cu_q, None, C, L, **kw)
    idx = sp_cuda.build_index(q, cache.k, cache.v, cu_q, None, C, L, ws, **dict(SEL, correction=correction), **kw)
    for _ in range(3):
        sp_cuda.sparse_attention(q, cache.k, cache.v, idx, cu_q, None, C, L, **kw)
    torch.cuda.synchronize()
    print("density", idx.density())
    sys.exit(0)
q, k, v = topic(L)
cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
ws = sp_cuda.index_workspace(q, k, v, cu, cu, L, L)
idx = sp_cuda.build_index(q, k, v, cu, cu, L, L, ws, **SEL)
for _ in range(3):
    sp_cuda.sparse_attention(q, k, v, idx, cu, cu, L, L, correction=correction)
torch.cuda.synchronize()
print("density", idx.density())

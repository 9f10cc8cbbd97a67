"""One chunked-prefill index build (selection with the pooled-means cache), repeated, for ncu / compute-sanitizer.
Usage: ncu --clock-control none -k regex:score_select --launch-skip 2 --launch-count 1 \
         python3 bench/profile_select.py [L] [C] [B]"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import sp_cuda  # noqa: E402
from bench_chunked import Cache  # noqa: E402
from bench_sparse import SEL  # noqa: E402

L, C, B = (int(x) for x in (sys.argv[1:4] + ["131072", "1024", "1"][len(sys.argv[1:4]):]))
cache = Cache(L, B)
q, cu_q, used, _, _ = cache.step(L - C, L)
kw = dict(block_table=cache.block_table, seqused_k=used)
means = cache.mean_cache(L - C)
ws = sp_cuda.index_workspace(q, cache.k, cache.v, cu_q, None, C, L, **kw)
for _ in range(4):
    idx = sp_cuda.build_index(q, cache.k, cache.v, cu_q, None, C, L, ws, **SEL, **kw, mean_cache=means)
torch.cuda.synchronize()
print("density", idx.density())

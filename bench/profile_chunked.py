"""Where a chunked-prefill step's time goes, kernel by kernel (torch.profiler / CUPTI kernel durations), next to the
per-call event timing and the CUDA-graph timing that bench_chunked.py reports.
Usage: python3 bench/profile_chunked.py [L] [C] [B] [--out file.json]
One step: the last C queries of B L-token topic prompts over a paged cache with the pooled-means cache holding the
blocks before the chunk (as the earlier steps leave it); final and mid-prompt (final_chunk False)."""
import argparse
import json
import os
import sys
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import sp_cuda  # noqa: E402
from bench_chunked import Cache  # noqa: E402
from bench_dense import commit, time_graph_ms, time_ms  # noqa: E402
from bench_sparse import SEL  # noqa: E402


def kernel_times(fn, iters=20):
    """Mean GPU time per call of every kernel fn launches (us), from the profiler's CUDA kernel events."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name.replace("(anonymous namespace)::", "").replace("sparse_prefill::cuda::", "")
            name = name.replace("void ", "").split("<")[0].split("(")[0][:60]
            per[name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return {k: v / iters for k, v in sorted(per.items(), key=lambda kv: -kv[1])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("L", nargs="?", type=int, default=131072)
    ap.add_argument("C", nargs="?", type=int, default=1024)
    ap.add_argument("B", nargs="?", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cache = Cache(a.L, a.B)
    q, cu_q, used, C, Lk = cache.step(a.L - a.C, a.L)
    kw = dict(block_table=cache.block_table, seqused_k=used)
    means = cache.mean_cache(a.L - a.C)
    ws = sp_cuda.index_workspace(q, cache.k, cache.v, cu_q, None, C, Lk, **kw)
    out = torch.empty_like(q)
    res = dict(commit=commit(), L=a.L, chunk=a.C, batch=a.B, steps={})
    dense = lambda: sp_cuda.attention(q, cache.k, cache.v, cu_q, None, C, Lk, out=out, return_lse=False, **kw)  # noqa
    res["dense"] = dict(call_ms=time_ms(dense), graph_ms=time_graph_ms(dense))
    for final in (True, False):
        sel = dict(SEL, correction=True, final_chunk=final)
        select = lambda: sp_cuda.build_index(q, cache.k, cache.v, cu_q, None, C, Lk, ws, **sel, **kw,  # noqa: E731
                                             mean_cache=means)
        idx = select()
        torch.cuda.synchronize()
        attn = lambda: sp_cuda.sparse_attention(q, cache.k, cache.v, idx, cu_q, None, C, Lk, out=out, **kw)  # noqa
        step = dict(density=idx.density(),
                    select_call_ms=time_ms(select), select_graph_ms=time_graph_ms(select),
                    attn_call_ms=time_ms(attn), attn_graph_ms=time_graph_ms(attn),
                    select_kernels_us=kernel_times(select), attn_kernels_us=kernel_times(attn))
        res["steps"]["final" if final else "mid"] = step
        print(json.dumps({"final": final, **step}, indent=1), flush=True)
    print(json.dumps(res["dense"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""Where a chunked-prefill step's time goes, kernel by kernel (torch.profiler / CUPTI kernel durations), next to the
per-call event timing and the CUDA-graph timing that bench_chunked.py reports, through the installed package.
One step: the last C queries of B L-token topic prompts over a paged cache with the pooled-means cache holding the
blocks before the chunk (as the earlier steps leave it); final and mid-prompt (final_chunk False). Per step:
select (sp.build_index into a caller workspace, with the mean cache), attn (sp.sparse_attention over the device
index) and step (the one call sp.chunked_prefill with the mean cache and its workspace).
Usage: python3 bench/lab/profile_chunked.py [L] [C] [B] [--out file.json]     (default 131072 1024 1; ~20 s on the H200)"""
import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common, the benchmarks

from _common import (D, SEL, attention_workspace, emit, index_workspace, require_cuda, time_graph_ms, time_ms,
                     workspace, write_results)
from bench_chunked import PAGE, Cache


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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("L", nargs="?", type=int, default=131072, help="prompt length (multiple of 128)")
    ap.add_argument("C", nargs="?", type=int, default=1024, help="chunk (queries per sequence)")
    ap.add_argument("B", nargs="?", type=int, default=1, help="batch")
    ap.add_argument("--out", default=None, help="results JSON (default: print only)")
    a = ap.parse_args(argv)
    if a.L <= 0 or a.L % 128 or a.L % PAGE:
        ap.error(f"L: must be a positive multiple of 128, got {a.L}")
    if not 0 < a.C <= a.L:
        ap.error(f"C: must be in [1, L], got {a.C}")
    if a.B <= 0:
        ap.error(f"B: must be positive, got {a.B}")
    return a


def main(argv=None):
    a = parse_args(argv)
    sp = require_cuda()
    cache = Cache(a.L, a.B)
    q, cu_q, used, C, Lk = cache.step(a.L - a.C, a.L)
    kw = dict(block_table=cache.block_table, seqused_k=used)
    args = (q, cache.k, cache.v, cu_q, None, C, Lk)
    means = cache.mean_cache(a.L - a.C)
    out = torch.empty_like(q)
    wsd = attention_workspace(D)
    res = dict(L=a.L, chunk=a.C, batch=a.B, steps={})
    dense = lambda: sp.attention(*args, out=out, workspace=wsd, **kw)  # noqa: E731
    res["dense"] = dict(path=sp.attention_path(*args, **kw), call_ms=time_ms(dense), graph_ms=time_graph_ms(dense),
                        kernels_us=kernel_times(dense))
    for final in (True, False):
        sel = dict(SEL, correction=True, final_chunk=final)
        ws = index_workspace(*args, **kw, **sel)
        select = lambda: sp.build_index(*args, **kw, **sel, workspace=ws, mean_cache=means)  # noqa: E731
        idx = select()
        attn = lambda: sp.sparse_attention(q, cache.k, cache.v, idx, cu_q, None, C, Lk, out=out, **kw)  # noqa
        ws_step = workspace(sp.chunked_prefill_workspace_bytes(q, cache.k, cache.v, cu_q, cache.block_table, used, C,
                                                               Lk, **sel), q.device)
        one = {k_: v_ for k_, v_ in sel.items() if k_ != "final_chunk"}
        step_fn = lambda: sp.chunked_prefill(q, cache.k, cache.v, cu_q, cache.block_table, used, C, Lk,  # noqa
                                             final_chunk=final, mean_cache=means, out=out, workspace=ws_step, **one)
        step = dict(density=idx.density,
                    select_call_ms=time_ms(select), select_graph_ms=time_graph_ms(select),
                    attn_call_ms=time_ms(attn), attn_graph_ms=time_graph_ms(attn),
                    step_call_ms=time_ms(step_fn), step_graph_ms=time_graph_ms(step_fn),
                    select_kernels_us=kernel_times(select), attn_kernels_us=kernel_times(attn))
        if step["step_graph_ms"]:
            step["step_call_over_graph"] = step["step_call_ms"] / step["step_graph_ms"]
        res["steps"]["final" if final else "mid"] = step
        print(json.dumps({"final": final, **step}, indent=1), flush=True)
        del ws, ws_step, idx
    emit(res["dense"])
    if a.out:
        write_results(a.out, [dict(step=name, **s) for name, s in res["steps"].items()], **res)


if __name__ == "__main__":
    main()

"""One sparse-attention launch at length L on the topic workload, for ncu / compute-sanitizer, through the installed
package (the index is built into a caller workspace and the kernel warmed up first; the launch to profile is the
last one). With C and B: the last C-query chunk of B L-token prompts over a paged cache (chunked prefill). With
--density: a random block mask of that density (bench_sparse.py's sweep, --mask its granularity) instead of the topic
index; with --dense: the dense kernel on the same inputs (the sweep's ideal is density x its time); --fp8: q, k, v in
float8_e4m3fn (the FP8 kernels).
Usage: ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:fwd_kernel \\
         python3 bench/lab/profile_sparse.py 131072 [corr|nocorr] [C B]        (default nocorr; seconds without ncu)"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common, the benchmarks

from _common import SEL, index_workspace, require_cuda
from _common import topic


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("L", nargs="?", type=int, default=131072, help="length (multiple of 128)")
    ap.add_argument("correction", nargs="?", choices=("corr", "nocorr"), default="nocorr",
                    help="index built with the mean correction (corr) or without (nocorr, default)")
    ap.add_argument("C", nargs="?", type=int, default=None, help="chunk: profile the last C queries (needs B)")
    ap.add_argument("B", nargs="?", type=int, default=None, help="batch of the chunked step")
    ap.add_argument("--repeats", type=int, default=3, help="sparse-attention launches (default 3)")
    ap.add_argument("--density", type=float, default=None, help="a random block mask of this density (0, 1]")
    ap.add_argument("--mask", choices=("query_block", "tile"), default="query_block",
                    help="the random mask's granularity (bench_sparse.py's sweep; default query_block)")
    ap.add_argument("--dense", action="store_true", help="profile the dense kernel on the same inputs instead")
    ap.add_argument("--fp8", action="store_true",
                    help="q, k, v quantised to float8_e4m3fn (sp.quantize_fp8, per KV head), bfloat16 out: the FP8 "
                         "kernels on the same inputs")
    a = ap.parse_args(argv)
    if a.L <= 0 or a.L % 128:
        ap.error(f"L: must be a positive multiple of 128, got {a.L}")
    if (a.C is None) != (a.B is None):
        ap.error("C and B go together")
    if a.C is not None and not (0 < a.C <= a.L and a.B > 0):
        ap.error("C must be in [1, L] and B positive")
    if a.density is not None and not (0 < a.density <= 1 and a.C is None and a.correction == "nocorr"):
        ap.error("--density: in (0, 1], without C B and without the correction")
    return a


def main(argv=None):
    a = parse_args(argv)
    sp = require_cuda()
    sel = dict(SEL, correction=a.correction == "corr")
    if a.C is not None:  # the last chunk of B L-token prompts over a paged cache (bench_chunked.py)
        from bench_chunked import Cache
        cache = Cache(a.L, a.B)
        q, cu_q, used, C, Lk = cache.step(a.L - a.C, a.L)
        kw = dict(block_table=cache.block_table, seqused_k=used)
        args = (q, cache.k, cache.v, cu_q, None, C, Lk)
    else:
        q, k, v = topic(a.L)
        cu = torch.tensor([0, a.L], dtype=torch.int32, device="cuda")
        kw = {}
        args = (q, k, v, cu, cu, a.L, a.L)
    out = torch.empty_like(q)
    if a.fp8:  # the FP8 kernels: e4m3 q, k, v with their [B, Hkv] descales, bfloat16 out
        q8, qd = sp.quantize_fp8(args[0], batch=len(args[3]) - 1, num_kv_heads=args[1].shape[-2])
        k8, kd = sp.quantize_fp8(args[1], batch=len(args[3]) - 1)
        v8, vd = sp.quantize_fp8(args[2], batch=len(args[3]) - 1)
        args = (q8, k8, v8) + tuple(args[3:])
        scales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    else:
        scales = {}
    if a.dense:
        for _ in range(a.repeats):
            sp.attention(*args, out=out, **kw, **scales)
        torch.cuda.synchronize()
        print("dense")
        return
    ws = index_workspace(*args, **kw, **sel)
    idx = sp.build_index(*args, **kw, **scales, **sel, workspace=ws)
    density = idx.density
    if a.density is not None:  # the sweep's random mask over the same tiles (a host index)
        from bench_sparse import random_index
        idx, density = random_index(sp, idx.to_host(), a.L, a.density, args[0].shape[1] // args[1].shape[1],
                                    per_query_block=a.mask == "query_block")
    opts = sp.LaunchOptions()
    for _ in range(a.repeats):
        sp.sparse_attention(args[0], args[1], args[2], idx, *args[3:], out=out, options=opts, **kw, **scales)
    torch.cuda.synchronize()
    print("density", density)


if __name__ == "__main__":
    main()

"""One chunked-prefill index build (sp.build_index with the pooled-means cache, into a caller workspace), repeated,
for ncu / compute-sanitizer, through the installed package.
Usage: ncu --clock-control none -k regex:score_select --launch-skip 2 --launch-count 1 \\
         python3 bench/lab/profile_select.py [L] [C] [B]            (default 131072 1024 1; a few seconds without ncu)"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common, the benchmarks

from _common import SEL, index_workspace, require_cuda
from bench_chunked import PAGE, Cache


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("L", nargs="?", type=int, default=131072, help="prompt length (multiple of 128)")
    ap.add_argument("C", nargs="?", type=int, default=1024, help="chunk (queries per sequence)")
    ap.add_argument("B", nargs="?", type=int, default=1, help="batch")
    ap.add_argument("--repeats", type=int, default=4, help="index builds (default 4)")
    a = ap.parse_args(argv)
    if a.L <= 0 or a.L % 128 or a.L % PAGE:
        ap.error(f"L: must be a positive multiple of 128, got {a.L}")
    if not 0 < a.C <= a.L:
        ap.error(f"C: must be in [1, L], got {a.C}")
    if a.B <= 0 or a.repeats <= 0:
        ap.error("B and --repeats must be positive")
    return a


def main(argv=None):
    a = parse_args(argv)
    sp = require_cuda()
    cache = Cache(a.L, a.B)
    q, cu_q, used, C, Lk = cache.step(a.L - a.C, a.L)
    kw = dict(block_table=cache.block_table, seqused_k=used)
    args = (q, cache.k, cache.v, cu_q, None, C, Lk)
    means = cache.mean_cache(a.L - a.C)
    ws = index_workspace(*args, **kw, **SEL)
    for _ in range(a.repeats):
        idx = sp.build_index(*args, **kw, **SEL, workspace=ws, mean_cache=means)
    torch.cuda.synchronize()
    print("density", idx.density)


if __name__ == "__main__":
    main()

"""The dense rule's calls kernel by kernel (issue 44's density-1.0 rows): Gaussian q, k (the default keeps every
block, as bench_selection's 'dense_selection' rows), one-call sp.sparse_prefill with the defaults against
sp.attention, each under torch.profiler (CUDA kernels' time per call) and by CUDA-graph replay, alternating.
Usage: python3 bench/lab/profile_dense_rule.py [L ...] [--repeats 10]"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common

from _common import HKV, HQ, D, require_cuda, time_graph_ms, workspace
from lab.profile_index import kernel_table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("L", nargs="*", type=int, default=[8192, 32768])
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args(argv)
    sp = require_cuda()
    for L in a.L:
        g = torch.Generator(device="cuda").manual_seed(L)
        q, k, v = (torch.randn(L, h, D, device="cuda", generator=g, dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
        cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
        args = (q, k, v, cu, cu, L, L)
        o = torch.empty_like(q)
        aw = workspace(sp.attention_workspace_bytes(D))
        pw = workspace(sp.sparse_prefill_workspace_bytes(*args))
        calls = {"attention": lambda: sp.attention(*args, out=o, workspace=aw),
                 "sparse_prefill": lambda: sp.sparse_prefill(*args, out=o, workspace=pw)}
        print(f"L {L}: density {sp.build_index(*args).density:.4f}")
        for rnd in range(2):
            times = ", ".join(f"{n} {time_graph_ms(f):.4f} ms" for n, f in calls.items())
            print(f"  graph replay round {rnd}: {times}")
        for name, fn in calls.items():
            fn()
            torch.cuda.synchronize()
            rows = kernel_table(fn, a.repeats)
            print(f"  {name}: kernels per call (ms)")
            for ms, n, key in rows:
                print(f"    {ms:9.4f}  x{n:<4g} {key[:120]}")
            print(f"    {sum(r[0] for r in rows):9.4f}  total")
        del q, k, v, o, aw, pw
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

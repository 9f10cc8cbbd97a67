"""One-shot index builds (sp.build_index on the topic workload into a caller workspace), kernel by kernel: the
torch.profiler table of every CUDA kernel's time per build, or (--repeats small) a target for ncu.
Usage: python3 bench/lab/profile_index.py [L ...] [--config 'sp:rule=key_max;alpha=0.03'] [--repeats 5]
       ncu --clock-control none -k regex:key_max_kernel --launch-skip 1 --launch-count 1 --set full \\
         python3 bench/lab/profile_index.py 32768 --repeats 2 --no-table"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common, the benchmarks

from _common import index_workspace, require_cuda, topic
from bench_selection import config


def kernel_table(fn, repeats):
    """(ms per call, launches per call, name) of every CUDA kernel of `repeats` calls of fn, under torch.profiler,
    longest first."""
    acts = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages()
              if e.device_time_total > 0 and not e.key.startswith(("cudaLaunch", "aten::"))]
    events.sort(key=lambda e: -e.device_time_total)
    return [(e.device_time_total / 1e3 / repeats, e.count / repeats, e.key) for e in events]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("L", nargs="*", type=int, default=[32768], help="prompt lengths (default 32768)")
    ap.add_argument("--config", default="sp:rule=key_max;alpha=0.03", help="a bench_selection config name")
    ap.add_argument("--repeats", type=int, default=5, help="index builds per length (default 5)")
    ap.add_argument("--no-table", action="store_true", help="no torch.profiler (under ncu)")
    a = ap.parse_args(argv)
    sp = require_cuda()
    kw = config(a.config)
    for L in a.L:
        q, k, v = topic(L)
        cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
        args = (q, k, v, cu, cu, L, L)
        ws = index_workspace(*args, **kw)
        idx = sp.build_index(*args, **kw, workspace=ws)  # warm-up: the kernels' attributes, the caches
        torch.cuda.synchronize()
        if a.no_table:
            for _ in range(a.repeats):
                idx = sp.build_index(*args, **kw, workspace=ws)
            torch.cuda.synchronize()
        else:
            rows = kernel_table(lambda: sp.build_index(*args, **kw, workspace=ws), a.repeats)
            print(f"L {L} config {a.config}: per build (ms), {a.repeats} builds")
            for ms, n, key in rows:
                print(f"  {ms:9.3f}  x{n:<3g} {key[:110]}")
            print(f"  {sum(r[0] for r in rows):9.3f}  total kernel time")
        print("density", idx.density)
        del q, k, v, ws, idx
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

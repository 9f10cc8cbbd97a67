"""The price of a selection: its index stage on the speed workload at 128K, through the installed package.

For each configuration's library keyword arguments, sp.build_index on the "topic" workload (docs/workload.md: Hq 32,
Hkv 8, D 128, bf16, batch 1, causal; generated on the GPU by bench/_common.topic, the tensors bench_sparse.py times)
into a preallocated workspace, timed as bench_sparse.py times its index_ms: CUDA events around single synchronised
calls, the median of several (`index_ms`), and the GPU time of calls captured in a CUDA graph (`index_graph_ms`, None
when capture fails); `density` is that index's kept / visible blocks. Dense sp.attention at the same length is timed
in the same process (`dense_ms`), so index_ms / dense_ms is the index's share of a dense call.

A configuration's 'g' (head_subgroups=g) is the workload's group size, 32 / 8 = 4 (configs.resolve_g).
On the CPU (tests, argument checks) the same code path runs the CPU reference at a small L with wall-clock timing.

  python -m accuracy.index_cost --configs default,sp:rule=row_max;alpha=0.03;head_subgroups=g [--L 131072]
"""
import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))  # bench/: `accuracy` as a package, `_common`

from accuracy import configs as C  # noqa: E402

HQ, HKV, D = 32, 8, 128
L_DEFAULT = 131072


def _inputs(L, device, seed=0):
    if torch.device(device).type == "cuda":
        from _common import topic
        return topic(L, HQ, HKV, D, seed=seed, dev=device)
    import sparse_prefill as sp
    return tuple(torch.from_numpy(a) for a in sp.workload.topic(L, HQ, HKV, D, seed=seed))  # float32, CPU reference


def _timer(device):
    if torch.device(device).type == "cuda":
        from _common import time_graph_ms, time_ms
        return time_ms, time_graph_ms

    def wall_ms(fn, reps=3):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
        return sorted(ts)[len(ts) // 2]
    return wall_ms, None


def measure(library_args, L=L_DEFAULT, device="cuda", dense=True, log=print):
    """library_args: {name: library kwargs (may hold head_subgroups='g')} -> dict(L, dense_ms, rows={name:
    dict(index_ms, index_graph_ms, density, args, error)})."""
    import sparse_prefill as sp
    q, k, v = _inputs(L, device)
    cu = torch.tensor([0, L], dtype=torch.int32, device=q.device)
    timed, graphed = _timer(device)
    cuda = torch.device(device).type == "cuda"
    res = dict(L=L, workload=f"topic Hq {HQ} Hkv {HKV} D {D} {str(q.dtype).replace('torch.', '')}", rows={})
    if dense:
        out = torch.empty_like(q)
        if cuda:
            from _common import attention_workspace
            wsd = attention_workspace(D)
            res["dense_ms"] = timed(lambda: sp.attention(q, k, v, cu, cu, L, L, out=out, workspace=wsd,
                                                         return_lse=False))
            del wsd
        else:
            res["dense_ms"] = timed(lambda: sp.attention(q, k, v, cu, cu, L, L, return_lse=False))
        del out
        log(f"index_cost: dense sp.attention L={L}: {res['dense_ms']:.3f} ms")
    for name, args in library_args.items():
        a = C.resolve_g(args, HQ // HKV)
        row = dict(args=a, index_ms=None, index_graph_ms=None, density=None)
        try:
            if cuda:
                from _common import index_workspace
                ws = index_workspace(q, k, v, cu, cu, L, L, **a)

                def build():
                    return sp.build_index(q, k, v, cu, cu, L, L, workspace=ws, **a)
            else:
                def build():
                    return sp.build_index(q, k, v, cu, cu, L, L, **a)
            row["density"] = float(build().density)
            row["index_ms"] = timed(build)
            if graphed is not None:
                row["index_graph_ms"] = graphed(build)
            if cuda:
                del ws
                torch.cuda.synchronize()
        except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:  # a kwarg this package lacks, etc.
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        res["rows"][name] = row
        log(f"index_cost: {name} {a}: index {row['index_ms']} ms (graph {row['index_graph_ms']}), density "
            f"{row['density']}{' ' + row['error'] if 'error' in row else ''}")
    return res  # the 128K tensors (~1.5 GB) go with this frame; torch's allocator reuses their memory


def for_routes(routes, L=L_DEFAULT, device="cuda", log=print):
    """measure() for the Routes that have library arguments (one timing per distinct argument set)."""
    lib = {r.name: r.library_args for r in routes if r.library_args is not None}
    return measure(lib, L=L, device=device, log=log)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="default")
    ap.add_argument("--L", type=int, default=L_DEFAULT)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    routes = [C.parse(c, "sp") for c in args.configs.split(",") if c]
    res = for_routes([r for r in routes if r is not None], L=args.L, device=args.device)
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)
    return res


if __name__ == "__main__":
    main()

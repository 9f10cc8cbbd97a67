"""A/B of two builds of the package on the same shapes, in one run: the device-side guards against the code before
them (issue 19), a refactor against the code before it (issue 15: within 2 %).

    python bench/lab/ab_builds.py --base-site /tmp/ab-base-site --what "issue 19 guards" --out ab_guards_h200.json

`--base-site` holds the base build (e.g. main, `pip install --target`); the other variant is the package this Python
imports (the installed one, this tree). Each variant runs in its own worker process (two packages of one name cannot
share a process); the workers alternate, base, ours, base, ours, ... for --rounds rounds, so clock and thermal drift
fall on both. Every row times one call with CUDA events (median of --iters after warm-up): dense causal prefill
(contiguous, paged with TMA pages of 64, paged with pages of 16 through the cp.async gather), the split-KV short-
query path, sparse_prefill on the topic workload (index + sparse attention), a chunked-prefill last chunk and the
index stage alone (sp.build_index: `index_tile_energy`, FlashPrefill V2's rule as issue 16 states its targets,
`index_row_max`, the library default, `index_key_max`, the per-key rule at alpha 0.1) and the sparse kernel alone over bench_sparse.py's random 128-query-block
masks at 5 %, 20 % and 50 % (`sparse_random_5`, `sparse_random_20`, `sparse_random_50`: 5 % where the per-tile fill and drain weigh, the high densities where L2 reuse
decides) and over bench_sparse.py's own selection at 8K / 32K / 128K (`sparse_fpv2`: FlashPrefill V2's rule, no
correction, the issue 16 headline's attention); the speed reference shapes of DESIGN.md (Hq 32, Hkv 8, D 128, bf16).
The split-KV decode and chunked rows also run as CUDA-graph replays (`split_kv_decode_graph`, `chunked_last_1024_graph`:
the kernels without the host's launches).
`--kinds` keeps the rows of the named kinds (e.g. `--kinds index_tile_energy,index_row_max`). Issue 19's target: ours / base <= 1.01; issue 15's:
within 2 %. scripts/gpu.sh abbase builds the base from .deps/base.tar and runs this.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common, the benchmarks

HQ, HKV, D = 32, 8, 128


# Rows whose GPU work is shorter than a Python call's launches (split-KV decode: ~133 us of kernels in a 0.19 ms
# call, ncu) also get a `<kind>_graph` row, timed as CUDA-graph replays, so that a kernel
# change is gated on the kernels and host changes on the per-call row.
# The index rows too: at 32K the row-max index is ~0.4 ms of kernels, and one call's host prologue (before the first
# launch) counts in its event timing; the 2026-12-06 A/B measured index_row_max@32768 at 1.06-1.08 with its kernels'
# SASS identical to the base's, which the graph rows can tell from a host difference.
GRAPHED = ("split_kv_decode", "chunked_last_1024", "index_tile_energy", "index_row_max", "index_key_max",
           "index_exact_max", "index_exact_max_all")


def rows_of(quick):
    dense = [8192, 32768] if quick else [8192, 32768, 65536]
    sparse = [32768, 65536] if quick else [32768, 65536, 131072]
    r = [("dense", L, 0) for L in dense] + [("dense_paged64", 16384, 64), ("dense_paged16", 8192, 16),
                                            ("split_kv_decode", 65536, 64)]
    r += [("sparse_prefill", L, 0) for L in sparse] + [("chunked_last_1024", 65536, 64)]
    r += [(f"sparse_random_{d}", 65536, 0) for d in (5, 20, 50)]
    r += [("sparse_fpv2", L, 0) for L in (8192, 32768, 131072)]
    r += [(kind, L, 0) for kind in ("index_tile_energy", "index_row_max", "index_key_max", "index_exact_max")
          for L in (32768, 131072)]
    # exact_max with every visible block a candidate (candidate_alpha 0): the regime of the retrieval subjects and of
    # Gaussian inputs, where stage 2's per-candidate cost is the whole price (session 22: its cost slope moved
    # 6.45 -> 6.99 ms across sessions with the sink-units change, never A/B'd in one call); 32K only (~7 ms a call)
    r += [("index_exact_max_all", 32768, 0)]
    return r


def worker(args):
    import numpy as np
    import torch

    import sparse_prefill as sp
    from _common import SEL, time_graph_ms  # SEL: the benchmarks' selection (FlashPrefill V2's parameters)
    torch.manual_seed(0)
    dev = "cuda"
    bf = torch.bfloat16
    res = {"package": sp.__file__}

    def timed(fn):
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)

    def paged(k, v, page):  # page i of the sequence in slot perm[i] of the cache
        pages = k.shape[0] // page
        perm = torch.randperm(pages, device=dev)
        kc = torch.empty(pages, page, HKV, D, dtype=bf, device=dev)
        vc = torch.empty_like(kc)
        kc[perm] = k.view(pages, page, HKV, D)
        vc[perm] = v.view(pages, page, HKV, D)
        return kc, vc, perm.to(torch.int32)[None].contiguous()

    kinds = set(args.kinds.split(",")) if args.kinds else None
    for kind, L, page in rows_of(args.quick):
        if kinds is not None and kind not in kinds:
            continue
        q, k, v = (torch.from_numpy(x).to(dev, bf) for x in sp.workload.topic(L, HQ, HKV, D, seed=0))
        cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
        if kind == "dense":
            fn = lambda: sp.attention(q, k, v, cu, cu, L, L)
        elif kind.startswith("dense_paged"):
            kc, vc, bt = paged(k, v, page)
            used = torch.tensor([L], dtype=torch.int32, device=dev)
            fn = lambda: sp.attention(q, kc, vc, cu, None, L, L, block_table=bt, seqused_k=used)
        elif kind == "split_kv_decode":
            kc, vc, bt = paged(k, v, page)
            used = torch.tensor([L], dtype=torch.int32, device=dev)
            qd = q[-16:].contiguous()
            cq = torch.tensor([0, 16], dtype=torch.int32, device=dev)
            ws = torch.empty(sp.attention_workspace_bytes(D), dtype=torch.uint8, device=dev)
            fn = lambda: sp.attention(qd, kc, vc, cq, None, 16, L, block_table=bt, seqused_k=used, workspace=ws)
        elif kind == "sparse_prefill":
            n = sp.sparse_prefill_workspace_bytes(q, k, v, cu, cu, L, L)
            ws = torch.empty(n, dtype=torch.uint8, device=dev)
            fn = lambda: sp.sparse_prefill(q, k, v, cu, cu, L, L, workspace=ws)
        elif kind.startswith("sparse_random_"):  # the sparse kernel alone over bench_sparse's sweep mask
            from bench_sparse import random_index  # random 128-query-block masks, density from the kind's name
            host = sp.build_index(q, k, v, cu, cu, L, L, **dict(SEL, correction=False)).to_host()
            ridx, _ = random_index(sp, host, L, int(kind.rsplit("_", 1)[1]) / 100, HQ // HKV, per_query_block=True)
            n = sp.sparse_attention_workspace_bytes(q, k, v, ridx, cu, cu, L, L)
            ws = torch.empty(n, dtype=torch.uint8, device=dev)
            out = torch.empty_like(q)
            fn = lambda: sp.sparse_attention(q, k, v, ridx, cu, cu, L, L, out=out, workspace=ws)
        elif kind == "sparse_fpv2":  # the sparse kernel alone over bench_sparse's selection (FlashPrefill V2's rule)
            idx = sp.build_index(q, k, v, cu, cu, L, L, **dict(SEL, correction=False))
            out = torch.empty_like(q)
            fn = lambda: sp.sparse_attention(q, k, v, idx, cu, cu, L, L, out=out)
        elif kind.startswith("index_"):  # the index stage alone, into a caller workspace, with this row's rule
            sel = dict(SEL, rule=kind[len("index_"):], correction=False)
            if kind == "index_exact_max_all":
                sel.update(rule="exact_max", candidate_alpha=0.0, dense_fraction=1.0)  # the dense rule off: the stage
            n = sp.index_workspace_bytes(q, k, v, cu, cu, L, L, **sel)
            ws = torch.empty(n, dtype=torch.uint8, device=dev)
            fn = lambda: sp.build_index(q, k, v, cu, cu, L, L, workspace=ws, **sel)
        else:  # chunked: the last 1024 queries against the whole paged cache
            kc, vc, bt = paged(k, v, page)
            used = torch.tensor([L], dtype=torch.int32, device=dev)
            qc = q[-1024:].contiguous()
            cq = torch.tensor([0, 1024], dtype=torch.int32, device=dev)
            n = sp.chunked_prefill_workspace_bytes(qc, kc, vc, cq, bt, used, 1024, L)
            ws = torch.empty(n, dtype=torch.uint8, device=dev)
            fn = lambda: sp.chunked_prefill(qc, kc, vc, cq, bt, used, 1024, L, final_chunk=True, workspace=ws)
        res[f"{kind}@{L}"] = timed(fn)
        if kind in GRAPHED:  # the GPU time alone: these rows' per-call time is mostly host launches
            res[f"{kind}_graph@{L}"] = time_graph_ms(fn)
        del q, k, v
        torch.cuda.empty_cache()
    print(json.dumps(res))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-site", help="directory holding the base build's sparse_prefill package")
    ap.add_argument("--out", default="ab_builds.json")
    ap.add_argument("--what", default="A/B of two builds", help="what the A/B measures (recorded in the JSON)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kinds", default="", help="comma-separated row kinds to run (default: every row)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--iters", str(args.iters), "--warmup",
           str(args.warmup)] + (["--quick"] if args.quick else []) + (["--kinds", args.kinds] if args.kinds else [])
    runs = {"base": [], "ours": []}
    for r in range(args.rounds):
        for variant in ("base", "ours"):
            env = dict(os.environ)
            if variant == "base":
                env["PYTHONPATH"] = args.base_site + os.pathsep + env.get("PYTHONPATH", "")
            t0 = time.time()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/tmp")
            if p.returncode != 0:
                sys.stderr.write(p.stderr[-4000:])
                raise SystemExit(f"{variant} worker failed (round {r})")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            runs[variant].append(res)
            print(f"round {r} {variant}: {time.time() - t0:.0f} s, {res['package']}", flush=True)
    keys = [k for k in runs["ours"][0] if k != "package"
            and all(x.get(k) is not None for x in runs["base"] + runs["ours"])]  # a failed graph capture: no row
    rows = []
    for k in keys:
        b = statistics.median(x[k] for x in runs["base"])
        o = statistics.median(x[k] for x in runs["ours"])
        rows.append({"row": k, "base_ms": round(b, 4), "ours_ms": round(o, 4), "ratio": round(o / b, 4)})
        print(f"{k:28s} base {b:9.3f} ms  ours {o:9.3f} ms  ours/base {o / b:.4f}")
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    out = {"what": args.what + ": median of rounds of medians, CUDA events", "rows": rows,
           "device": gpu.stdout.strip().splitlines()[0] if gpu.returncode == 0 and gpu.stdout.strip() else "unknown",
           "commit": os.environ.get("SP_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
           "base_package": runs["base"][0]["package"], "ours_package": runs["ours"][0]["package"],
           "command": " ".join(sys.argv), "through_package": True}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Host overhead of one chunked-prefill step (issue 14): the public sparse_prefill.chunked_prefill against the torch
operator (sparse_prefill.torch_ops), for chunk C x batch B against an L-token paged cache.

Default (the issue's target case): the last-but-one chunk of a 128K prompt, C = 1024, B = 1, page 64, Hq 32, Hkv 8,
D 128, bf16, final_chunk=False, topic workload (docs/workload.md; generated here on the device), per-tile selection with
the pooled-means cache as the earlier steps leave it (they are run first, through the public function).

Per variant (row):
  host_us            host time per call: batches of `--burst` calls issued back to back on an idle GPU (the launch
                     queue never fills, so the host is never blocked), median over batches, per call;
  eager_us           steady-state eager loop: `--loop` calls then one synchronize, per call (what an engine that
                     enqueues ahead pays per step: max(host, GPU) plus gaps);
  graph_us           the same call captured once in a torch.cuda.CUDAGraph, `--loop` replays then one synchronize,
                     per replay (~GPU time; CUDA only);
  graph_gpu_us       CUDA-event time per replay of a graph holding `--graph-calls` calls (GPU time without the
                     replay's own launch);
  eager_over_graph   eager_us / graph_us (issue 14 target for the torch op: <= 1.3).
Variants: public (sp.chunked_prefill), public_out (out=), public_ws (out= and a workspace allocated once, CUDA), op
(torch_ops.chunked_prefill), op_out (out=), adapter / adapter_dense (an engine adapter's step into out=:
integrations.core.VarlenDispatch, sparse and forced dense), op_kernel_direct (the operator's kernel without the torch
dispatcher), with
--custom-op custom_op (the operator's kernel registered through torch.library.custom_op), and with --no-mean-cache
the same without the mean cache.

--python-only replaces the extension's compute entry points by no-ops: what is left is the Python side of each
path (argument handling, allocation, DLPack export), measurable on a CPU-only machine (--device cpu, tiny shapes).
--profile adds the top functions of a cProfile run of each variant.

Writes --out (one file per invocation: --custom-op runs go to their own, host_overhead_custom_op_h200.json) and, with
matplotlib, its plot beside it (.png): per variant the host time per call against the GPU time of the step, and the
eager loop over the graph replay against issue 14's 1.3.

Usage (H200): python3 bench/bench_host_overhead.py --out bench/results/host_overhead_h200.json
CPU (Python side only): python3 bench/bench_host_overhead.py --device cpu --python-only --context 256 --chunk 64 \
    --heads 4,2 --out /tmp/host_cpu.json
Redraw a file's PNG (no GPU, no package): python3 bench/bench_host_overhead.py --plot-only RESULTS_JSON
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from typing import Optional, Tuple

import torch

from _common import RESULTS, add_plot_only, plot_only, topic, try_plot, write_results

# sparse_prefill, sparse_prefill.torch_ops and the adapters' dispatch, imported by main() (--help, --plot-only: not
# needed)
sp = spt = VarlenDispatch = SparsePrefillConfig = None

PAGE, BLOCK = 64, 128


class Step:
    """B prompts of L tokens in a paged cache (pages of 64, permuted), and the step of chunk [L - C, L)."""

    def __init__(self, L, C, B, hq, hkv, d, dev, dtype, mean_cache):
        pages = (L + PAGE - 1) // PAGE
        qs, ks, vs = [], [], []
        for b in range(B):
            q, k, v = topic(L, hq, hkv, d, seed=b, dev=dev, dtype=torch.float32)
            q = q[L - C:]
            pad = pages * PAGE - L
            qs.append(q.to(dtype))
            ks.append(torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).to(dtype).view(pages, PAGE, hkv, d))
            vs.append(torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).to(dtype).view(pages, PAGE, hkv, d))
        perm = torch.randperm(B * pages, generator=torch.Generator().manual_seed(1)).to(dev)
        self.k_cache = torch.empty(B * pages, PAGE, hkv, d, dtype=dtype, device=dev)
        self.v_cache = torch.empty_like(self.k_cache)
        self.k_cache[perm] = torch.cat(ks)
        self.v_cache[perm] = torch.cat(vs)
        self.block_table = perm.view(B, pages).to(torch.int32).contiguous()
        self.q = torch.cat(qs).contiguous()
        self.cu_seqlens_q = torch.arange(0, (B + 1) * C, C, dtype=torch.int32, device=dev)
        self.seqused_k = torch.full((B,), L, dtype=torch.int32, device=dev)
        self.C, self.L = C, L
        self.means = None
        if mean_cache:  # the earlier steps of the prompt, through the public function, fill the cache
            self.means = sp.mean_cache(self.k_cache, block_size=BLOCK)
            prefix = 8192
            for c0 in range(0, L - C, prefix):
                c1 = min(L - C, c0 + prefix)
                # the earlier chunks' queries do not change what they write (the means depend on the keys only)
                qq = torch.zeros(B * (c1 - c0), hq, d, dtype=dtype, device=dev)
                cu = torch.arange(0, (B + 1) * (c1 - c0), c1 - c0, dtype=torch.int32, device=dev)
                used = torch.full((B,), c1, dtype=torch.int32, device=dev)
                sp.chunked_prefill(qq, self.k_cache, self.v_cache, cu, self.block_table, used, c1 - c0, c1,
                                   final_chunk=False, mean_cache=self.means)
            if dev != "cpu":
                torch.cuda.synchronize()

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.cu_seqlens_q, self.block_table, self.seqused_k, self.C,
                self.L)


def custom_op_chunked():
    """The operator's kernel registered through torch.library.custom_op instead (for --custom-op: what its Python
    autograd layer and aliasing check cost per call)."""
    @torch.library.custom_op("sp_bench::chunked_prefill", mutates_args=("mean_k", "mean_v"))
    def chunked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                block_table: torch.Tensor, seqused_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                final_chunk: bool, softmax_scale: Optional[float] = None, return_lse: bool = False,
                mean_k: Optional[torch.Tensor] = None,
                mean_v: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        # the library's default selection (the variants here pass none)
        return spt._chunked_kernel(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q,
                                   max_seqlen_k, final_chunk, softmax_scale, return_lse, mean_k, mean_v)

    chunked.register_fake(spt._fake_chunked)
    return torch.ops.sp_bench.chunked_prefill.default


def variants(step, use_means, custom_op=None):
    a = step.args()
    mc = step.means if use_means else None
    mk, mv = mc if mc is not None else (None, None)
    out = torch.empty_like(step.q)
    sfx = "" if use_means else "_no_mean_cache"
    v = {
        "public" + sfx: lambda: sp.chunked_prefill(*a, final_chunk=False, mean_cache=mc),
        "public_out" + sfx: lambda: sp.chunked_prefill(*a, final_chunk=False, mean_cache=mc, out=out),
        "op" + sfx: lambda: spt.chunked_prefill(*a, final_chunk=False, mean_cache=mc),
        "op_out" + sfx: lambda: spt.chunked_prefill(*a, final_chunk=False, mean_cache=mc, out=out),
    }
    if step.q.is_cuda and hasattr(sp, "chunked_prefill_workspace_bytes"):
        n = sp.chunked_prefill_workspace_bytes(*a, final_chunk=False)
        ws = torch.empty(((n + 3) // 4 or 1,), dtype=torch.int32, device=step.q.device)  # allocated once
        v["public_ws" + sfx] = lambda: sp.chunked_prefill(*a, final_chunk=False, mean_cache=mc, out=out,
                                                          workspace=ws)
    # an engine adapter's step (integrations.core.VarlenDispatch, as vLLM / SGLang call it): sparse, and forced dense
    disp = VarlenDispatch(SparsePrefillConfig.load(environ={}, min_sparse_q_len=1, min_sparse_kv_len=0,
                                                   final_chunk="never"))
    q, kc, vc, cu, bt, used, C, L = a
    v["adapter" + sfx] = lambda: disp(q, kc, vc, cu, None, C, L, out=out, block_table=bt, seqused_k=used,
                                      mean_cache=mc)
    v["adapter_dense" + sfx] = lambda: disp(q, kc, vc, cu, None, C, L, out=out, block_table=bt, seqused_k=used,
                                            force_dense=True)
    # the operator's kernel called without the dispatcher: what dispatching through torch.ops costs per call
    v["op_kernel_direct" + sfx] = lambda: spt._chunked_out_kernel(*a, out, False, mean_k=mk, mean_v=mv)
    if custom_op is not None:
        v["custom_op" + sfx] = lambda: custom_op(*a, False, mean_k=mk, mean_v=mv)
    return v


def _sync(dev):
    if dev != "cpu":
        torch.cuda.synchronize()


def host_us(fn, dev, burst, batches):
    per = []
    for _ in range(batches):
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        per.append((time.perf_counter() - t0) / burst * 1e6)
    return statistics.median(per), min(per)


def eager_us(fn, dev, loop, reps=5):
    res = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(loop):
            fn()
        _sync(dev)
        res.append((time.perf_counter() - t0) / loop * 1e6)
    return statistics.median(res)


def graph_us(fn, loop, graph_calls, reps=5):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        fn()
    gn = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gn):
        for _ in range(graph_calls):
            fn()
    replay = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(loop):
            g1.replay()
        torch.cuda.synchronize()
        replay.append((time.perf_counter() - t0) / loop * 1e6)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(reps):
        gn.replay()
        s.record()
        for _ in range(max(1, loop // graph_calls)):
            gn.replay()
        e.record()
        torch.cuda.synchronize()
        gpu.append(s.elapsed_time(e) * 1e3 / (max(1, loop // graph_calls) * graph_calls))
    return statistics.median(replay), statistics.median(gpu)


def profile_top(fn, n, top=15):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue().splitlines()


class _NoCompute:
    """Stands in for sparse_prefill._C: the compute entry points do nothing (--python-only)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        if name in ("attention", "sparse_prefill", "build_index", "sparse_attention"):
            return lambda *a, **k: None
        return getattr(self._real, name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "host_overhead_h200.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", default="32,8", help="Hq,Hkv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--no-mean-cache", action="store_true", help="also the variants without the mean cache")
    ap.add_argument("--burst", type=int, default=20)
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--loop", type=int, default=500)
    ap.add_argument("--graph-calls", type=int, default=10)
    ap.add_argument("--python-only", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--custom-op", action="store_true",
                    help="also the same kernel registered through torch.library.custom_op (variant custom_op)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (scripts/gpu.sh bench phase)")
    add_plot_only(ap)
    args = ap.parse_args()
    if args.plot_only:
        return plot_only(plot, args.plot_only)
    global sp, spt, VarlenDispatch, SparsePrefillConfig
    import sparse_prefill as sp
    import sparse_prefill.torch_ops as spt
    from sparse_prefill.integrations.core import SparsePrefillConfig, VarlenDispatch
    if args.quick:
        args.batches, args.loop = min(args.batches, 40), min(args.loop, 200)
    dev = args.device
    cuda = dev != "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    hq, hkv = (int(x) for x in args.heads.split(","))
    step = Step(args.context, args.chunk, args.batch, hq, hkv, args.head_dim, dev, dtype, mean_cache=True)
    if args.python_only:
        import sparse_prefill._api as api
        for mod in api._MODULES:  # the modules of the public functions, each with its own global _C
            mod._C = _NoCompute(mod._C)
        spt._C = _NoCompute(spt._C)
    custom = custom_op_chunked() if args.custom_op else None
    todo = dict(variants(step, True, custom))
    if args.no_mean_cache:
        todo.update(variants(step, False, custom))
    rows = []
    for name, fn in todo.items():
        for _ in range(20):
            fn()
        _sync(dev)
        h_med, h_min = host_us(fn, dev, args.burst, args.batches)
        row = dict(variant=name, L=args.context, chunk=args.chunk, batch=args.batch, final_chunk=False,
                   mean_cache=not name.endswith("_no_mean_cache"), host_us=h_med, host_min_us=h_min,
                   eager_us=eager_us(fn, dev, args.loop))
        if cuda and not args.python_only:
            try:
                g, g_gpu = graph_us(fn, args.loop, args.graph_calls)
                row.update(graph_us=g, graph_gpu_us=g_gpu, eager_over_graph=row["eager_us"] / g,
                           host_over_graph=h_med / g)
            except Exception as e:  # noqa: BLE001  (a variant that cannot be captured: recorded, not fatal)
                row["graph_error"] = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize()
        if args.profile:
            row["profile"] = profile_top(fn, 2000)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        rows.append(row)
    res = write_results(args.out, rows, device=torch.cuda.get_device_name() if cuda else "cpu",
                        python_only=args.python_only,
                        workload=f"topic (docs/workload.md), Hq={hq} Hkv={hkv} D={args.head_dim} {str(dtype)[6:]}, "
                                 f"paged KV page {PAGE}, chunk [L - C, L) of every prompt, final_chunk=False, "
                                 "per-tile selection",
                        target="op eager_over_graph <= 1.3 (issue 14)")
    try_plot(plot, res, os.path.splitext(args.out)[0] + ".png")


def plot(res, path):
    """Left: per variant the host time per call (bar: median over bursts; tick: minimum) against the step's GPU
    time (graph_gpu_us, the median over variants: the same kernels); right: eager loop / graph replay per variant
    against issue 14's 1.3 (absent from --python-only / CPU files, which have no graph times)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["rows"]
    names = [r["variant"] for r in rows]
    y = range(len(rows))
    graphs = [r for r in rows if r.get("eager_over_graph")]
    fig, axes = plt.subplots(1, 2 if graphs else 1, figsize=(13 if graphs else 7, 0.45 * len(rows) + 2.6),
                             squeeze=False)
    a = axes[0][0]
    a.barh(list(y), [r["host_us"] for r in rows], color="C0", label="host time per call (median of bursts)")
    a.scatter([r["host_min_us"] for r in rows], list(y), marker="|", s=200, color="k", label="minimum", zorder=3)
    for j, r in zip(y, rows):
        a.annotate(f"{r['host_us']:.0f} us (min {r['host_min_us']:.0f})", (r["host_us"], j),
                   textcoords="offset points", xytext=(3, -3), fontsize=7)
    gpu = sorted(r["graph_gpu_us"] for r in rows if r.get("graph_gpu_us"))
    if gpu:
        a.axvline(gpu[len(gpu) // 2], color="C3", ls="--", label=f"GPU time of the step ({gpu[len(gpu) // 2]:.0f} us)")
    a.set_yticks(list(y), names, fontsize=8)
    a.invert_yaxis()
    a.set_xlabel("us")
    r0 = rows[0]
    a.set_title(f"host time of one chunked step: chunk {r0['chunk']} x {r0['batch']} at {r0['L'] // 1024}K "
                f"({res.get('device', '')}, {str(res.get('commit', ''))[:7]})", fontsize=9)
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    if graphs:
        b = axes[0][1]
        yy = [names.index(r["variant"]) for r in graphs]
        b.barh(yy, [r["eager_over_graph"] for r in graphs], color="C1")
        for j, r in zip(yy, graphs):
            b.annotate(f"{r['eager_over_graph']:.3f}", (r["eager_over_graph"], j), textcoords="offset points",
                       xytext=(3, -3), fontsize=7)
        b.axvline(1.3, color="grey", ls="--", label="target <= 1.3 (issue 14, the torch op)")
        b.axvline(1.0, color="grey", lw=0.5)
        b.set_yticks(list(y), names, fontsize=8)
        b.set_ylim(a.get_ylim())
        b.set_xlim(0, max(1.45, 1.1 * max(r["eager_over_graph"] for r in graphs)))
        b.set_xlabel("eager loop / CUDA-graph replay (time per call)")
        b.set_title("what an engine that enqueues ahead pays over a graph", fontsize=9)
        b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

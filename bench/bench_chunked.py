"""Chunked-prefill benchmark on the GPU machine (issue 5) through the installed package: one step = C new queries per
sequence (the last C positions of an L-token prompt, their K/V already in a paged cache, page 64) against the
sequence's whole cache, causal.

Per (L, chunk, batch) row, the prompt's last chunk (final_chunk=True) on the topic workload (docs/workload.md):
  dense_attn_ms     our dense paged step (sp.attention as it dispatches, caller workspace);
  tile_*            per-tile CSR (FlashPrefill V2 selection, correction on): select_ms (sp.build_index into a caller
                    workspace, pooling of the whole cache included), select_cached_ms (with the pooled-means cache
                    holding the blocks before the chunk, as earlier steps left it: only the chunk's blocks are pooled),
                    attn_ms (sp.sparse_attention over the device index), density;
  union_*           union lists per (sequence, KV head) (CompactAttention, correction off): select_ms (index stage +
                    union kernel), attn_ms, density (after the union); union_tile_density: the density of the per-tile
                    lists before the union (an index built with union=False, same selection: the device index
                    reports kept / visible blocks only);
  union_s{S}_*      with --union-subgroups: union mode with head_subgroups = S (one list per sub-group of g / S
                    query heads of each KV head), same keys as union_*;
  mid_*             the same step when the chunk does not end the prompt (final_chunk=False: no dense tail), both
                    modes;
  speedup_*         dense_attn_ms / (select_ms + attn_ms); speedup_*_cached with select_cached_ms.
  *_graph_ms        the same work timed as CUDA-graph replays (_common.time_graph_ms): GPU time without the host's
                    enqueue gaps, which per-call events count when a call's GPU work is shorter than its Python and
                    launch overhead (a ~0.1 ms selection at chunk 1024 x batch 1); dense step, per-tile selection with
                    the cache and per-tile attention; speedup_tile_cached_graph and
                    tile_select_cached_graph_share_of_dense from them.
  tile_step_*       the engine's one call, sp.chunked_prefill(final_chunk=..., mean_cache=, workspace=): call_ms
                    (per-call events: host + GPU) and graph_ms; tile_step_call_over_graph is the host-overhead ratio
                    issue 14 bounds (1.3x at chunk 1024 x batch 1, 128K).
Whole-prompt rows (--prompt): every chunk of an L-token prompt, batch 1, summed: dense vs union vs per-tile.
--quick: contexts 32K and 128K, chunk 1024, batches 1 and 8, no whole-prompt rows.
Writes bench/results/chunked_h200.json and, with matplotlib, chunked_h200.png.
Usage: python3 bench/bench_chunked.py [--contexts 32768,131072] [--chunks 1024,8192] [--batches 1,8] [--quick]
       python3 bench/bench_chunked.py --plot-only bench/results/chunked_h200.json   (redraw its PNG, no GPU)"""
import argparse
import os

import torch

from _common import (D, HKV, HQ, RESULTS, SEL, apply_profile, attention_workspace, emit, index_workspace, ints,
                     require_cuda, time_graph_ms, time_ms, try_plot, workspace, write_results)
from _common import add_plot_only, plot_only
from _common import topic

PAGE = 64

FULL = dict(contexts="32768,65536,131072", chunks="1024,4096,8192", batches="1,8", prompt="131072:8192")
QUICK = dict(contexts="32768,131072", chunks="1024", batches="1,8", prompt="")


class Cache:
    """`batch` topic prompts of L tokens in a paged cache (pages of 64 tokens, randomly permuted).
    make(L, seed) -> (q, k, v) bf16 CUDA tensors; default: bench_sparse.topic (the GPU generator)."""

    def __init__(self, L, batch, dev="cuda", make=None):
        make = make or (lambda n, seed: topic(n, seed=seed))
        self.L, self.batch = L, batch
        pages = L // PAGE
        self.q, ks, vs = [], [], []
        for b in range(batch):
            q, k, v = make(L, b)
            self.q.append(q)
            ks.append(k.view(pages, PAGE, HKV, D))
            vs.append(v.view(pages, PAGE, HKV, D))
        perm = torch.randperm(batch * pages, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
        self.k = torch.empty(batch * pages, PAGE, HKV, D, dtype=torch.bfloat16, device=dev)
        self.v = torch.empty_like(self.k)
        self.k[perm] = torch.cat(ks)
        self.v[perm] = torch.cat(vs)
        self.block_table = perm.view(batch, pages).to(torch.int32).contiguous()
        del ks, vs

    def mean_cache(self, upto, k=None, v=None):
        """A pooled-means cache (sp.mean_cache) holding the complete blocks of positions [0, upto) of every prompt,
        as the steps of the earlier chunks leave it (filled here with torch: float32 means, the documented slot of
        each block: the page holding its last key). k, v: the values to pool, laid out as self.k / self.v (default
        those; an FP8 cache passes its dequantised values: its slots hold real-unit means)."""
        import sparse_prefill as sp
        k = self.k if k is None else k
        v = self.v if v is None else v
        bs = SEL["block_size"]
        km, vm = sp.mean_cache(k, bs)
        nb = upto // bs
        if nb == 0:
            return km, vm
        for b in range(self.batch):
            pages = self.block_table[b, :nb * bs // PAGE].long()
            kb = k[pages].float().reshape(nb, bs, HKV, D).mean(1)
            vb = v[pages].float().reshape(nb, bs, HKV, D).mean(1)
            last = torch.arange(nb, device=self.k.device) * bs + bs - 1          # each block's last key
            page = self.block_table[b, last // PAGE].long()
            slot = page * (PAGE // bs) + (last % PAGE) // bs if PAGE >= bs else page
            km[slot] = kb
            vm[slot] = vb
        return km, vm

    def step(self, c0, c1):
        """Inputs of the step whose queries are positions [c0, c1) of every prompt (cache filled up to c1)."""
        dev = self.k.device
        q = torch.cat([qb[c0:c1] for qb in self.q]).contiguous()
        C = c1 - c0
        cu_q = torch.arange(0, (self.batch + 1) * C, C, dtype=torch.int32, device=dev)
        used = torch.full((self.batch,), c1, dtype=torch.int32, device=dev)
        return q, cu_q, used, C, c1


def measure_step(sp, cache, c0, c1, final, modes=("tile", "union"), means=None, graph=False, subgroups=()):
    """One step; `means`: the pooled-means cache as the earlier steps left it (cache.mean_cache(c0)), or None.
    graph: also the CUDA-graph timings (*_graph_ms) of the dense step and the per-tile mode with the cache."""
    q, cu_q, used, C, Lk = cache.step(c0, c1)
    kw = dict(block_table=cache.block_table, seqused_k=used)
    args = (q, cache.k, cache.v, cu_q, None, C, Lk)
    out = torch.empty_like(q)
    wsd = attention_workspace(D)
    dense = lambda: sp.attention(*args, out=out, workspace=wsd, **kw)  # noqa: E731
    row = dict(dense_attn_ms=time_ms(dense), dense_path=sp.attention_path(*args, **kw))
    if graph:
        row["dense_attn_graph_ms"] = time_graph_ms(dense)
    modes = list(modes) + [f"union_s{S}" for S in subgroups]
    per_tile_density = {}  # head_subgroups -> density of the per-tile lists (no mean cache)
    for mode in modes:
        union = mode.startswith("union")
        S = int(mode[len("union_s"):]) if mode.startswith("union_s") else 1 if union else SEL["head_subgroups"]
        sel = dict(SEL, correction=not union, final_chunk=final, union=union, head_subgroups=S)
        ws = index_workspace(*args, **kw, **sel)

        def build(m=None):
            return sp.build_index(*args, **kw, **sel, workspace=ws, mean_cache=m)
        idx = build()
        row[f"{mode}_density"] = idx.density
        if not union:
            per_tile_density[S] = row[f"{mode}_density"]
        else:
            if S not in per_tile_density:  # the per-tile lists before the union: same selection, union=False
                tile_sel = dict(sel, union=False)
                per_tile_density[S] = sp.build_index(*args, **kw, **tile_sel,
                                                     workspace=index_workspace(*args, **kw, **tile_sel)).density
            row[f"{mode}_tile_density"] = per_tile_density[S]
        row[f"{mode}_select_ms"] = time_ms(build)
        attn = lambda: sp.sparse_attention(q, cache.k, cache.v, idx, cu_q, None, C, Lk, out=out, **kw)  # noqa
        row[f"{mode}_attn_ms"] = time_ms(attn)
        row[f"{mode}_total_ms"] = row[f"{mode}_select_ms"] + row[f"{mode}_attn_ms"]
        row[f"speedup_{mode}"] = row["dense_attn_ms"] / row[f"{mode}_total_ms"]
        row[f"{mode}_select_share_of_dense"] = row[f"{mode}_select_ms"] / row["dense_attn_ms"]
        if means is not None:
            idx_c = build(means)
            row[f"{mode}_density_cached"] = idx_c.density   # equal up to float32 rounding of the means
            row[f"{mode}_select_cached_ms"] = time_ms(lambda: build(means))
            row[f"{mode}_total_cached_ms"] = row[f"{mode}_select_cached_ms"] + row[f"{mode}_attn_ms"]
            row[f"speedup_{mode}_cached"] = row["dense_attn_ms"] / row[f"{mode}_total_cached_ms"]
            row[f"{mode}_select_cached_share_of_dense"] = row[f"{mode}_select_cached_ms"] / row["dense_attn_ms"]
            if graph and mode == "tile":
                if row.get("dense_attn_graph_ms"):
                    sel_g = time_graph_ms(lambda: build(means))
                    # (every build of this mode writes the same workspace, which `idx` reads: the attention below
                    # runs over the index the last build left there, as the shim's DeviceIndex did)
                    attn_g = time_graph_ms(attn)
                    if sel_g and attn_g:
                        dense_g = row["dense_attn_graph_ms"]
                        row.update(tile_select_cached_graph_ms=sel_g, tile_attn_graph_ms=attn_g,
                                   speedup_tile_cached_graph=dense_g / (sel_g + attn_g),
                                   tile_select_cached_graph_share_of_dense=sel_g / dense_g)
                # The engine's one call: chunked_prefill with the mean cache and its workspace.
                ws_step = workspace(sp.chunked_prefill_workspace_bytes(q, cache.k, cache.v, cu_q, cache.block_table,
                                                                       used, C, Lk, **sel), q.device)
                one = {k_: v_ for k_, v_ in sel.items() if k_ != "final_chunk"}
                step = lambda: sp.chunked_prefill(q, cache.k, cache.v, cu_q, cache.block_table, used, C, Lk,  # noqa
                                                  final_chunk=final, mean_cache=means, out=out, workspace=ws_step,
                                                  **one)
                row["tile_step_call_ms"] = time_ms(step)
                row["tile_step_graph_ms"] = time_graph_ms(step)
                if row["tile_step_graph_ms"]:
                    row["tile_step_call_over_graph"] = row["tile_step_call_ms"] / row["tile_step_graph_ms"]
                del ws_step
        del ws, idx
    return row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(RESULTS, "chunked_h200.json"))
    add_plot_only(ap)
    ap.add_argument("--quick", action="store_true", help="short run (see above): about a minute on the H200")
    ap.add_argument("--contexts", default=None, help=f"prompt lengths L (default {FULL['contexts']}; --quick "
                                                     f"{QUICK['contexts']})")
    ap.add_argument("--chunks", default=None, help=f"chunk sizes C (default {FULL['chunks']})")
    ap.add_argument("--batches", default=None, help=f"batch sizes (default {FULL['batches']})")
    ap.add_argument("--prompt", default=None, help=f"L:chunk of the whole-prompt rows ('' to skip; default "
                                                   f"{FULL['prompt']}, --quick skips them)")
    ap.add_argument("--union-subgroups", default="", help="head_subgroups values S > 1: union rows union_s{S}_*")
    ap.add_argument("--rule", default=SEL["rule"],
                    choices=["tile_energy", "row_max", "probe_row_max", "probe_row_mass", "key_max"],
                    help="selection rule (docs/semantics.md; row_max: the library default); the rows record it")
    ap.add_argument("--alpha", type=float, default=SEL["alpha"])
    ap.add_argument("--mean-alpha", type=float, default=SEL.get("mean_alpha", 0.5),
                    help="the probe rules' pooled-means term")
    ap.add_argument("--key-rank", type=int, default=None, choices=[16, 32],
                    help="key_max's residual rank (default: the library's)")
    ap.add_argument("--head-subgroups", type=int, default=SEL.get("head_subgroups", 1),
                    help="selections per GQA group of the tile rows (4: one per query head here)")
    args = apply_profile(ap.parse_args(argv), QUICK, FULL)
    # every step below uses them
    SEL.update(rule=args.rule, alpha=args.alpha, mean_alpha=args.mean_alpha, head_subgroups=args.head_subgroups)
    if args.key_rank is not None:
        SEL.update(key_rank=args.key_rank)
    for name in ("contexts", "chunks", "batches", "union_subgroups"):
        ints(getattr(args, name))  # fail on bad lists before the GPU work
    if args.prompt:
        parts = args.prompt.split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            ap.error(f"--prompt: expected L:chunk, got {args.prompt!r}")
    for L in ints(args.contexts):
        if L % PAGE or L % SEL["block_size"]:
            ap.error(f"--contexts: {L} is not a multiple of the page ({PAGE}) and block ({SEL['block_size']})")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.plot_only:
        return plot_only(plot, args.plot_only)
    sp = require_cuda()
    rows, prompts = [], []
    meta = dict(workload=f"topic (docs/workload.md), Hq={HQ} Hkv={HKV} D={D} bf16, paged KV page {PAGE}, causal",
                selection=SEL, prompts=prompts)
    sub = ints(args.union_subgroups)
    for batch in ints(args.batches):
        for L in ints(args.contexts):
            cache = Cache(L, batch)
            for C in ints(args.chunks):
                row = dict(L=L, chunk=C, batch=batch, mode="last chunk", final_chunk=True)
                means = cache.mean_cache(L - C)
                row.update(measure_step(sp, cache, L - C, L, True, means=means, graph=True, subgroups=sub))
                mid = measure_step(sp, cache, L - C, L, False, means=means, graph=True, subgroups=sub)
                del means
                row.update({f"mid_{k}": v for k, v in mid.items() if k.startswith(("union", "tile", "speedup"))})
                if "dense_attn_graph_ms" in mid:
                    row["mid_dense_attn_graph_ms"] = mid["dense_attn_graph_ms"]
                row["dense_attn_total_ms"] = row["dense_attn_ms"]  # per step; prompt totals are in `prompts`
                emit(row)
                rows.append(row)
                write_results(args.out, rows, **meta)  # after every row: a run cut short still leaves its rows
            del cache
            torch.cuda.empty_cache()
    if args.prompt:
        L, C = (int(x) for x in args.prompt.split(":"))
        cache = Cache(L, 1)
        keys = ("dense_attn_ms", "union_total_ms", "union_attn_ms", "tile_total_ms", "tile_attn_ms",
                "union_total_cached_ms", "tile_total_cached_ms")
        tot = dict(L=L, chunk=C, batch=1, mode="whole prompt", steps=0, **{k: 0.0 for k in keys})
        # One pooled-means cache through the whole prompt, from its first chunk (as an engine would run it): each
        # step's untimed first build_index call writes the blocks its chunk completes.
        means = cache.mean_cache(0)
        for c0 in range(0, L, C):
            c1 = min(L, c0 + C)
            r = measure_step(sp, cache, c0, c1, c1 == L, means=means)
            for key in keys:
                tot[key] += r[key]
            tot["steps"] += 1
        tot["attn_reduction_union"] = tot["dense_attn_ms"] / tot["union_attn_ms"]
        tot["attn_reduction_tile"] = tot["dense_attn_ms"] / tot["tile_attn_ms"]
        tot["total_reduction_union"] = tot["dense_attn_ms"] / tot["union_total_ms"]
        tot["total_reduction_tile"] = tot["dense_attn_ms"] / tot["tile_total_ms"]
        tot["total_reduction_union_cached"] = tot["dense_attn_ms"] / tot["union_total_cached_ms"]
        tot["total_reduction_tile_cached"] = tot["dense_attn_ms"] / tot["tile_total_cached_ms"]
        emit(tot)
        prompts.append(tot)
    res = write_results(args.out, rows, **meta)
    try_plot(plot, res, os.path.splitext(args.out)[0] + ".png")


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for batch in sorted({r["batch"] for r in res["rows"]}):
        for mode in ("tile", "union"):
            for C in sorted({r["chunk"] for r in res["rows"]}):
                rs = [r for r in res["rows"] if r["batch"] == batch and r["chunk"] == C]
                ax.plot([r["L"] for r in rs], [r.get(f"speedup_{mode}_cached", r[f"speedup_{mode}"]) for r in rs],
                        marker="o",
                        ls="-" if mode == "union" else "--", label=f"{mode}, chunk {C}, batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context L")
    ax.set_ylabel("dense paged step / (select with mean cache + sparse attn)")
    ax.set_title("last chunk of an L-token prompt, topic workload")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

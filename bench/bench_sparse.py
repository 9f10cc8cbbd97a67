"""Block-sparse prefill on the GPU machine (issue 4) through the installed package: ours (sp.build_index into a caller
workspace + sp.sparse_attention over the device index) vs our dense kernel (sp.attention), torch SDPA cuDNN, torch
SDPA flash (FA2) and FlexAttention running the very same block mask (its BlockMask built from our CSR), one process.

Speed rows: the "topic" workload of docs/workload.md (Hq=32, Hkv=8, D=128, bf16, batch 1, causal), default selection
parameters (alpha 0.1, block 128, sink 256, window 512, last_n 2, correction on):
  density, index_ms, attn_ms (correction on), index_no_corr_ms and attn_no_corr_ms (an index built with
  correction=False, the library's default: the same selection, V not pooled), total_ms = index_ms + attn_ms,
  total_no_corr_ms = index_no_corr_ms + attn_no_corr_ms, sparse_prefill_no_corr_ms (the one-call sp.sparse_prefill
  without correction, the path a user of the defaults takes: the host enqueues the attention under the index's
  kernels) and speedup_prefill_no_corr_vs_cudnn, fused_ms (both launched back to back, timed together),
  index_graph_ms (the index stage's GPU time without the host's enqueue time: build_index captured in a CUDA
  graph; index_ms counts it per call), sparse_prefill_ms (the one-call sp.sparse_prefill with its workspace),
  dense_ms (ours), cudnn_ms, fa2_ms,
  flex_same_mask_ms (correction off: FlexAttention has no mean correction, so compare it with attn_no_corr_ms).
  (Files before the banded tile order left the API also hold attn_no_corr_banded_ms / banded_vs_default.)
Accuracy columns (same rows): rel_err / rel_err_no_correction = ||O_sparse - O_dense||_F / ||O_dense||_F on the
  structured workload at the same L (our dense kernel as full attention), and needle_ratio_min = the smallest, over
  the workload's retrieval needles, of cos(O_sparse, v_needle) / cos(O_dense, v_needle) averaged over the needle's
  query rows (1.0: the needle dominates the output as in dense).
Sweep rows (--sweep-lengths): random block masks of fixed density (diagonal block always kept), correction off:
  attn_ms against density * dense_ms (earlier files: attn_banded_ms / banded_ratio_to_ideal, the banded order); mask
  "query_block" draws per (KV head, 128 query positions) as a 128x128 block mask does, mask "tile" independently per
  32-position PackGQA tile (no reuse of K/V between tiles: DRAM-bound at high density). These run a host index (made
  from the random CSR) with a caller workspace.
Long rows (--long-lengths, e.g. 1048576; issue 16): one prompt past what the repeated-timing rows afford, through
  sp.sparse_prefill with a caller workspace whose device index has a block-id budget (--max-kept-blocks), timed with
  --long-repeats calls after one warm-up: sparse_prefill_ms, index_ms (sp.build_index alone), density,
  overflow_segments (segments past the budget, run dense), index_bytes (sparse_prefill_workspace_bytes with the
  budget) and index_bytes_causal_bound (without one), dense_ms (our dense kernel, one call without warm-up),
  speedup_vs_dense, topic_rel_err_vs_dense, and cudnn_ms / speedup_vs_cudnn (one cuDNN SDPA call without warm-up,
  unless --no-peers; a refusal records cudnn_error, and our dense kernel is then the reference). No FA2, sweep or
  accuracy.
--quick: lengths 8K, 32K, 128K; peers and accuracy on; no FlexAttention (torch.compile), no sweep.
Writes bench/results/sparse_h200.json (keys of the design brief) and, with matplotlib, bench/results/sparse_h200.png.
Usage: python3 bench/bench_sparse.py [--lengths 8192,131072] [--no-flex] [--no-sweep] [--no-accuracy] [--quick]
       [--long-lengths 1048576 [--max-kept-blocks N] [--long-repeats 2]]
       python3 bench/bench_sparse.py --plot-only bench/results/sparse_h200.json   (redraw its PNG, no GPU)"""
import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F

from _common import (BLOCK, D, HKV, HQ, RESULTS, SEL, apply_profile, attention_workspace, emit, index_workspace,
                     ints, floats, rel_err, require_cuda, sdpa_layout, time_few_ms, time_graph_ms, time_ms,
                     time_sdpa_peers, try_plot, workspace, write_results)
from _common import add_plot_only, plot_only
from _common import commit, topic  # noqa: F401  (re-exported: other scripts import them from here)

FULL = dict(lengths="4096,8192,16384,32768,65536,131072", sweep_lengths="65536,131072", flex=True, sweep=True)
QUICK = dict(lengths="8192,32768,131072", sweep_lengths="", flex=False, sweep=False)


def csr_on_device(index, dev="cuda"):
    """segment_start, segment_end, block_ids of an index as CUDA tensors (index.to_host() syncs once)."""
    h = index.to_host().host
    return tuple(torch.from_numpy(np.ascontiguousarray(h[n])).to(dev) for n in ("segment_start", "segment_end",
                                                                                  "block_ids"))


def flex_mask_from_csr(index, L, g, dev="cuda"):
    """A FlexAttention BlockMask with exactly our selection: query head h = kvh*g + j at position p is packed row
    p*g + j of tile (p*g + j) // 128; with g | 128 a tile is 128/g consecutive positions of all g heads, so the mask
    has query blocks of 128/g positions. The diagonal block is partial (causal mask_mod), the rest full."""
    from torch.nn.attention.flex_attention import BlockMask
    seg_start, seg_end, block_ids = csr_on_device(index, dev)
    T = (L * g + 127) // 128
    nb = (L + BLOCK - 1) // BLOCK
    S = HKV * T
    start = seg_start[:S].long()
    lens = (seg_end[:S].long() - start)
    seg = torch.repeat_interleave(torch.arange(S, device=dev), lens)
    pos = torch.repeat_interleave(start, lens) + (torch.arange(int(lens.sum()), device=dev) -
                                                  torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens))
    ids = block_ids[pos].long()
    mask = torch.zeros(S, nb, dtype=torch.bool, device=dev)
    mask[seg, ids] = True
    qb = 128 // g
    tile = torch.arange(T, device=dev)
    diag = (tile * qb) // BLOCK                                              # block holding the tile's positions
    partial = torch.zeros(T, nb, dtype=torch.bool, device=dev)
    partial[tile, diag] = True
    mask = mask.view(HKV, T, nb)
    full = mask & ~partial[None]
    part = mask & partial[None]

    def to_kv(m):
        num = m.sum(-1).to(torch.int32)
        idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        num = num.repeat_interleave(g, 0)[None]                              # [1, Hq, T]
        idx = idx.repeat_interleave(g, 0)[None]                              # [1, Hq, T, nb]
        return num, idx
    kv_num, kv_idx = to_kv(part)
    full_num, full_idx = to_kv(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(qb, BLOCK),
                                    mask_mod=lambda b, h, qi, ki: qi >= ki, seq_lengths=(L, L))


def index_from_csr(sp, base, segment_start, segment_end, block_ids, kept, visible):
    """A host sp.Index holding a caller CSR (correction off) for the problem `base` (an index built on the same
    arrays; pass base.to_host() when calling this repeatedly) was built for. The package has no public constructor
    of an index from caller arrays, so this goes through sp.Index's internal one (the dict the extension returns)
    with base's binding."""
    host = base.to_host()  # a host index returns itself
    h = host.host
    d = dict(binding=host.binding, block_size=host.block_size, group_size=host.group_size,
             num_kv_heads=host.num_kv_heads, num_subgroups=host.num_subgroups, correction=False,
             head_dim=host.head_dim, kept_blocks=int(kept), visible_blocks=int(visible), overflow_segments=0,
             segment_start=np.ascontiguousarray(segment_start, np.int32),
             segment_end=np.ascontiguousarray(segment_end, np.int32),
             block_ids=np.ascontiguousarray(block_ids, np.int32), cu_blocks=h["cu_blocks"], k_mean=h["k_mean"],
             v_mean=h["v_mean"])
    return sp.Index(d, host._lib, host._cu_seqlens_q, "tile")


def random_index(sp, base, L, density, g, seed=0, dev="cuda", per_query_block=False):
    """A CSR index of fixed density over the visible blocks of each PackGQA tile: the diagonal block always, the
    others with probability `density` (sorted ids, compact CSR). per_query_block: one draw per (KV head, 128 query
    positions), shared by the g tiles of those positions (the granularity of a 128x128 block mask such as
    FlexAttention's); otherwise an independent draw per 128/g-position tile (no K/V reuse between tiles in L2).
    Returns (host sp.Index, actual density)."""
    T = (L * g + 127) // 128
    nb = (L + BLOCK - 1) // BLOCK
    gen = torch.Generator(device=dev).manual_seed(seed)
    tile = torch.arange(T, device=dev)
    last_pos = torch.clamp((tile * 128 + 127) // g, max=L - 1)
    diag = ((tile * 128) // g) // BLOCK
    visible = torch.arange(nb, device=dev)[None, :] <= (last_pos // BLOCK)[:, None]           # [T, nb]
    if per_query_block:
        draws = torch.rand(HKV, (T + g - 1) // g, nb, device=dev, generator=gen).repeat_interleave(g, 1)[:, :T]
    else:
        draws = torch.rand(HKV, T, nb, device=dev, generator=gen)
    m = (draws < density) & visible[None]
    m[:, tile, diag] = True
    m = m.view(HKV * T, nb)
    counts = m.sum(1).to(torch.int32)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    kept = int(m.sum())
    vis = int(visible.sum()) * HKV
    idx = index_from_csr(sp, base, (ends - counts).cpu().numpy(), ends.cpu().numpy(),
                         torch.nonzero(m)[:, 1].to(torch.int32).cpu().numpy(), kept, vis)
    return idx, kept / vis


def long_row(sp, L, budget, repeats, peers=True, dev="cuda"):
    """One long prompt (topic workload) through sp.sparse_prefill with a budgeted device index (see the module
    docstring, "Long rows")."""
    q, k, v = topic(L)
    cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    sel = dict(SEL, max_kept_blocks=budget)
    row = dict(L=L, long=True, max_kept_blocks=budget)
    row["index_bytes"] = sp.sparse_prefill_workspace_bytes(q, k, v, cu, cu, L, L, **sel)
    row["index_bytes_causal_bound"] = sp.sparse_prefill_workspace_bytes(q, k, v, cu, cu, L, L, **SEL)
    ws = workspace(row["index_bytes"], dev)
    idx = sp.build_index(q, k, v, cu, cu, L, L, workspace=ws, **sel)
    row["density"], row["overflow_segments"] = idx.density, idx.overflow_segments
    row["index_ms"] = time_few_ms(lambda: sp.build_index(q, k, v, cu, cu, L, L, workspace=ws, **sel), repeats)
    row["sparse_prefill_ms"] = time_few_ms(lambda: sp.sparse_prefill(q, k, v, cu, cu, L, L, **sel, out=out,
                                                                     workspace=ws), repeats)
    sparse = out.clone()
    wsd = attention_workspace(D)
    row["dense_ms"] = time_few_ms(lambda: sp.attention(q, k, v, cu, cu, L, L, out=out, workspace=wsd), 1,
                                  warmup=False)
    row["speedup_vs_dense"] = row["dense_ms"] / row["sparse_prefill_ms"]
    row["topic_rel_err_vs_dense"] = rel_err(sparse, out)
    del sparse, out, wsd, ws
    if peers:  # one call without warm-up, as our dense: ~17 s at 1M; a refusal records cudnn_error
        qt, kt, vt = sdpa_layout(q, k, v, HQ // HKV)
        time_sdpa_peers(row, qt, kt, vt, is_causal=True, keys=("cudnn",),
                        timer=lambda fn: time_few_ms(fn, 1, warmup=False))
        if row.get("cudnn_ms"):
            row["speedup_vs_cudnn"] = row["cudnn_ms"] / row["sparse_prefill_ms"]
    return row


def accuracy(sp, L, dev="cuda"):
    """rel_err with / without correction and the needle ratio on the structured workload at length L."""
    q, k, v = sp.workload.structured(L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, seed=1)
    needles = sp.workload.needle_positions(L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, seed=1)
    bf = torch.bfloat16
    q, k, v = (torch.from_numpy(a).to(dev).to(bf) for a in (q, k, v))
    cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
    dense = sp.attention(q, k, v, cu, cu, L, L)
    idx = sp.build_index(q, k, v, cu, cu, L, L, **SEL, workspace=index_workspace(q, k, v, cu, cu, L, L, **SEL))
    nc = dict(SEL, correction=False)
    idx_nc = sp.build_index(q, k, v, cu, cu, L, L, **nc, workspace=index_workspace(q, k, v, cu, cu, L, L, **nc))
    corr = sp.sparse_attention(q, k, v, idx, cu, cu, L, L)
    plain = sp.sparse_attention(q, k, v, idx_nc, cu, cu, L, L)
    torch.cuda.synchronize()
    assert not torch.isnan(corr).any() and not torch.isnan(plain).any()
    res = dict(rel_err=rel_err(corr, dense), rel_err_no_correction=rel_err(plain, dense),
               accuracy_density=idx.density)
    g = HQ // HKV
    ratios = []
    for n in needles:
        val = torch.from_numpy(np.asarray(n["value"], np.float32)).to(dev)
        heads = slice(n["kv_head"] * g, n["kv_head"] * g + g)
        rows = slice(n["query_begin"], n["query_end"])

        def cos(o):
            x = o[rows, heads].float().reshape(-1, D)
            return F.cosine_similarity(x, val[None], dim=1).mean().item()
        ratios.append(cos(corr) / max(cos(dense), 1e-6))
    res["needles"] = len(needles)
    res["needle_ratio_min"] = min(ratios) if ratios else None
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(RESULTS, "sparse_h200.json"))
    add_plot_only(ap)
    ap.add_argument("--lengths", default=None, help=f"default {FULL['lengths']}; --quick {QUICK['lengths']}")
    ap.add_argument("--quick", action="store_true", help="short run (see above): one to two minutes on the H200")
    ap.add_argument("--sweep-lengths", default=None, help=f"lengths of the random-mask sweep (default "
                                                          f"{FULL['sweep_lengths']}; only those also in --lengths)")
    ap.add_argument("--densities", default="0.01,0.02,0.05,0.1,0.2,0.3,0.5")
    ap.add_argument("--flex", dest="flex", action="store_true", default=None,
                    help="FlexAttention on the same mask (default on; off with --quick)")
    ap.add_argument("--no-flex", dest="flex", action="store_false")
    ap.add_argument("--sweep", dest="sweep", action="store_true", default=None,
                    help="random-mask sweep (default on; off with --quick)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    ap.add_argument("--no-peers", dest="peers", action="store_false", help="skip cuDNN / FA2")
    ap.add_argument("--rule", default=SEL.get("rule", "tile_energy"),
                    choices=["tile_energy", "row_max", "probe_row_max", "probe_row_mass", "key_max"],
                    help="selection rule (docs/semantics.md); the rows record it")
    ap.add_argument("--alpha", type=float, default=SEL["alpha"])
    ap.add_argument("--mean-alpha", type=float, default=None,
                    help="the probe rules' pooled-means term (default: the library's)")
    ap.add_argument("--key-rank", type=int, default=None, choices=[16, 32],
                    help="key_max's residual rank (default: the library's)")
    ap.add_argument("--head-subgroups", type=int, default=1, help="selections per GQA group (1: PackGQA, 4: per head)")
    ap.add_argument("--long-lengths", default="", help="long rows (e.g. 1048576), see above")
    ap.add_argument("--max-kept-blocks", type=int, default=1 << 26,
                    help="block-id budget of the long rows' device index (default 2^26: 256 MiB of ids)")
    ap.add_argument("--long-repeats", type=int, default=2, help="timed calls per long-row measurement")
    args = apply_profile(ap.parse_args(argv), QUICK, FULL)
    ints(args.lengths), ints(args.sweep_lengths), floats(args.densities), ints(args.long_lengths)  # fail early
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.plot_only:
        return plot_only(plot, args.plot_only)
    SEL.update(rule=args.rule, alpha=args.alpha, head_subgroups=args.head_subgroups)   # every build below uses it
    if args.mean_alpha is not None:
        SEL.update(mean_alpha=args.mean_alpha)
    if args.key_rank is not None:
        SEL.update(key_rank=args.key_rank)
    sp = require_cuda()
    dev, g = "cuda", HQ // HKV
    flex = None
    if args.flex:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention)
    wsd = attention_workspace(D)
    rows, sweep = [], []
    meta = dict(workload="topic (docs/workload.md), Hq=32 Hkv=8 D=128 bf16 batch 1 causal; accuracy: structured, seed 1",
                selection=SEL, sweep=sweep)
    sweep_lengths = ints(args.sweep_lengths)
    for L in ints(args.lengths):
        q, k, v = topic(L)
        cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        row = dict(L=L)
        row["dense_ms"] = time_ms(lambda: sp.attention(q, k, v, cu, cu, L, L, out=out, workspace=wsd))
        dense = out.clone()
        ws = index_workspace(q, k, v, cu, cu, L, L, **SEL)
        nc = dict(SEL, correction=False)
        ws_nc = index_workspace(q, k, v, cu, cu, L, L, **nc)
        ws_nc_timed = index_workspace(q, k, v, cu, cu, L, L, **nc)  # rebuilt while idx_nc stays in ws_nc
        ws_pf = workspace(sp.sparse_prefill_workspace_bytes(q, k, v, cu, cu, L, L, **SEL), dev)
        ws_pf_nc = workspace(sp.sparse_prefill_workspace_bytes(q, k, v, cu, cu, L, L, **nc), dev)

        def build():
            return sp.build_index(q, k, v, cu, cu, L, L, workspace=ws, **SEL)
        idx = build()
        idx_nc = sp.build_index(q, k, v, cu, cu, L, L, workspace=ws_nc, **nc)
        row["density"] = idx.density
        row["index_ms"] = time_ms(build)
        row["index_no_corr_ms"] = time_ms(lambda: sp.build_index(q, k, v, cu, cu, L, L, workspace=ws_nc_timed, **nc))
        row["attn_ms"] = time_ms(lambda: sp.sparse_attention(q, k, v, idx, cu, cu, L, L, out=out))
        row["attn_no_corr_ms"] = time_ms(lambda: sp.sparse_attention(q, k, v, idx_nc, cu, cu, L, L, out=out))
        row["total_ms"] = row["index_ms"] + row["attn_ms"]
        row["total_no_corr_ms"] = row["index_no_corr_ms"] + row["attn_no_corr_ms"]
        row["index_graph_ms"] = time_graph_ms(build)

        def fused():
            sp.sparse_attention(q, k, v, build(), cu, cu, L, L, out=out)
        row["fused_ms"] = time_ms(fused)
        row["topic_rel_err_vs_dense"] = rel_err(out, dense)
        row["sparse_prefill_ms"] = time_ms(lambda: sp.sparse_prefill(q, k, v, cu, cu, L, L, **SEL, out=out,
                                                                     workspace=ws_pf))
        row["sparse_prefill_no_corr_ms"] = time_ms(lambda: sp.sparse_prefill(q, k, v, cu, cu, L, L, **nc, out=out,
                                                                             workspace=ws_pf_nc))
        row["correction_overhead"] = row["attn_ms"] / row["attn_no_corr_ms"] - 1
        row["attn_vs_ideal"] = row["attn_no_corr_ms"] / (row["density"] * row["dense_ms"])
        row["index_share_of_dense"] = row["index_ms"] / row["dense_ms"]
        if row["index_graph_ms"] is not None:
            row["index_graph_share_of_dense"] = row["index_graph_ms"] / row["dense_ms"]
        qt, kt, vt = sdpa_layout(q, k, v, g)
        if args.peers:
            time_sdpa_peers(row, qt, kt, vt, is_causal=True)
            if row.get("cudnn_ms"):
                row["speedup_vs_cudnn"] = row["cudnn_ms"] / row["total_ms"]
                row["speedup_no_corr_vs_cudnn"] = row["cudnn_ms"] / row["total_no_corr_ms"]
                row["speedup_prefill_no_corr_vs_cudnn"] = row["cudnn_ms"] / row["sparse_prefill_no_corr_ms"]
        row["flex_same_mask_ms"] = None
        if flex is not None:
            try:
                bm = flex_mask_from_csr(idx_nc, L, g)
                opts = {"BLOCK_M": 128 // g, "BLOCK_N": BLOCK}
                fo = flex(qt, kt, vt, block_mask=bm, kernel_options=opts)
                ours_nc = sp.sparse_attention(q, k, v, idx_nc, cu, cu, L, L)
                row["flex_vs_ours_no_corr_max_diff"] = (fo[0].transpose(0, 1).float() -
                                                        ours_nc.float()).abs().max().item()
                row["flex_same_mask_ms"] = time_ms(lambda: flex(qt, kt, vt, block_mask=bm, kernel_options=opts))
                del bm, fo, ours_nc
            except Exception as e:  # noqa: BLE001
                row["flex_error"] = repr(e)[:300]
        del qt, kt, vt, dense, ws_pf
        if args.sweep and L in sweep_lengths:
            wsv, base = None, idx_nc.to_host()
            for mask in ("query_block", "tile"):
                for dens in floats(args.densities):
                    ridx, actual = random_index(sp, base, L, dens, g, per_query_block=mask == "query_block")
                    if wsv is None:  # its size does not depend on the CSR (correction off)
                        wsv = workspace(sp.sparse_attention_workspace_bytes(q, k, v, ridx, cu, cu, L, L), dev)
                    ms = time_ms(lambda: sp.sparse_attention(q, k, v, ridx, cu, cu, L, L, out=out, workspace=wsv))
                    srow = dict(L=L, mask=mask, target_density=dens, density=actual, attn_ms=ms,
                                dense_ms=row["dense_ms"], ideal_ms=actual * row["dense_ms"],
                                ratio_to_ideal=ms / (actual * row["dense_ms"]))
                    emit(srow)
                    sweep.append(srow)
                    del ridx
            del wsv, base
        if args.accuracy:
            del q, k, v, out, ws, ws_nc, idx, idx_nc
            torch.cuda.empty_cache()
            try:
                row.update(accuracy(sp, L))
            except Exception as e:  # noqa: BLE001
                row["rel_err"], row["rel_err_no_correction"], row["accuracy_error"] = None, None, repr(e)[:300]
        emit(row)
        rows.append(row)
        write_results(args.out, rows, **meta)
        torch.cuda.empty_cache()
    for L in ints(args.long_lengths):
        row = long_row(sp, L, args.max_kept_blocks, args.long_repeats, peers=args.peers)
        emit(row)
        rows.append(row)
        write_results(args.out, rows, **meta)
        torch.cuda.empty_cache()
    res = write_results(args.out, rows, **meta)
    try_plot(plot, res, os.path.splitext(args.out)[0] + ".png")


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = res["rows"]
    Ls = [r["L"] for r in rows]
    for key, label in (("total_ms", "ours sparse (index + attn)"), ("dense_ms", "ours dense"),
                       ("cudnn_ms", "cuDNN SDPA"), ("fa2_ms", "FA2 SDPA"), ("flex_same_mask_ms", "Flex, same mask")):
        ys = [r.get(key) for r in rows]
        if any(y for y in ys):
            a.plot([L for L, y in zip(Ls, ys) if y], [y for y in ys if y], marker="o", label=label)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("L")
    a.set_ylabel("ms")
    a.set_title("topic workload, Hq32 Hkv8 D128 bf16")
    a.legend()
    for L in sorted({s["L"] for s in res["sweep"]}):
        for mask in ("query_block", "tile"):
            s = [x for x in res["sweep"] if x["L"] == L and x.get("mask") == mask]
            if s:
                b.plot([x["density"] for x in s], [x["ratio_to_ideal"] for x in s], marker="o",
                       label=f"L={L}, random per {mask.replace('_', ' ')}")
    b.axhline(1.2, color="gray", ls="--", label="target 1.2 (issue 16)")
    b.set_xscale("log")
    b.set_xlabel("density")
    b.set_ylabel("sparse attn / (density x dense)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

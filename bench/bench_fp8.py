"""FP8 (e4m3) dense causal prefill against bf16, through the installed package, in one process (issue 17).
Llama-3.1-8B head shape: Hq=32, Hkv=8, D=128, batch 1, causal. Per length L: our bf16 sp.attention, our FP8
sp.attention (q, k, v from sp.quantize_fp8 per KV head, descales passed), cuDNN bf16 (SDPA) as the peer, and the FP8
output's error against a float32 SDPA on the dequantised values next to the bf16 output's error against float32 on
the bf16 values (up to --error-max-len), and at every length against our bf16 kernel on the dequantised values.
Rows alternate bf16 / fp8 over ROUNDS rounds (median of the round medians), so drift cancels.
Sparse rows (--sparse-lengths, kind "sparse"): the topic workload (docs/workload.md) in bf16 and quantised per KV head,
the default selection; block-sparse attention over one index (built by build_index on the bf16 arrays, with and
without the correction; with --fp8-index also on the FP8 arrays) for bf16 and FP8 (reuse_index=True), the one-call
sparse_prefill totals (--fp8-index), and each output's error against our dense bf16 output (--structured: also on
the structured workload, the issue's accuracy target, with the dense FP8 output's error against dense bf16, the
quantisation floor, and the sparse FP8 output's against dense FP8, the selection error under FP8).
Chunked rows (--chunked, kind "chunked"): per (chunk, batch) of --chunked-steps, the last chunk positions of an
L-token topic prompt as one sp.chunked_prefill step over bench_chunked's paged cache (page 64, shuffled pages, the
pooled-means cache as the earlier steps leave it, caller workspace), as the last chunk and mid-prompt; bf16 cache vs
the same cache in e4m3 (per KV head, q per step), descales passed; the dense paged step (sp.attention) in both; each
output's error against the dense bf16 step. A configuration the library refuses is recorded ("fp8": "unsupported:
...") and the row goes on without it.
Targets (issue 17): fp8 >= 1.35x bf16 at 16K-128K; sparse FP8 (correction on) >= 1.25x bf16 sparse at 128K.
One results file per invocation (--out; the options pick the experiment: the committed ones are fp8_h200.json,
fp8_sparse_h200.json, fp8_sparse_structured_h200.json, fp8_chunked_h200.json) and, with matplotlib, its plot beside
it (.png), one panel per kind of row it holds.
Usage: python3 bench/bench_fp8.py --out bench/results/fp8_h200.json [--lengths 16384,32768] [--paged 128]
       [--sparse-lengths 32768,131072] [--fp8-index] [--structured] [--chunked 131072 [--chunked-steps 1024x1]]
       (--lengths '' skips the dense rows, e.g. to run the chunked rows alone)
       python3 bench/bench_fp8.py --plot-only bench/results/fp8_h200.json   (redraw its PNG, no GPU)"""
import argparse
import os

import torch

from _common import (D, HKV, HQ, SEL, add_plot_only, attention_workspace, emit, index_workspace, ints, median,
                     plot_only, rel_err, require_cuda, sdpa_layout, time_graph_ms, time_ms, time_sdpa_peers, topic,
                     try_plot, workspace, write_results)
from bench_chunked import PAGE, Cache

ROUNDS = 3
CHUNKED_STEPS = "1024x1,1024x8,8192x1"  # (chunk x batch) at 128K, issue 17's list
# What a refused configuration raises: NotImplementedError (unsupported head dim, page size, ...), TypeError /
# ValueError naming an argument (e.g. an FP8 operand where the path takes 16-bit ones).
REFUSALS = (NotImplementedError, TypeError, ValueError)


def dequantize(x8, descale):
    """float32 values of sp.quantize_fp8's x8 [..., H, D] with its descale [B, Hkv] (the same row for every sequence;
    a group of query heads shares its KV head's scale)."""
    s = descale[0].float()
    return x8.float() * s.repeat_interleave(x8.shape[-2] // s.shape[0])[:, None]


def supported(row, key, make):
    """fn = make(), called once, or None when the library refuses it (REFUSALS), recorded as row[key] =
    'unsupported: ...' so that the run goes on without it."""
    try:
        fn = make()
        fn()
    except REFUSALS as e:
        row[key] = f"unsupported: {type(e).__name__}: {e}"
        return None
    return fn


def chunked_steps(s):
    """'1024x1,8192x1' -> [(1024, 1), (8192, 1)]."""
    steps = []
    for part in (p.strip() for p in s.split(",") if p.strip()):
        c, sep, b = part.partition("x")
        if not sep or not c.isdigit() or not b.isdigit() or int(c) < 1 or int(b) < 1:
            raise ValueError(f"--chunked-steps: expected CHUNKxBATCH items like 1024x8, got {part!r}")
        steps.append((int(c), int(b)))
    return steps


def reference(qt, kt, vt, chunk=4096):
    """float32 causal SDPA (math) in query chunks (bottom-right == top-left here: Lq == Lk), [L, H, D]."""
    L = qt.shape[2]
    outs = []
    for a in range(0, L, chunk):
        e = min(L, a + chunk)
        s = torch.einsum("bhqd,bhkd->bhqk", qt[:, :, a:e], kt[:, :, :e]) / qt.shape[-1] ** 0.5
        mask = torch.arange(e, device=qt.device)[None, :] > torch.arange(a, e, device=qt.device)[:, None]
        s.masked_fill_(mask, float("-inf"))
        outs.append(torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), vt[:, :, :e]))
        del s
    return torch.cat(outs, 2)[0].transpose(0, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="the results file to write (required unless --plot-only)")
    ap.add_argument("--lengths", default="16384,32768,65536,131072")
    ap.add_argument("--paged", type=int, default=0, help="also time FP8 with the KV in shuffled pages of this size")
    ap.add_argument("--error-max-len", type=int, default=32768, help="float32 reference only up to this length")
    ap.add_argument("--sparse-lengths", default="", help="block-sparse rows on the topic workload at these lengths")
    ap.add_argument("--fp8-index", action="store_true",
                    help="also build the index on the FP8 arrays (the CUDA index stage)")
    ap.add_argument("--structured", action="store_true",
                    help="sparse rows: also the errors on the structured workload (needs --fp8-index)")
    ap.add_argument("--chunked", default="", help="chunked rows at these prompt lengths (e.g. 131072)")
    ap.add_argument("--chunked-steps", default=CHUNKED_STEPS, help="CHUNKxBATCH steps of the chunked rows")
    add_plot_only(ap)
    args = ap.parse_args(argv)
    if args.plot_only:
        return plot_only(plot, args.plot_only)
    if not args.out:
        ap.error("--out is required (or --plot-only RESULTS_JSON)")
    if args.structured and not args.fp8_index:
        ap.error("--structured needs --fp8-index (its FP8 sparse output is sparse_prefill's, with the FP8 index)")
    try:
        steps = chunked_steps(args.chunked_steps)
        try:
            chunked = ints(args.chunked)
        except ValueError:
            raise ValueError(f"--chunked: expected lengths like 131072,65536, got {args.chunked!r}") from None
        for L in chunked:
            if L % PAGE or L % SEL["block_size"] or any(c > L for c, _ in steps):
                raise ValueError(f"--chunked: {L} must be a multiple of the page ({PAGE}) and block "
                                 f"({SEL['block_size']}) and hold every chunk of --chunked-steps")
    except ValueError as e:
        ap.error(str(e))
    sp = require_cuda()
    dev, hq, hkv, d = "cuda", HQ, HKV, D
    g = hq // hkv
    ws = attention_workspace(d)
    rows = []
    meta = dict(shape=dict(hq=hq, hkv=hkv, d=d, batch=1, causal=True), rounds=ROUNDS,
                call="sp.attention(out=, workspace=, q/k/v_descale=)")
    for L in ints(args.lengths):
        torch.manual_seed(0)
        q = torch.randn(L, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(L, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(L, hkv, d, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
        q8, qd = sp.quantize_fp8(q, num_kv_heads=hkv)
        k8, kd = sp.quantize_fp8(k)
        v8, vd = sp.quantize_fp8(v)
        out_bf = torch.empty_like(q)
        out_8 = torch.empty_like(q)

        def bf16():
            return sp.attention(q, k, v, cu, cu, L, L, causal=True, out=out_bf, workspace=ws)

        def fp8():
            return sp.attention(q8, k8, v8, cu, cu, L, L, causal=True, out=out_8, workspace=ws,
                                q_descale=qd, k_descale=kd, v_descale=vd)

        t_bf, t_8 = [], []
        for _ in range(ROUNDS):
            t_bf.append(time_ms(bf16, total_ms_budget=600))
            t_8.append(time_ms(fp8, total_ms_budget=600))
        flops = 4 * L * L * d * hq / 2
        row = dict(L=L, bf16_ms=median(t_bf), fp8_ms=median(t_8), bf16_rounds=t_bf, fp8_rounds=t_8)
        row["fp8_over_bf16_speedup"] = row["bf16_ms"] / row["fp8_ms"]
        row["fp8_tflops"] = flops / (row["fp8_ms"] * 1e-3) / 1e12
        row["bf16_tflops"] = flops / (row["bf16_ms"] * 1e-3) / 1e12
        if args.paged:
            P = args.paged
            n_pages = (L + P - 1) // P
            perm = torch.randperm(n_pages, device=dev)
            bt = perm.to(torch.int32)[None, :]          # logical page i lives in physical page perm[i]

            def paged(x8):
                pad = torch.nn.functional.pad(x8.view(torch.uint8), (0, 0, 0, 0, 0, n_pages * P - L))
                cache = torch.empty(n_pages, P, hkv, d, device=dev, dtype=torch.uint8)
                cache[perm] = pad.view(n_pages, P, hkv, d)
                return cache.view(torch.float8_e4m3fn)
            kc, vc = paged(k8), paged(v8)
            out_p = torch.empty_like(q)
            sk = torch.tensor([L], dtype=torch.int32, device=dev)

            def fp8_paged():
                return sp.attention(q8, kc, vc, cu, None, L, L, causal=True, out=out_p, workspace=ws,
                                    block_table=bt, seqused_k=sk, q_descale=qd, k_descale=kd, v_descale=vd)
            row["fp8_paged_ms"] = time_ms(fp8_paged)
            row["page_size"] = P
            fp8_paged()
            row["paged_equals_contiguous"] = bool(torch.equal(out_p, out_8))
        # Accuracy at every length: against our bf16 kernel on the dequantised values (its own error, ~2e-3 rel L2
        # against float32, is an order below FP8's); this is the column the two-level accumulation A/B reads.
        fp8()
        deq = [dequantize(x, s) for x, s in ((q8, qd), (k8, kd), (v8, vd))]
        ref_deq = sp.attention(*(x.to(torch.bfloat16) for x in deq), cu, cu, L, L, causal=True)
        row["fp8_rel_l2_vs_bf16_kernel_dequantised"] = rel_err(out_8, ref_deq)
        row["fp8_max_abs_vs_bf16_kernel_dequantised"] = (out_8.float() - ref_deq.float()).abs().max().item()
        del ref_deq
        qt, kt, vt = sdpa_layout(q, k, v, g)
        time_sdpa_peers(row, qt, kt, vt, is_causal=True, keys=("cudnn",))
        if row.get("cudnn_ms"):
            row["fp8_over_cudnn_speedup"] = row["cudnn_ms"] / row["fp8_ms"]
        if L <= args.error_max_len:
            bf16()
            ref_f32 = reference(qt.float(), kt.float(), vt.float())
            row["bf16_rel_l2_vs_fp32"] = rel_err(out_bf, ref_f32)
            row["fp8_rel_l2_vs_fp32_bf16_inputs"] = rel_err(out_8, ref_f32)
            del ref_f32
            ref_8 = reference(*sdpa_layout(*deq, g))
            row["fp8_rel_l2_vs_fp32_dequantised"] = rel_err(out_8, ref_8)
            row["fp8_nan"] = bool(torch.isnan(out_8).any())
            del ref_8
        del deq
        emit(row)
        rows.append(row)
        write_results(args.out, rows, **meta)
        del q, k, v, q8, k8, v8, out_bf, out_8, qt, kt, vt
        torch.cuda.empty_cache()
    for L in ints(args.sparse_lengths):
        rows.append(sparse_row(sp, L, hkv, ws, args.fp8_index, args.structured))
        emit(rows[-1])
        write_results(args.out, rows, **meta)
        torch.cuda.empty_cache()
    for L in chunked:
        for row in chunked_rows(sp, L, steps):
            emit(row)
            rows.append(row)
            write_results(args.out, rows, **meta)
        torch.cuda.empty_cache()
    res = write_results(args.out, rows, **meta)
    try_plot(plot, res, os.path.splitext(args.out)[0] + ".png")


def sparse_row(sp, L, hkv, ws, fp8_index, structured):
    """One "sparse" row: bf16 and FP8 block-sparse attention on the topic workload at length L (see the docstring)."""
    q, k, v = topic(L)
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    (q8, qd), (k8, kd), (v8, vd) = sp.quantize_fp8(q, num_kv_heads=hkv), sp.quantize_fp8(k), sp.quantize_fp8(v)
    fp8 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    out = torch.empty_like(q)
    sp.attention(q, k, v, cu, cu, L, L, out=out, workspace=ws)
    dense = out.clone()
    row = dict(kind="sparse", L=L, selection=dict(SEL))
    nc = dict(SEL, correction=False)
    idx_nc = sp.build_index(q, k, v, cu, cu, L, L, workspace=index_workspace(q, k, v, cu, cu, L, L, **nc), **nc)
    row["density"] = idx_nc.density
    t_bf, t_8 = [], []
    for _ in range(ROUNDS):
        t_bf.append(time_ms(lambda: sp.sparse_attention(q, k, v, idx_nc, cu, cu, L, L, out=out)))
        t_8.append(time_ms(lambda: sp.sparse_attention(q8, k8, v8, idx_nc, cu, cu, L, L, out=out, reuse_index=True,
                                                       **fp8)))
    row.update(bf16_attn_no_corr_ms=median(t_bf), fp8_attn_no_corr_ms=median(t_8))
    row["fp8_rel_err_vs_dense_bf16_no_corr"] = rel_err(out, dense)
    sp.sparse_attention(q, k, v, idx_nc, cu, cu, L, L, out=out)
    row["bf16_rel_err_vs_dense_bf16_no_corr"] = rel_err(out, dense)
    del idx_nc
    idx = sp.build_index(q, k, v, cu, cu, L, L, workspace=index_workspace(q, k, v, cu, cu, L, L, **SEL), **SEL)
    row["bf16_attn_ms"] = time_ms(lambda: sp.sparse_attention(q, k, v, idx, cu, cu, L, L, out=out))
    row["bf16_total_ms"] = time_ms(lambda: sp.sparse_prefill(q, k, v, cu, cu, L, L, out=out, **SEL))
    row["bf16_rel_err_vs_dense_bf16"] = rel_err(out, dense)
    if fp8_index:  # the CUDA index stage on FP8 inputs: its own index (e4m3 correction means), then the one call
        idx8 = sp.build_index(q8, k8, v8, cu, cu, L, L, workspace=index_workspace(q8, k8, v8, cu, cu, L, L, **SEL),
                              **SEL, **fp8)
        row["fp8_density"] = idx8.density
        row["fp8_attn_ms"] = time_ms(lambda: sp.sparse_attention(q8, k8, v8, idx8, cu, cu, L, L, out=out, **fp8))
        row["fp8_total_ms"] = time_ms(lambda: sp.sparse_prefill(q8, k8, v8, cu, cu, L, L, out=out, **SEL, **fp8))
        row["fp8_rel_err_vs_dense_bf16"] = rel_err(out, dense)
        row["fp8_over_bf16_sparse_speedup"] = row["bf16_total_ms"] / row["fp8_total_ms"]
        if structured:
            row.update(structured_errors(sp, L, hkv))
    return row


def structured_errors(sp, L, hkv, dev="cuda"):
    """The issue's accuracy target: on the structured workload (RoPE content, sinks, recall, needles; seed 1), the
    sparse FP8 output's error against our dense bf16 output next to the sparse bf16 output's (default selection).
    Split of the FP8 error: dense FP8 on the same e4m3 q, k, v against dense bf16 (the quantisation floor, which no
    selection can go below), and of that the part of the inputs' rounding alone (our bf16 kernel on the dequantised
    values: no P in e4m3); per-tensor scales instead of per-KV-head ones (quantize_fp8's other choice); the sparse
    FP8 output against dense FP8 (the selection's error under FP8, to set beside sparse bf16 against dense bf16)."""
    q, k, v = (torch.from_numpy(x).to(dev).to(torch.bfloat16)
               for x in sp.workload.structured(L, num_q_heads=HQ, num_kv_heads=hkv, head_dim=D, seed=1))
    cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
    dense = sp.attention(q, k, v, cu, cu, L, L)
    bf = sp.sparse_prefill(q, k, v, cu, cu, L, L, **SEL)
    (q8, qd), (k8, kd), (v8, vd) = sp.quantize_fp8(q, num_kv_heads=hkv), sp.quantize_fp8(k), sp.quantize_fp8(v)
    fp8 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    f8 = sp.sparse_prefill(q8, k8, v8, cu, cu, L, L, **fp8, **SEL)
    d8 = sp.attention(q8, k8, v8, cu, cu, L, L, **fp8)
    deq = sp.attention(*(dequantize(x, s_).to(torch.bfloat16) for x, s_ in ((q8, qd), (k8, kd), (v8, vd))),
                       cu, cu, L, L)
    (q8t, qdt), (k8t, kdt), (v8t, vdt) = (sp.quantize_fp8(x, num_kv_heads=hkv, per_head=False) for x in (q, k, v))
    d8t = sp.attention(q8t, k8t, v8t, cu, cu, L, L, q_descale=qdt, k_descale=kdt, v_descale=vdt)
    e_bf, e_8, e_sel8 = rel_err(bf, dense), rel_err(f8, dense), rel_err(f8, d8)
    return dict(structured_bf16_rel_err_vs_dense_bf16=e_bf, structured_fp8_rel_err_vs_dense_bf16=e_8,
                structured_fp8_over_bf16_error=e_8 / e_bf if e_bf > 0 else None,
                structured_fp8_dense_rel_err_vs_dense_bf16=rel_err(d8, dense),
                structured_dequantised_bf16_dense_rel_err_vs_dense_bf16=rel_err(deq, dense),
                structured_fp8_dense_rel_err_vs_dequantised_bf16_dense=rel_err(d8, deq),
                structured_fp8_dense_per_tensor_rel_err_vs_dense_bf16=rel_err(d8t, dense),
                structured_fp8_rel_err_vs_dense_fp8=e_sel8,
                structured_fp8_over_bf16_selection_error=e_sel8 / e_bf if e_bf > 0 else None)


def chunked_rows(sp, L, steps, dev="cuda"):
    """The "chunked" rows at prompt length L (see the docstring), one per (chunk, batch) of `steps` and position
    (last chunk, mid-prompt); a generator, so that the caller writes the results after every row. One cache per
    batch size (bench_chunked.Cache: `batch` topic prompts), quantised once per KV head as an FP8 engine cache is."""
    for batch in sorted({b for _, b in steps}):
        cache = Cache(L, batch, dev=dev, make=lambda n, seed: topic(n, seed=seed, dev=dev))
        (k8, kd), (v8, vd) = sp.quantize_fp8(cache.k, batch=batch), sp.quantize_fp8(cache.v, batch=batch)
        for C in [c for c, b in steps if b == batch]:
            means = cache.mean_cache(L - C)
            means8 = cache.mean_cache(L - C, k=dequantize(k8, kd), v=dequantize(v8, vd))  # real-unit means
            for final in (True, False):
                yield chunked_row(sp, cache, (k8, kd, v8, vd), C, final, means, means8)
            del means, means8
        del cache, k8, v8
        if dev == "cuda":
            torch.cuda.empty_cache()


def chunked_row(sp, cache, kv8, C, final, means, means8):
    """One step: the last C positions of the cache's prompts as sp.chunked_prefill (bf16, FP8) and sp.attention
    (dense paged step, bf16, FP8), alternating over ROUNDS rounds (medians); CUDA-graph times of the two sparse
    steps (host launch gaps left out, as bench_chunked's tile_step_graph_ms); densities; errors."""
    k8, kd, v8, vd = kv8
    L, batch, dev = cache.L, cache.batch, cache.k.device
    q, cu_q, used, C, Lk = cache.step(L - C, L)
    q8, qd = sp.quantize_fp8(q, batch=batch, num_kv_heads=HKV)  # an engine quantises each step's q
    fp8 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    bt = cache.block_table
    paged = dict(block_table=bt, seqused_k=used)
    row = dict(kind="chunked", L=L, chunk=C, batch=batch, final_chunk=final,
               mode="last chunk" if final else "mid-prompt", page_size=PAGE, selection=dict(SEL))
    wsd = attention_workspace(D, dev)
    out = {name: torch.empty_like(q) for name in ("bf16", "fp8", "bf16_dense", "fp8_dense")}

    def step(name, qq, kc, vc, m, **d):
        ws = workspace(sp.chunked_prefill_workspace_bytes(qq, kc, vc, cu_q, bt, used, C, Lk, final_chunk=final,
                                                          **SEL), dev)
        return lambda: sp.chunked_prefill(qq, kc, vc, cu_q, bt, used, C, Lk, final_chunk=final, mean_cache=m,
                                          out=out[name], workspace=ws, **SEL, **d)

    def dense(name, qq, kc, vc, **d):
        return lambda: sp.attention(qq, kc, vc, cu_q, None, C, Lk, out=out[name], workspace=wsd, **paged, **d)

    fns = dict(bf16=step("bf16", q, cache.k, cache.v, means), bf16_dense=dense("bf16_dense", q, cache.k, cache.v))
    row["bf16_dense_path"] = sp.attention_path(q, cache.k, cache.v, cu_q, None, C, Lk, **paged)
    for name, make in (("fp8", lambda: step("fp8", q8, k8, v8, means8, **fp8)),  # its workspace size may refuse
                       ("fp8_dense", lambda: dense("fp8_dense", q8, k8, v8, **fp8))):
        fn = supported(row, name, make)
        if fn is not None:
            fns[name] = fn
    if "fp8_dense" in fns:
        row["fp8_dense_path"] = sp.attention_path(q8, k8, v8, cu_q, None, C, Lk, **paged)
    times = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            times[name].append(time_ms(fn, total_ms_budget=600))
    for name, ts in times.items():
        row[f"{name}_ms"], row[f"{name}_rounds"] = median(ts), ts
    for name in ("bf16", "fp8"):
        if name in fns:
            row[f"{name}_graph_ms"] = time_graph_ms(fns[name])
            if f"{name}_dense" in fns:  # the sparse step's speedup over the dense step of its dtype
                row[f"{name}_dense_over_step"] = row[f"{name}_dense_ms"] / row[f"{name}_ms"]
    for a in ("", "_dense", "_graph"):
        if row.get(f"fp8{a}_ms") and row.get(f"bf16{a}_ms"):
            row[f"fp8_over_bf16{a}_speedup"] = row[f"bf16{a}_ms"] / row[f"fp8{a}_ms"]
    # Densities re-pool the whole cache (no mean cache: the CPU reference takes none; the same selection up to
    # float32 rounding of the means, bench_chunked's *_density_cached)
    sel = dict(SEL, final_chunk=final)
    row["bf16_density"] = sp.build_index(q, cache.k, cache.v, cu_q, None, C, Lk, **paged, **sel).density
    if "fp8" in fns:
        row["fp8_density"] = sp.build_index(q8, k8, v8, cu_q, None, C, Lk, **paged, **sel, **fp8).density
    for fn in fns.values():  # the outputs of one call each (graph replays wrote the same)
        fn()
    ref = out["bf16_dense"]
    for name in ("bf16", "fp8", "fp8_dense"):
        if name in fns:
            row[f"{name}_rel_err_vs_dense_bf16"] = rel_err(out[name], ref)
            row[f"{name}_nan"] = bool(torch.isnan(out[name]).any())
    if "fp8" in fns and "fp8_dense" in fns:
        row["fp8_rel_err_vs_dense_fp8"] = rel_err(out["fp8"], out["fp8_dense"])  # the selection error under FP8
    if "fp8" in fns:
        e_bf = row["bf16_rel_err_vs_dense_bf16"]
        row["fp8_over_bf16_error"] = row["fp8_rel_err_vs_dense_bf16"] / e_bf if e_bf > 0 else None
    return row



def plot(res, path):
    """One panel per kind of row in the file: dense rows (no kind): FP8's speed-up over our bf16 (and paged FP8's,
    FP8's over cuDNN) by length against issue 17's 1.35x, FP8 TFLOP/s beside the points, and the errors; "sparse"
    rows: bf16 / FP8 block-sparse times (attention without correction, one-call totals) with FP8 / bf16 total against
    the 1.25x target, and with --structured the structured workload's errors against the 1.5x error target;
    "chunked" rows: FP8 / bf16 per step by events, as CUDA graphs and for the dense paged step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["rows"]
    dense = [r for r in rows if "kind" not in r]
    sparse = [r for r in rows if r.get("kind") == "sparse"]
    structured = [r for r in sparse if r.get("structured_fp8_rel_err_vs_dense_bf16") is not None]
    chunked = [r for r in rows if r.get("kind") == "chunked"]
    panels = [name for name, rs in (("dense_speed", dense), ("dense_error", dense), ("sparse", sparse),
                                    ("structured", structured), ("chunked", chunked)) if rs]
    if not panels:
        raise ValueError("no dense, sparse or chunked rows to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    ax = dict(zip(panels, axes[0]))
    tag = f"{res.get('device', 'GPU')}, {str(res.get('commit', ''))[:7]}"
    k_label = lambda L: f"{L // 1024}K"  # noqa: E731

    if dense:
        a = ax["dense_speed"]
        Ls = [r["L"] for r in dense]
        a.plot(Ls, [r["fp8_over_bf16_speedup"] for r in dense], marker="o", label="FP8 / our bf16")
        if any(r.get("fp8_paged_ms") for r in dense):
            pts = [(r["L"], r["bf16_ms"] / r["fp8_paged_ms"]) for r in dense if r.get("fp8_paged_ms")]
            page = next(r.get("page_size") for r in dense if r.get("fp8_paged_ms"))
            a.plot(*zip(*pts), marker="s", ls="--", label=f"FP8 paged (page {page}) / our bf16")
        pts = [(r["L"], r["fp8_over_cudnn_speedup"]) for r in dense if r.get("fp8_over_cudnn_speedup")]
        if pts:
            a.plot(*zip(*pts), marker="^", ls=":", label="FP8 / cuDNN bf16")
        for r in dense:
            a.annotate(f"{r['fp8_tflops']:.0f} TFLOP/s", (r["L"], r["fp8_over_bf16_speedup"]), fontsize=7,
                       textcoords="offset points", xytext=(0, -14), ha="center")
        a.axhline(1.35, color="grey", ls="--", label="target 1.35x (issue 17)")
        a.axhline(1.0, color="grey", lw=0.5)
        a.set_xscale("log", base=2)
        a.set_xticks(Ls, [k_label(L) for L in Ls])
        ys = [y for line in a.get_lines() for y in line.get_ydata()]
        a.set_ylim(min(0.9, min(ys) - 0.05), max(1.45, max(ys) + 0.05))
        a.set_xlabel("L (causal, batch 1, Hq 32, Hkv 8, D 128)")
        a.set_ylabel("speed-up (time ratio, median of rounds)")
        a.set_title(f"dense FP8 (e4m3) against bf16 ({tag})", fontsize=10)
        a.legend(fontsize=7, loc="upper left")
        e = ax["dense_error"]
        for key, label, m in (("fp8_rel_l2_vs_bf16_kernel_dequantised", "FP8 vs our bf16 kernel, dequantised inputs",
                               "o"),
                              ("fp8_rel_l2_vs_fp32_dequantised", "FP8 vs float32, dequantised inputs", "s"),
                              ("fp8_rel_l2_vs_fp32_bf16_inputs", "FP8 vs float32 on the bf16 inputs", "^"),
                              ("bf16_rel_l2_vs_fp32", "our bf16 vs float32", "v")):
            pts = [(r["L"], r[key]) for r in dense if r.get(key) is not None]
            if pts:
                e.plot(*zip(*pts), marker=m, label=label)
        e.set_xscale("log", base=2)
        e.set_yscale("log")
        e.set_xticks(Ls, [k_label(L) for L in Ls])
        e.set_xlabel("L")
        e.set_ylabel("relative L2 error of the output")
        e.set_title("dense FP8 error (float32 reference up to --error-max-len)", fontsize=10)
        e.legend(fontsize=7)

    if sparse:
        a = ax["sparse"]
        keys = (("bf16_attn_no_corr_ms", "bf16 attn, no corr"), ("fp8_attn_no_corr_ms", "FP8 attn, no corr"),
                ("bf16_total_ms", "bf16 one call (correction on)"), ("fp8_total_ms", "FP8 one call (correction on)"))
        w = 0.8 / len(keys)
        for i, (key, label) in enumerate(keys):
            a.bar([j + (i - 1.5) * w for j in range(len(sparse))], [r.get(key) or 0 for r in sparse], w,
                  label=label, color=f"C{i}")
        top = max((r.get(k) or 0) for r in sparse for k, _ in keys)
        for j, r in enumerate(sparse):
            text = f"density {r['density']:.3f}"
            if r.get("fp8_over_bf16_sparse_speedup"):
                text += f"\nFP8/bf16 total {r['fp8_over_bf16_sparse_speedup']:.2f}x"
            a.annotate(text, (j, top * 1.03), ha="center", va="bottom", fontsize=7)
        a.set_ylim(0, top * 1.3)
        a.set_xticks(range(len(sparse)), [k_label(r["L"]) for r in sparse])
        a.set_xlabel("L (topic workload)")
        a.set_ylabel("ms (median of rounds)")
        a.set_title(f"block-sparse FP8 vs bf16, target 1.25x total at 128K ({tag})", fontsize=10)
        a.legend(fontsize=7, loc="center left")

    if structured:
        a = ax["structured"]
        keys = (("structured_bf16_rel_err_vs_dense_bf16", "sparse bf16 vs dense bf16"),
                ("structured_fp8_rel_err_vs_dense_bf16", "sparse FP8 vs dense bf16"),
                ("structured_fp8_dense_rel_err_vs_dense_bf16", "dense FP8 vs dense bf16 (the floor)"))
        keys = [(k, label) for k, label in keys if any(r.get(k) is not None for r in structured)]
        w = 0.8 / len(keys)
        for i, (key, label) in enumerate(keys):
            a.bar([j + (i - (len(keys) - 1) / 2) * w for j in range(len(structured))],
                  [r.get(key) or 0 for r in structured], w, label=label, color=f"C{i}")
        for j, r in enumerate(structured):
            lim = 1.5 * r["structured_bf16_rel_err_vs_dense_bf16"]
            a.plot([j - 0.45, j + 0.45], [lim, lim], color="k", ls="--",
                   label="target: 1.5 x sparse bf16's error" if j == 0 else None)
            if r.get("structured_fp8_over_bf16_error"):
                a.annotate(f"{r['structured_fp8_over_bf16_error']:.2f}x", (j, max(lim, r.get(keys[1][0]) or 0)),
                           ha="center", va="bottom", fontsize=8, textcoords="offset points", xytext=(0, 3))
        a.set_ylim(0, 1.5 * max(max((r.get(k) or 0) for k, _ in keys) for r in structured))
        a.set_xticks(range(len(structured)), [k_label(r["L"]) for r in structured])
        a.set_xlabel("L (structured workload, seed 1)")
        a.set_ylabel("relative L2 error against dense bf16")
        a.set_title("structured workload: FP8 error / bf16 error (above the bars)", fontsize=10)
        a.legend(fontsize=7, loc="upper left")

    if chunked:
        a = ax["chunked"]
        keys = (("fp8_over_bf16_speedup", "step, per call (events)"), ("fp8_over_bf16_graph_speedup",
                                                                        "step, CUDA graph"),
                ("fp8_over_bf16_dense_speedup", "dense paged step"))
        w = 0.8 / len(keys)
        for i, (key, label) in enumerate(keys):
            a.bar([j + (i - 1) * w for j in range(len(chunked))], [r.get(key) or 0 for r in chunked], w,
                  label=label, color=f"C{i}")
        a.axhline(1.0, color="grey", lw=0.8)
        a.set_xticks(range(len(chunked)),
                     [f"{r['chunk']} x {r['batch']}\n{r['mode']}\ndensity {r.get('bf16_density', 0):.3f}"
                      for r in chunked], fontsize=7)
        a.set_ylim(0, max(1.5, 1.1 * max((r.get(k) or 0) for r in chunked for k, _ in keys)))
        a.set_ylabel("FP8 / bf16 speed-up (time ratio)")
        a.set_title(f"chunk steps at {k_label(chunked[0]['L'])}, paged, mean cache ({tag})", fontsize=10)
        a.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

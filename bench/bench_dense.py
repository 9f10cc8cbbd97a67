"""Dense causal prefill on the GPU machine through the installed package (sp.attention) vs torch SDPA cuDNN, torch SDPA
flash (FA2) and optionally FlexAttention, measured in the same process.
Llama-3.1-8B head shape: Hq=32, Hkv=8, D=128, bf16, batch 1, causal. FLOPs = 4*L*L*D*Hq/2. Ours writes out and lse
into caller buffers and gets a caller workspace (the engine path: nothing allocated by the library per call).
Writes one JSON (--out) with the header of bench/_common.py (through_package, device, commit, date, command) and
rows: kind "dense" {L, ours_ms, cudnn_ms, fa2_ms, ours_tflops, ...}, then the extra rows below (their own kinds), and
with matplotlib its plot beside it (.png). Earlier runs wrote the extra rows to a second file,
dense_h200_paged_varlen.json (the committed one stays: docs/design/dense_kernel.md cites it).
Extra rows (on by default, --no-extra to skip):
  * varlen: one causal varlen call over 8 sequences of fixed mixed lengths (VARLEN_MIX, 1K..8K, sum 32K) vs the same
    sequences run one call each (sum of their medians). Target: varlen within 5 % of the separate calls.
  * paged: causal L = --paged-lengths, KV scattered into randomly permuted pages of --page-sizes tokens vs the same
    tokens contiguous, same process, timed in PAGED_ROUNDS interleaved rounds (median of the round medians).
    Target: paged within 5 % of contiguous.
--quick: lengths 8K, 32K, 128K; paged rows at 32K only (pages 64 and 128); no FlexAttention.
Usage: python3 bench/bench_dense.py --out bench/results/dense_h200.json [--lengths 4096,8192] [--flex] [--no-extra]
       python3 bench/bench_dense.py --plot-only bench/results/dense_h200.json   (redraw its PNG, no GPU)"""
import argparse
import os

import torch

from _common import (D, HKV, HQ, RESULTS, add_plot_only, apply_profile, attention_workspace, emit, ints, median,
                     plot_only, require_cuda, sdpa_layout, time_ms, time_sdpa_peers, try_plot, write_results)
from _common import commit, time_graph_ms  # noqa: F401  (re-exported: other scripts import them from here)

VARLEN_MIX = [1024, 8192, 2048, 6144, 3072, 5120, 4096, 3072]  # sum 32768; fixed so runs compare
PAGED_ROUNDS = 3

FULL = dict(lengths="4096,8192,16384,32768,65536,131072", paged_lengths="32768,131072", page_sizes="64,128")
QUICK = dict(lengths="8192,32768,131072", paged_lengths="32768", page_sizes="64,128")


class Ours:
    """sp.attention with caller out / workspace (lse returned, as the shim's benchmark wrote it)."""

    def __init__(self, sp, ws):
        self.sp, self.ws = sp, ws

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, out, **kw):
        return self.sp.attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, out=out, return_lse=True,
                                 workspace=self.ws, **kw)


def varlen_rows(ours, hq, hkv, d, dev, g):
    """One causal varlen call over VARLEN_MIX vs one call per sequence."""
    tot = sum(VARLEN_MIX)
    q = torch.randn(tot, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(tot, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(tot, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    cu_list = [0]
    for L in VARLEN_MIX:
        cu_list.append(cu_list[-1] + L)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    mx = max(VARLEN_MIX)
    varlen_ms = time_ms(lambda: ours(q, k, v, cu, cu, mx, mx, out))
    sep = []
    for b, L in enumerate(VARLEN_MIX):
        a, e = cu_list[b], cu_list[b + 1]
        qb, kb, vb = q[a:e].contiguous(), k[a:e].contiguous(), v[a:e].contiguous()
        cub = torch.tensor([0, L], dtype=torch.int32, device=dev)
        ob = torch.empty_like(qb)
        sep.append(time_ms(lambda: ours(qb, kb, vb, cub, cub, L, L, ob)))
    flops = sum(4 * L * L * d * hq / 2 for L in VARLEN_MIX)
    row = dict(kind="varlen_vs_separate", lengths=VARLEN_MIX, total_tokens=tot, varlen_ms=varlen_ms,
               separate_ms_sum=sum(sep), separate_ms=sep, varlen_over_separate=varlen_ms / sum(sep),
               varlen_tflops=flops / (varlen_ms * 1e-3) / 1e12)
    emit(row)
    del q, k, v, out
    torch.cuda.empty_cache()
    return [row]


def paged_rows(ours, hq, hkv, d, dev, g, paged_lengths, page_sizes):
    """Causal single sequence, KV in randomly permuted pages of page_sizes tokens vs contiguous."""
    rows = []
    for L in paged_lengths:
        q = torch.randn(L, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(L, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(L, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
        cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        fns = {0: lambda: ours(q, k, v, cu, cu, L, L, out)}
        fns[0]()
        ref = out.clone()
        flops = 4 * L * L * d * hq / 2
        caches = {}
        for ps in page_sizes:
            n_pages = (L + ps - 1) // ps
            perm = torch.randperm(n_pages, device=dev, generator=g).to(torch.int32)  # random page placement
            kc = torch.empty(n_pages, ps, hkv, d, device=dev, dtype=torch.bfloat16)
            vc = torch.empty_like(kc)
            pad = n_pages * ps - L  # a last page only partly filled (L not a multiple of ps)
            kp = torch.cat([k, k.new_zeros(pad, hkv, d)]) if pad else k
            vp = torch.cat([v, v.new_zeros(pad, hkv, d)]) if pad else v
            kc[perm.long()] = kp.view(n_pages, ps, hkv, d)
            vc[perm.long()] = vp.view(n_pages, ps, hkv, d)
            bt = perm.view(1, n_pages).contiguous()
            su = torch.tensor([L], dtype=torch.int32, device=dev)
            caches[ps] = (kc, vc, bt, su)
            fns[ps] = (lambda c=caches[ps]: ours(q, c[0], c[1], cu, None, L, L, out, block_table=c[2],
                                                 seqused_k=c[3]))
        # Interleaved rounds (contiguous, page 64, page 128, contiguous, ...): long back-to-back runs drift with the
        # GPU's power/clock state (one 128K run measured page 128 at 1.006x, the next at 1.093x contiguous when
        # timed after it), so each variant is timed in every round and the median over rounds is reported.
        per = {key: [] for key in fns}
        for _ in range(PAGED_ROUNDS):
            for key, fn in fns.items():
                per[key].append(time_ms(fn, total_ms_budget=500.0))
        med = {key: median(v_) for key, v_ in per.items()}
        for ps in page_sizes:
            fns[ps]()
            torch.cuda.synchronize()
            row = dict(kind="paged_vs_contiguous", L=L, page_size=ps, paged_ms=med[ps], contiguous_ms=med[0],
                       paged_over_contiguous=med[ps] / med[0], paged_tflops=flops / (med[ps] * 1e-3) / 1e12,
                       paged_ms_rounds=per[ps], contiguous_ms_rounds=per[0],
                       max_abs_diff_vs_contiguous=(out.float() - ref.float()).abs().max().item())
            emit(row)
            rows.append(row)
        del q, k, v, out, ref, caches, fns
        torch.cuda.empty_cache()
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(RESULTS, "dense_h200.json"))
    ap.add_argument("--lengths", default=None, help=f"sequence lengths (default {FULL['lengths']}; "
                                                    f"--quick {QUICK['lengths']})")
    ap.add_argument("--quick", action="store_true", help="short run (see above): about a minute on the H200")
    ap.add_argument("--flex", action="store_true", help="also time FlexAttention (torch.compile: ~1 min extra)")
    ap.add_argument("--hq", type=int, default=HQ)
    ap.add_argument("--hkv", type=int, default=HKV)
    ap.add_argument("--label", default="", help="free text stored in the JSON")
    ap.add_argument("--no-extra", dest="extra", action="store_false",
                    help="skip the varlen-vs-separate and paged-vs-contiguous rows")
    ap.add_argument("--paged-lengths", default=None, help="lengths of the paged-vs-contiguous rows ('' to skip)")
    ap.add_argument("--no-varlen", dest="varlen", action="store_false", help="skip the varlen-vs-separate row")
    ap.add_argument("--page-sizes", default=None, help="page sizes of the paged-vs-contiguous rows (any size >= 1)")
    add_plot_only(ap)
    args = apply_profile(ap.parse_args(argv), QUICK, FULL)
    ints(args.lengths), ints(args.paged_lengths), ints(args.page_sizes)  # fail on bad lists before the GPU work
    if args.hq % args.hkv:
        ap.error("--hq must be a multiple of --hkv")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.plot_only:
        return plot_only(plot, args.plot_only)
    sp = require_cuda()
    page_sizes = ints(args.page_sizes)
    hq, hkv, d = args.hq, args.hkv, D
    g = hq // hkv
    dev = "cuda"
    ours = Ours(sp, attention_workspace(d))
    rows = []
    flex = None
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention)
    shape = dict(hq=hq, hkv=hkv, d=d, dtype="bfloat16", batch=1, causal=True)
    meta = dict(shape=shape, label=args.label, call="sp.attention(out=, return_lse=True, workspace=)")
    if args.extra:  # the extra rows' settings (the varlen row has 8 sequences: shape's batch is the dense rows')
        meta.update(varlen_mix=VARLEN_MIX if args.varlen else None, paged_lengths=ints(args.paged_lengths),
                    page_sizes=page_sizes, paged_rounds=PAGED_ROUNDS)
    for L in ints(args.lengths):
        torch.manual_seed(0)
        q = torch.randn(L, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(L, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(L, hkv, d, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        flops = 4 * L * L * d * hq / 2
        row = dict(kind="dense", L=L, path=sp.attention_path(q, k, v, cu, cu, L, L))
        row["ours_ms"] = time_ms(lambda: ours(q, k, v, cu, cu, L, L, out))
        qt, kt, vt = sdpa_layout(q, k, v, g)
        time_sdpa_peers(row, qt, kt, vt, is_causal=True)
        if row.get("cudnn_ms"):  # sanity: ours vs cuDNN output
            from torch.nn.attention import SDPBackend, sdpa_kernel
            import torch.nn.functional as F
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            ours(q, k, v, cu, cu, L, L, out)
            row["max_abs_diff_vs_cudnn"] = (out.float() - ref[0].transpose(0, 1).float()).abs().max().item()
            del ref
        if flex is not None:
            try:
                bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, device=dev)
                row["flex_ms"] = time_ms(lambda: flex(qt, kt, vt, block_mask=bm))
            except Exception as e:  # noqa: BLE001
                row["flex_ms"] = None
                row["flex_error"] = repr(e)[:200]
        for key in ("ours", "cudnn", "fa2", "flex"):
            if row.get(key + "_ms"):
                row[key + "_tflops"] = flops / (row[key + "_ms"] * 1e-3) / 1e12
        emit(row)
        rows.append(row)
        write_results(args.out, rows, **meta)
        del q, k, v, qt, kt, vt, out
        torch.cuda.empty_cache()
    if args.extra:  # rows of the same file, after the dense rows (written after each group)
        gen = torch.Generator(device=dev).manual_seed(0)
        if args.varlen:
            rows += varlen_rows(ours, hq, hkv, d, dev, gen)
            write_results(args.out, rows, **meta)
        rows += paged_rows(ours, hq, hkv, d, dev, gen, ints(args.paged_lengths), page_sizes)
    res = write_results(args.out, rows, **meta)
    try_plot(plot, res, os.path.splitext(args.out)[0] + ".png")


def plot(res, path):
    """TFLOP/s against length for every peer (the kind "dense" rows; files from before the kinds have none: every
    row without one is a dense row) and, when the file holds them, the extra rows: paged / contiguous and varlen /
    separate time against the 5 % targets (a file holding only those, as dense_h200_paged_varlen.json, gets that
    panel alone)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dense = [r for r in res["rows"] if r.get("kind", "dense") == "dense"]
    paged = [r for r in res["rows"] if r.get("kind") == "paged_vs_contiguous"]
    varlen = [r for r in res["rows"] if r.get("kind") == "varlen_vs_separate"]
    panels = (["dense"] if dense else []) + (["extra"] if paged or varlen else [])
    if not panels:
        raise ValueError("no dense, paged or varlen rows to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.2), squeeze=False)
    axes = dict(zip(panels, axes[0]))
    if "dense" in axes:
        ax = axes["dense"]
        for key, label in (("ours", "ours (sm90a, through the package)"), ("cudnn", "torch SDPA cuDNN"),
                           ("fa2", "torch SDPA flash (FA2)"), ("flex", "FlexAttention")):
            pts = [(r["L"], r[f"{key}_tflops"]) for r in dense if r.get(f"{key}_tflops")]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length L (causal, batch 1, Hq 32, Hkv 8, D 128, bf16)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"dense prefill on the {res.get('device', 'GPU')} ({res.get('commit', '')[:7]})")
        ax.grid(alpha=0.3)
        ax.legend()
    if "extra" in axes:
        ax = axes["extra"]
        labels = [f"paged {r['page_size']}\nL {r['L'] // 1024}K" for r in paged]
        values = [r["paged_over_contiguous"] for r in paged]
        if varlen:
            mix = varlen[0].get("lengths") or res.get("varlen_mix") or []
            labels.append(f"varlen {len(mix) or '?'} seqs\n{varlen[0]['total_tokens'] // 1024}K tokens")
            values.append(varlen[0]["varlen_over_separate"])
        bars = ax.bar(range(len(values)), values, color=["C0"] * len(paged) + ["C1"] * len(varlen))
        for b, y in zip(bars, values):
            ax.annotate(f"{y:.3f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.axhline(1.05, color="grey", ls="--", label="target: within 5 %")
        ax.set_ylim(0, max(values + [1.05]) * 1.15)
        ax.set_ylabel("paged / contiguous, varlen / separate calls (time)")
        ax.set_title(f"paged KV and varlen ({res.get('commit', '')[:7]}; {res.get('paged_rounds', '?')} "
                     "interleaved rounds)")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

"""The selection's price (the library's default selection against the earlier default and FlashPrefill V2's rule) and
the dense rule's promise (a call that keeps nearly every block runs at dense speed), on the H200 through the package.

Rows (bench/results/selection_h200.json), every time a CUDA-graph replay median, cuDNN in the same process:
  kind 'topic'  the speed workload (docs/workload.md, Llama-3.1-8B heads) at each L: per selection config
                (`default` = the library's defaults, `previous` = row max alpha 0.1 per KV group, the default before
                issue 37, `fpv2` = FlashPrefill V2's tile energy without correction): index_ms (sp.build_index into a
                preallocated workspace), total_ms (one-call sp.sparse_prefill), density, index_pct_of_dense,
                speedup_vs_cudnn; dense_ms (our sp.attention) and cudnn_ms.
  kind 'dense_selection'  Gaussian q, k (every block scores alike: the default selection keeps ~all of them, and the
                dense rule fires): sparse_prefill with the defaults against sp.attention (ratio, the target <= 1.02)
                and with dense_fraction=1 (the rule off: the sparse kernel over every block) for what the rule saves;
                one row per --dense-configs entry (its `config`; `default_*` then means that config's call).
  kind 'gate'   the topic workload with the defaults against dense_fraction=1 (no dense launch), alternating calls:
                what the gated-off dense kernel and the rule's kernel cost a call that stays sparse.
  kind 'chunk'  one 1024-query chunk step at the end of an L-token prompt over a paged cache (page 64) with the
                pooled-means cache: the default selection's index_ms (sp.build_index, final_chunk=False) and the
                chunked_prefill step, against the dense step (sp.attention on the same cache).

Writes --out and, with matplotlib, its plot beside it (.png): the topic rows' speed-up over cuDNN and times per
config, the dense rule's ratios, the gate and chunk rows in words. (`bench/plot_status.py` also reads this file: the
README's speed figure.)

    python bench/bench_selection.py --lengths 8192,32768,131072
    python bench/bench_selection.py --plot-only bench/results/selection_h200.json   (redraw its PNG, no GPU)
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: _common, accuracy.configs
from _common import (HKV, HQ, D, RESULTS, add_plot_only, emit, ints, plot_only, require_cuda,  # noqa: E402
                     sdpa_layout, time_graph_ms, time_sdpa_peers, topic, try_plot, workspace, write_results)

CONFIGS = {
    "default": {},
    "previous": dict(rule="row_max", alpha=0.1, head_subgroups=1, dense_fraction=1.0),
    "fpv2": dict(rule="tile_energy", alpha=0.1, head_subgroups=1, correction=False, dense_fraction=1.0),
}


def config(name):
    """A registered name, or library keywords 'sp:k=v;k=v' (e.g. 'sp:rule=key_max;alpha=0.1')."""
    if name in CONFIGS:
        return CONFIGS[name]
    if name.startswith("sp:"):
        from accuracy.configs import parse_kv
        return parse_kv(name[3:])
    raise ValueError(f"unknown config {name!r} (registered: {', '.join(CONFIGS)}; or sp:k=v;...)")


def one_shot_rows(sp, L, configs, rows, out, peers):
    q, k, v = topic(L)
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    args = (q, k, v, cu, cu, L, L)
    aw = workspace(sp.attention_workspace_bytes(D))
    o = torch.empty_like(q)
    dense = time_graph_ms(lambda: sp.attention(*args, out=o, workspace=aw))
    base = dict(kind="topic", L=L, dense_ms=dense)
    if peers:
        time_sdpa_peers(base, *sdpa_layout(q, k, v, HQ // HKV), is_causal=True, graph=False, keys=("cudnn",))
    for name in configs:
        kw = config(name)
        iw = workspace(sp.index_workspace_bytes(*args, **kw))
        pw = workspace(sp.sparse_prefill_workspace_bytes(*args, **kw))
        index_ms = time_graph_ms(lambda: sp.build_index(*args, workspace=iw, **kw))
        total_ms = time_graph_ms(lambda: sp.sparse_prefill(*args, out=o, workspace=pw, **kw))
        density = sp.build_index(*args, **kw).density
        row = dict(base, config=name, selection=kw, index_ms=index_ms, total_ms=total_ms, density=density,
                   index_pct_of_dense=100 * index_ms / dense if index_ms and dense else None)
        if base.get("cudnn_ms") and total_ms:
            row["speedup_vs_cudnn"] = base["cudnn_ms"] / total_ms
        rows.append(row)
        emit(row)
        write_results(out, rows)
    del q, k, v
    torch.cuda.empty_cache()


def dense_selection_rows(sp, L, names, rows, out):
    g = torch.Generator(device="cuda").manual_seed(L)
    q = torch.randn(L, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(L, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(L, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    args = (q, k, v, cu, cu, L, L)
    o = torch.empty_like(q)
    aw = workspace(sp.attention_workspace_bytes(D))
    attn = time_graph_ms(lambda: sp.attention(*args, out=o, workspace=aw))
    for name in names:  # one row per config, against the one attention time
        sel = config(name)
        row = dict(kind="dense_selection", L=L, config=name, selection=sel, attention_ms=attn)
        for variant, kw in (("default", sel), ("rule_off", dict(sel, dense_fraction=1.0))):
            pw = workspace(sp.sparse_prefill_workspace_bytes(*args, **kw))
            row[variant + "_ms"] = time_graph_ms(lambda: sp.sparse_prefill(*args, out=o, workspace=pw, **kw))
            row[variant + "_density"] = sp.build_index(*args, **kw).density
        row["default_over_attention"] = row["default_ms"] / attn
        row["rule_off_over_attention"] = row["rule_off_ms"] / attn
        rows.append(row)
        emit(row)
        write_results(out, rows)


def gate_rows(sp, L, rows, out, rounds=5):
    q, k, v = topic(L)
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    args = (q, k, v, cu, cu, L, L)
    o = torch.empty_like(q)
    times = {"rule_on": [], "rule_off": []}
    for _ in range(rounds):  # alternating: the two variants see the same machine state
        for name, kw in (("rule_on", {}), ("rule_off", dict(dense_fraction=1.0))):
            pw = workspace(sp.sparse_prefill_workspace_bytes(*args, **kw))
            times[name].append(time_graph_ms(lambda: sp.sparse_prefill(*args, out=o, workspace=pw, **kw), rounds=3))
    med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    row = dict(kind="gate", L=L, rule_on_ms=med["rule_on"], rule_off_ms=med["rule_off"],
               gate_cost_ms=med["rule_on"] - med["rule_off"], ratio=med["rule_on"] / med["rule_off"], rounds=times)
    rows.append(row)
    emit(row)
    write_results(out, rows)


def chunk_rows(sp, L, C, rows, out, page=64, name="default"):
    kw = config(name)
    q, k, v = topic(L)
    pages = L // page
    kc, vc = k.reshape(pages, page, HKV, D).contiguous(), v.reshape(pages, page, HKV, D).contiguous()
    bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    means = sp.mean_cache(kc)
    used = torch.tensor([L], dtype=torch.int32, device="cuda")
    # the prompt's earlier chunks wrote the cache's complete blocks: one whole-prompt step fills it
    sp.chunked_prefill(q, kc, vc, torch.tensor([0, L], dtype=torch.int32, device="cuda"), bt, used, L, L,
                       final_chunk=False, mean_cache=means)
    qc = q[L - C:].contiguous()
    cu_q = torch.tensor([0, C], dtype=torch.int32, device="cuda")
    step = (qc, kc, vc, cu_q, bt, used, C, L)
    o = torch.empty_like(qc)
    iw = workspace(sp.index_workspace_bytes(qc, kc, vc, cu_q, None, C, L, block_table=bt, seqused_k=used, **kw))
    index_ms = time_graph_ms(lambda: sp.build_index(qc, kc, vc, cu_q, None, C, L, block_table=bt, seqused_k=used,
                                                    final_chunk=False, mean_cache=means, workspace=iw, **kw))
    cw = workspace(sp.chunked_prefill_workspace_bytes(*step, **kw))
    step_ms = time_graph_ms(lambda: sp.chunked_prefill(*step, final_chunk=False, mean_cache=means, out=o,
                                                       workspace=cw, **kw))
    aw = workspace(sp.attention_workspace_bytes(D))
    dense_ms = time_graph_ms(lambda: sp.attention(qc, kc, vc, cu_q, None, C, L, block_table=bt, seqused_k=used,
                                                  out=o, workspace=aw))
    density = sp.build_index(qc, kc, vc, cu_q, None, C, L, block_table=bt, seqused_k=used, final_chunk=False,
                             mean_cache=means, **kw).density
    row = dict(kind="chunk", L=L, chunk=C, config=name, selection=kw, index_ms=index_ms, step_ms=step_ms, dense_step_ms=dense_ms,
               density=density, speedup_vs_dense_step=dense_ms / step_ms if step_ms else None)
    rows.append(row)
    emit(row)
    write_results(out, rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--configs", default="default,previous,fpv2")
    ap.add_argument("--dense-lengths", default="8192,32768,131072")
    ap.add_argument("--dense-configs", default="default", help="the configs of the dense-selection rows")
    ap.add_argument("--gate-lengths", default="8192,131072")
    ap.add_argument("--chunk", default="131072:1024", help="L:C of the chunk-step rows ('' to skip)")
    ap.add_argument("--chunk-configs", default="default", help="the configs of the chunk-step rows")
    ap.add_argument("--no-peers", dest="peers", action="store_false")
    ap.add_argument("--out", default=os.path.join(RESULTS, "selection_h200.json"))
    add_plot_only(ap)
    args = ap.parse_args()
    if args.plot_only:
        return plot_only(plot, args.plot_only)
    sp = require_cuda()
    rows = []
    configs = [c for c in args.configs.split(",") if c]
    for L in ints(args.lengths):
        one_shot_rows(sp, L, configs, rows, args.out, args.peers)
    for L in ints(args.dense_lengths):
        dense_selection_rows(sp, L, [c for c in args.dense_configs.split(",") if c], rows, args.out)
    for L in ints(args.gate_lengths):
        gate_rows(sp, L, rows, args.out)
    for item in [x for x in args.chunk.split(",") if x]:
        L, C = (int(x) for x in item.split(":"))
        for name in [c for c in args.chunk_configs.split(",") if c]:
            chunk_rows(sp, L, C, rows, args.out, name=name)
    res = write_results(args.out, rows, selection_defaults=dict(sp.SELECTION_DEFAULTS))
    try_plot(plot, res, os.path.splitext(args.out)[0] + ".png")


LABELS = {"default": "default", "previous": "previous default (row max 0.1 per KV group)",
          "fpv2": "FlashPrefill V2's rule (tile energy 0.1)"}


def plot(res, path):
    """Left: one sparse_prefill call's speed-up over cuDNN per config by L (kind 'topic'), density beside each
    point. Middle: the one call's time (solid) and the index stage's (dashed) per config, with our dense and cuDNN.
    Right: the dense rule (kind 'dense_selection'): sparse_prefill / attention with the rule (the defaults) and
    without (dense_fraction=1) against the 1.02 target; the gate and chunk rows written underneath."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)
    rows = res["rows"]
    topic_rows = [r for r in rows if r.get("kind") == "topic"]
    dense_sel = [r for r in rows if r.get("kind") == "dense_selection" and r.get("config", "default") == "default"]
    configs = list(dict.fromkeys(r["config"] for r in topic_rows))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 5))
    k_label = lambda L: f"{L // 1024}K"  # noqa: E731
    for i, name in enumerate(configs):
        rs = [r for r in topic_rows if r["config"] == name]
        pts = [(r["L"], r["speedup_vs_cudnn"], r["density"]) for r in rs if r.get("speedup_vs_cudnn")]
        if pts:
            dens = " / ".join(f"{100 * p[2]:.1f}" for p in pts)
            a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}",
                   label=f"{LABELS.get(name, name)}\n  density {dens} %")
            if name == "default":  # the series the README cites: its values beside the points
                last = max(p[0] for p in pts)
                for L, y, d in pts:
                    a.annotate(f"{y:.1f}x ({100 * d:.1f} %)", (L, y), fontsize=7, textcoords="offset points",
                               xytext=(-5 if L == last else 5, -11), ha="right" if L == last else "left",
                               color=f"C{i}")
        b.plot([r["L"] for r in rs], [r["total_ms"] for r in rs], marker="o", color=f"C{i}",
               label=f"{name}: one call")
        b.plot([r["L"] for r in rs], [r["index_ms"] for r in rs], marker=".", ls="--", color=f"C{i}",
               label=f"{name}: index stage")
    Ls = sorted({r["L"] for r in topic_rows})
    for key, label, color in (("dense_ms", "our dense (sp.attention)", "k"), ("cudnn_ms", "cuDNN", "grey")):
        pts = [(L, next(r[key] for r in topic_rows if r["L"] == L)) for L in Ls
               if any(r.get(key) for r in topic_rows if r["L"] == L)]
        if pts:
            b.plot(*zip(*pts), marker="s", color=color, ls=":", label=label)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ls, [k_label(L) for L in Ls])
        ax.set_xlabel("L (topic workload, Hq 32 Hkv 8 D 128 bf16)")
        ax.legend(fontsize=7, loc="upper left")
    a.set_yscale("log")
    a.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    a.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    a.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a.set_ylabel("cuDNN time / one sparse_prefill call")
    a.set_title(f"the selection's price, CUDA-graph times ({str(res.get('commit', ''))[:7]})", fontsize=10)
    b.set_yscale("log")
    b.set_ylabel("ms (CUDA-graph replay)")
    b.set_title("one call and its index stage", fontsize=10)
    if dense_sel:
        x = range(len(dense_sel))
        c.bar([j - 0.2 for j in x], [r["default_over_attention"] for r in dense_sel], 0.4, color="C0",
              label="defaults (the rule fires: dense launch)")
        c.bar([j + 0.2 for j in x], [r["rule_off_over_attention"] for r in dense_sel], 0.4, color="C3",
              label="dense_fraction=1 (rule off: sparse kernel, every block)")
        for j, r in zip(x, dense_sel):
            for dx, key in ((-0.2, "default_over_attention"), (0.2, "rule_off_over_attention")):
                c.annotate(f"{r[key]:.3f}", (j + dx, r[key]), ha="center", va="bottom", fontsize=7)
        c.axhline(1.02, color="grey", ls="--", label="target 1.02")
        c.set_xticks(list(x), [k_label(r["L"]) for r in dense_sel])
        c.set_ylim(0.8, 1.1 * max(r["rule_off_over_attention"] for r in dense_sel))
        c.set_xlabel("L (Gaussian q, k: every block kept)")
        c.set_ylabel("sparse_prefill / attention (time)")
        c.legend(fontsize=7, loc="upper left")
    c.set_title("the dense rule: never slower than dense", fontsize=10)
    notes = [f"gate, {k_label(r['L'])}: rule on {r['rule_on_ms']:.3f} ms vs off {r['rule_off_ms']:.3f} ms "
             f"({r['gate_cost_ms']:+.3f} ms)" for r in rows if r.get("kind") == "gate"]
    notes += [f"chunk {r['chunk']} at {k_label(r['L'])}: index {r['index_ms']:.3f} ms, step {r['step_ms']:.3f} ms vs "
              f"dense step {r['dense_step_ms']:.2f} ms ({r['speedup_vs_dense_step']:.1f}x), density "
              f"{r['density']:.3f}" for r in rows if r.get("kind") == "chunk" and r.get("step_ms")]
    if notes:
        fig.text(0.68, 0.01, "\n".join(notes), fontsize=7, va="bottom")
        fig.tight_layout(rect=(0, 0.03 + 0.025 * len(notes), 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

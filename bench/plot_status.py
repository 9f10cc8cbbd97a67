"""The README's speed figure: block-sparse prefill's speed-up over cuDNN by prompt length, at the library's default
selection (the lead series) and at FlashPrefill V2's faster, less accurate rule, against FlashPrefill V2's own code.

    python3 bench/plot_status.py [--sparse bench/results/sparse_h200.json] [--selection bench/results/selection_h200.json]
                                 [--out bench/results/speed_vs_cudnn_h200.png]

Reads, never measures (matplotlib only, no GPU); every series is labelled with its selection, file, commit and date:
  - the lead series, ours at the library's default selection: `--selection` (bench_selection.py's results file): its
    `topic` rows of config 'default' (speedup_vs_cudnn, one sparse_prefill call against cuDNN in the same process; the
    file records the defaults it ran with, `selection_defaults`);
  - ours at the selection `--sparse` records (bench_sparse.py's results file; FlashPrefill V2's rule tile_energy at
    alpha 0.1 in the committed file, which trades accuracy for speed: README, "Accuracy"): cudnn_ms /
    sparse_prefill_no_corr_ms per row (one `sp.sparse_prefill` call without the mean correction, cuDNN timed in the
    same process), and the 1M row's speedup_vs_cudnn (that row runs the file's selection as recorded, correction
    included);
  - FlashPrefill V2's own code on the H200, topic workload, total (index + sparse attention) against cuDNN in the same
    run: the design brief's table (DESIGN.md, "The speed reference workload", measured 2026-11-29), copied below;
  - FlashPrefill V2's paper: 27.2x-27.5x at 128K in BF16 (H20 GPUs, real models, against its own FA3/4-aligned dense
    kernel; seeds/flashprefill_v2.txt, section "Main results"): a range at 128K, not the same workload or machine.
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
# DESIGN.md, "The speed reference workload": FP-V2 total vs cuDNN on the H200 (L -> x)
FPV2_H200 = {8192: 1.0, 16384: 3.4, 32768: 7.2, 65536: 12.7, 131072: 21.7}
FPV2_PAPER_128K = (27.2, 27.5)


def ours(res: dict) -> list:
    """(L, speed-up over cuDNN, density) per row of a bench_sparse.py results file."""
    points = []
    for r in res["rows"]:
        if r.get("long"):
            x = r.get("speedup_vs_cudnn")
        elif r.get("cudnn_ms") and r.get("sparse_prefill_no_corr_ms"):
            x = r["cudnn_ms"] / r["sparse_prefill_no_corr_ms"]
        else:
            x = None
        if x:
            points.append((r["L"], x, r["density"]))
    return points


def defaults(sel_res: dict) -> list:
    """(L, speed-up over cuDNN, density) of the default selection's rows of a bench_selection.py results file."""
    return [(r["L"], r["speedup_vs_cudnn"], r["density"]) for r in sel_res.get("rows", [])
            if r.get("kind") == "topic" and r.get("config") == "default" and r.get("speedup_vs_cudnn")]


def provenance(res: dict, source: str) -> str:
    """'file at commit, date' of a results file."""
    return f"{os.path.basename(source)} at {str(res.get('commit', '?'))[:7]}, {str(res.get('date', '?'))[:10]}"


def plot(res: dict, path: str, source: str, sel_res: dict = None, sel_source: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8.5, 6.2))
    if sel_res:  # the lead series: the library's default selection
        d = sel_res.get("selection_defaults", {})
        pts_d = defaults(sel_res)
        ax.plot([p[0] for p in pts_d], [p[1] for p in pts_d], marker="D", lw=2.4, ms=7, color="C3", zorder=3,
                label=f"SparsePrefill at the library's default selection (rule {d.get('rule')}, alpha "
                      f"{d.get('alpha')}, head_subgroups {d.get('head_subgroups')}, dense_fraction "
                      f"{d.get('dense_fraction')}):\n{provenance(sel_res, sel_source)}")
        for L, x, density in pts_d:
            ax.annotate(f"{x:.1f}x\n{100 * density:.1f} %", (L, x), textcoords="offset points", xytext=(8, -20),
                        fontsize=8, color="C3", fontweight="bold")
    sel = res.get("selection", {})
    pts = ours(res)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ls="--", color="C0",
            label=f"SparsePrefill at rule {sel.get('rule')}, alpha {sel.get('alpha')}, head_subgroups "
                  f"{sel.get('head_subgroups', 1)}, no correction (1M: with it): faster, far less accurate\n"
                  f"(README, Accuracy): {provenance(res, source)}")
    for L, x, density in pts:
        ax.annotate(f"{x:.1f}x\n{100 * density:.1f} %", (L, x), textcoords="offset points", xytext=(-40, 4),
                    fontsize=7, color="C0")
    ax.plot(list(FPV2_H200), list(FPV2_H200.values()), marker="s", color="C2",
            label="FlashPrefill V2's code, same workload, H200 (design brief, 2026-11-29)")
    ax.errorbar([131072], [sum(FPV2_PAPER_128K) / 2], yerr=[[0.15], [0.15]], fmt="^", color="gray", capsize=4,
                label="FlashPrefill V2 paper: 27.2-27.5x at 128K (H20, real models, vs its dense kernel)")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.margins(x=0.08, y=0.12)  # room for the point labels at both ends
    ax.set_xlabel("prompt length L (tokens); labels: speed-up, selected density")
    ax.set_ylabel("speed-up over cuDNN SDPA (causal, bf16), one call")
    ax.set_title(f"Block-sparse prefill against cuDNN: topic workload, Hq 32 / Hkv 8 / D 128, batch 1, "
                 f"{res.get('device', '?')}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sparse", default=os.path.join(HERE, "results", "sparse_h200.json"),
                    help="bench_sparse.py results file (default: bench/results/sparse_h200.json)")
    ap.add_argument("--selection", default=os.path.join(HERE, "results", "selection_h200.json"),
                    help="bench_selection.py results file (default: bench/results/selection_h200.json); '' for none")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "speed_vs_cudnn_h200.png"),
                    help="the PNG to write (default: bench/results/speed_vs_cudnn_h200.png)")
    args = ap.parse_args()
    with open(args.sparse) as f:
        res = json.load(f)
    sel_res = None
    if args.selection:
        with open(args.selection) as f:
            sel_res = json.load(f)
        for L, x, density in defaults(sel_res):
            print(f"L={L:>8}  {x:6.2f}x cuDNN  density {density:.4f}  (default selection; "
                  f"{provenance(sel_res, args.selection)})")
    sel = res.get("selection", {})
    for L, x, density in ours(res):
        print(f"L={L:>8}  {x:6.2f}x cuDNN  density {density:.4f}  (rule {sel.get('rule')}, alpha {sel.get('alpha')}; "
              f"{provenance(res, args.sparse)})")
    plot(res, args.out, args.sparse, sel_res, args.selection)


if __name__ == "__main__":
    main()

"""What a calibration writes: DIR/sparse_prefill.json (the adapters' configuration), DIR/calibration.json (every
measurement; `confirmation`: the chosen settings measured on the confirmation prompts), DIR/report.md and, when
matplotlib is installed, DIR/calibration.png (accuracy and NLL against density per setting with the oracle's curve,
and the density of each layer); without matplotlib the log and report.md say why the figure is missing
(NO_FIGURE)."""

from __future__ import annotations

import json
import os
from typing import List, Optional

from ..integrations.core import LONG_PROMPT_FACTOR
from .search import cost_text

NO_FIGURE = "calibration.png not written: matplotlib is not installed (pip install matplotlib)"


def _fmt(t: Optional[dict], unit: str) -> str:
    if not t:
        return "-"
    where = f" ({t['task']} L={t['L']})" if "task" in t and unit == "pt" else ""
    return f"{t['diff']:+.2f} {unit} [{t['low']:+.2f}, {t['high']:+.2f}]{where}"


def worst_text(r: dict) -> str:
    """A result's worst top-1 drop and NLL increase, with intervals."""
    parts = []
    if r.get("worst_drop"):
        parts.append(f"worst top-1 {_fmt(r['worst_drop'], 'pt')}")
    if r.get("worst_nll"):
        parts.append(f"NLL {_fmt(r['worst_nll'], '%')}")
    return ", ".join(parts) or "nothing scored"


def worst_short(r: dict) -> str:
    """A result's worst top-1 drop and NLL increase, point estimates only."""
    parts = [f"{r[k]['diff']:+.2f} {u}" for k, u in (("worst_drop", "pt"), ("worst_nll", "% NLL")) if r.get(k)]
    return " / ".join(parts) or "nothing scored"


def confirmation_summary(c: Optional[dict]) -> str:
    """One line on what the confirmation prompts said (calibration.json's `confirmation`)."""
    if not c:
        return "not confirmed"
    if c["outcome"] == "skipped":
        return f"not confirmed: {c['reason']}"
    if c["outcome"] == "none":
        return c["reason"]
    by_name = {r["name"]: r for r in c["results"]}
    if c["outcome"] == "confirmed":
        return f"confirmed on {c['n_prompts']} other prompts: {worst_text(by_name[c['confirmed']])}"
    failed = ", ".join(f"{n} fails ({worst_text(by_name[n])})" for n in c["order"]
                       if n in by_name and n != c["confirmed"])
    return (f"on {c['n_prompts']} other prompts {failed}; {c['confirmed']}, safer, is confirmed there: "
            f"{worst_text(by_name[c['confirmed']])}")


def _density(r: dict, L) -> str:
    d = r["lengths"][L].get("density")
    return "-" if d is None else f"{d:.3f}"


def plot(doc: dict, path: str) -> Optional[str]:
    """The figure, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    results, rec = doc["results"], doc.get("recommended")
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, key, label in ((axes[0], "worst_drop", "worst top-1 difference to dense (points)"),
                           (axes[1], "worst_nll", "NLL difference to dense (%)")):
        for kind, style in (("uniform", "o"), ("per-layer", "s"), ("file", "D"), ("adapter", "^")):
            for j, r in enumerate(r for r in results if r["kind"] == kind and r.get(key) and r.get("cost") is not None):
                t = r[key]
                ax.errorbar(r["cost"], t["diff"], yerr=[[t["diff"] - t["low"]], [t["high"] - t["diff"]]],
                            fmt=style, capsize=3, color="tab:gray" if kind == "per-layer" else None,
                            label=r["name"] if kind != "per-layer" else ("per-layer plans" if j == 0 else None))
                if r["name"] == rec:
                    ax.plot(r["cost"], t["diff"], "*", ms=16, mfc="none", mec="tab:red", label="recommended")
        oracle = sorted((r for r in results if r["kind"] == "oracle" and r.get(key)), key=lambda r: r["cost"])
        if oracle:
            ax.plot([r["cost"] for r in oracle], [r[key]["diff"] for r in oracle], "k--", marker="x", label="oracle F")
            for r in oracle:
                ax.annotate(r["name"].split("=")[-1], (r["cost"], r[key]["diff"]), fontsize=7)
        bound = -doc["tolerance"]["max_drop"] if key == "worst_drop" else doc["tolerance"]["max_nll"]
        ax.axhline(bound, color="red", lw=0.8, ls=":")
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_xlabel(f"cost at L={doc['lengths'][-1]}: density (mean over layers) + index time / dense time")
        ax.set_ylabel(label)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    ax = axes[2]
    L = max(doc["lengths"])
    chosen = next((r for r in results if r["name"] == rec), None) or next(
        (r for r in results if r["kind"] == "file"), None)              # check mode: the file's layers
    if chosen and chosen["lengths"][L]["layer_density"]:
        ld = chosen["lengths"][L]["layer_density"]
        ax.bar(range(len(ld)), ld, color="tab:green", alpha=0.6, label=f"recommended ({rec})" if rec else "the file")
    for r in results:
        if r["kind"] == "oracle" and r["lengths"][L]["layer_density"]:
            ax.plot(r["lengths"][L]["layer_density"], marker=".", lw=1, label=r["name"])
    ax.set_xlabel("layer")
    ax.set_ylabel(f"density at L={L}")
    ax.set_ylim(0, 1.05)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.suptitle(f"SparsePrefill calibration: {doc['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(doc: dict, figure: Optional[str], figure_note: Optional[str] = None) -> str:
    lengths, results, tol = doc["lengths"], doc["results"], doc["tolerance"]
    rec = next((r for r in results if r["name"] == doc.get("recommended")), None)
    out: List[str] = [f"# SparsePrefill calibration: {doc['model']}", ""]
    out.append(f"{doc['date']}, sparse_prefill {doc['version']} on {doc['device']}; lengths {', '.join(map(str, lengths))};"
               f" {doc['filler']} as filler; tolerance: top-1 within {tol['max_drop']} points, NLL within "
               f"{tol['max_nll']} % of dense ({'interval ends' if tol['strict'] else 'point estimates'}); "
               f"{doc['seconds']:.0f} s. Command: `{doc['command']}`")
    out += ["", "Prompts per length (scored tokens): " + "; ".join(
        f"L={L}: " + ", ".join(f"{v} {n['prompts']} ({n['tokens']})" for v, n in doc["prompts"][str(L)].items())
        for L in lengths), ""]
    if doc["mode"] == "check":
        out += ["## Check", "", f"`{doc['check']}` measured as the calibration runs it and through the transformers "
                "adapter (its VarlenDispatch with min_sparse_q_len 1 and min_sparse_kv_len 0).", ""]
        gap = reproduction_gap(results)
        if gap is not None:
            out += [f"Largest difference between the two on any task and length: {gap:.3f} (points of top-1, or % "
                    "of NLL).", ""]
    else:
        out += ["## Recommendation", ""]
        conf = doc.get("confirmation") or {}
        if doc.get("no_pruning"):
            out += [f"**The library's default selection**: {doc['note']}.", ""]
            if rec is not None:
                out.append(f"As measured here (default): worst top-1 {_fmt(rec['worst_drop'], 'pt')}; NLL "
                           f"{_fmt(rec['worst_nll'], '%')}.")
        elif conf.get("outcome") == "none":
            out += [f"**Every layer dense**: {doc['note']}.", ""]
        elif rec is None:
            out.append("No setting stayed within the tolerance: the written file runs every layer dense.")
        else:
            out.append(f"**{rec['name']}** ({rec['kind']}): {cost_text(rec)} at L={lengths[-1]}; worst "
                       f"top-1 {_fmt(rec['worst_drop'], 'pt')}; NLL {_fmt(rec['worst_nll'], '%')} on the "
                       "calibration prompts.")
            out += ["", f"Confirmation: {confirmation_summary(conf)}."]
        out += ["", f"`sparse_prefill.json`: `{json.dumps(doc['config'])}`", "",
                "Use it: `SPARSE_PREFILL_CONFIG=<this folder>/sparse_prefill.json` for the vLLM / SGLang plugins, "
                "or `sparse_prefill.integrations.transformers.register(config_file=...)` (docs/integrations.md). "
                "The adapters still run dense below `min_sparse_kv_len` keys (default 8192) and `min_sparse_q_len` "
                "queries. Selections were measured one prompt at a time as a whole (one-shot prefill); chunked "
                "prefill unions each chunk's selection and was not measured here. The file records "
                f"`validated_lengths` {doc.get('validated_lengths')}: the adapters warn once when a sparse call's "
                f"prompt is more than {LONG_PROMPT_FACTOR:g}x the longest of them.", ""]
    if doc.get("confirmation", {}) and doc["confirmation"].get("results"):
        out += confirmation_table(doc["confirmation"], lengths)
    out += ["## Settings measured", "", "Cost: the density at the longest length plus the index stage's time over "
            "dense attention's (timed per layer on one prompt); a setting is recommended only below 1, the cost of "
            "dense attention.", "",
            "| setting | kind | " + " | ".join(f"density L={L}" for L in lengths)
            + f" | index share L={lengths[-1]} | cost | worst top-1 [95 % CI] | NLL [95 % CI] | within tolerance |",
            "|" + "---|" * (len(lengths) + 7)]
    for r in results:
        ok = "yes" if r.get("passes") else "no"
        if r.get("passes") and not r.get("passes_ci"):
            ok += " (interval crosses)"
        share, cost = r.get("index_share"), r.get("cost")
        out.append(f"| {r['name']} | {r['kind']} | " + " | ".join(_density(r, L) for L in lengths)
                   + (f" | {share:.3f}" if share is not None else " | -")
                   + (f" | {cost:.3f}" if cost is not None else " | -")
                   + f" | {_fmt(r.get('worst_drop'), 'pt')} | {_fmt(r.get('worst_nll'), '%')} | {ok} |")
    if rec is not None:
        out += ["", f"## Per task ({rec['name']})", "", "| L | task | dense | setting | difference [95 % CI] | tokens |",
                "|---|---|---|---|---|---|"]
        for L in lengths:
            for v, t in rec["lengths"][L]["tasks"].items():
                out.append(f"| {L} | {v} | {t['dense']:.4f} | {t['metric']:.4f} | {t['diff']:+.2f} "
                           f"{'pt' if t['unit'] == 'points' else '%'} [{t['low']:+.2f}, {t['high']:+.2f}] | "
                           f"{t['n_tokens']} |")
    probe, names = doc.get("probe") or {}, doc.get("candidates") or {}
    if probe:
        L = lengths[-1]
        oracles = [r for r in results if r["kind"] == "oracle"]
        out += ["", f"## Per layer (density at L={L}; probe: relative error of the layer's attention output against "
                "dense on the same inputs / density)", "",
                "| layer | recommended | density | " + " | ".join(r["name"] for r in oracles)
                + (" | " if oracles else "") + " | ".join(f"probe {n}" for n in names) + " |",
                "|" + "---|" * (3 + len(oracles) + len(names))]
        plan = doc.get("plan") or {}
        for layer in sorted(probe, key=int):
            ld = rec["lengths"][L]["layer_density"] if rec else None
            cells = [str(layer), str(plan.get(str(layer), "dense")),
                     f"{ld[int(layer)]:.3f}" if ld else "1.000"]
            cells += [f"{r['lengths'][L]['layer_density'][int(layer)]:.3f}" for r in oracles]
            cells += [f"{probe[layer][n]['err']:.3g} / {probe[layer][n]['density']:.2f}" if n in probe[layer]
                      else "-" for n in names]
            out.append("| " + " | ".join(cells) + " |")
    if figure:
        out += ["", f"![accuracy and NLL against density; per-layer density]({os.path.basename(figure)})"]
    elif figure_note:
        out += ["", figure_note + "."]
    return "\n".join(out) + "\n"


def confirmation_table(c: dict, lengths) -> List[str]:
    """report.md's confirmation section: each setting measured on the confirmation prompts beside its calibration."""
    out = ["## Confirmation", "",
           f"The choice measured again on a second prompt set: {c['n_prompts']} prompts of the same lengths and "
           f"tasks (prompt seeds '{c['split']} <{c['seed']} * 1000 + j>', {c['filler']}; disjoint from the "
           "calibration's and from any --check --seed's), under the same tolerance. Many settings were compared on the "
           "calibration prompts and the cheapest that passed was kept, which favours settings whose drop there was "
           "luckily small; these prompts took no part in that choice. Where a setting fails here, the next safer "
           f"(denser) passing setting is measured, at most {c['max_confirm']} (--max-confirm; the last the densest "
           "passing one).", "",
           "Prompts per length (scored tokens): " + "; ".join(
               f"L={L}: " + ", ".join(f"{v} {n['prompts']} ({n['tokens']})" for v, n in c["prompts"][str(L)].items())
               for L in lengths), "",
           f"| setting | cost L={lengths[-1]} (calibration / confirmation prompts) | calibration prompts | "
           "confirmation prompts | holds |", "|---|---|---|---|---|"]
    for r in c["results"]:
        cal = c["calibration"].get(r["name"], {})
        dens = f"{cal['cost']:.3f} / {r['cost']:.3f}" if cal.get("cost") is not None else f"{r['cost']:.3f}"
        out.append(f"| {r['name']} | {dens} | {worst_text(cal)} | {worst_text(r)} | "
                   f"{'yes' if r['passes'] else 'no'} |")
    return out + [""]


def reproduction_gap(results: List[dict]) -> Optional[float]:
    """Check mode: the largest |metric difference| between the first two results over tasks and lengths, in points
    of top-1 or % of dense NLL."""
    if len(results) < 2:
        return None
    a, b = results[:2]
    gaps = [abs(ta["diff"] - b["lengths"][L]["tasks"][v]["diff"])
            for L in a["lengths"] for v, ta in a["lengths"][L]["tasks"].items()]
    return max(gaps) if gaps else None


def write(doc: dict, out_dir: str, config) -> dict:
    """Writes the files; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = dict(config=os.path.join(out_dir, "sparse_prefill.json"), data=os.path.join(out_dir, "calibration.json"),
                 report=os.path.join(out_dir, "report.md"))
    if config is not None:
        config.save(paths["config"])
    with open(paths["data"], "w") as f:
        json.dump(doc, f, indent=1, default=str)
    figure = plot(doc, os.path.join(out_dir, "calibration.png"))
    if figure:
        paths["figure"] = figure
    else:
        paths["figure_note"] = NO_FIGURE
    with open(paths["report"], "w") as f:
        f.write(markdown(doc, figure, paths.get("figure_note")))
    return paths

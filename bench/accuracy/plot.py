"""Accuracy frontier plots of issue 13 from its measured JSON files (issue 37's frontier, with intervals and the
oracle, is report.py):
  left   metric vs density at one L (SmolLM2-135M; copy / kv top-1 in points against dense, NLL in % against dense),
         the library's rows (bench/results/accuracy_h200.json) and the emulated estimators
         (accuracy_estimators_emulated_h200.json, accuracy_emulated_h200.json: torch emulation on the H200, NOT the
         library)
  right  copy top-1 against dense vs the 128K topic-workload time of the same selection through the package
         (bench/results/sparse_h200.json: tile energy; sparse_rowmax_h200.json: row max; index + attention, with or
         without correction as the configuration says). Only configurations whose speed was measured appear.
Usage (from bench/): python -m accuracy.plot [--L 8192] [--out results/accuracy_frontier_issue13_h200.png]
"""
import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "results")


def load(name):
    path = os.path.join(RESULTS, name)
    return json.load(open(path)) if os.path.exists(path) else None


def delta(row):
    """Metric against dense: points of top-1 (higher is better), or % of NLL (lower is better, sign flipped so that
    up is better on every panel)."""
    if row["metric_name"] == "nll":
        return -100.0 * (row["metric"] / row["dense_metric"] - 1.0)
    return 100.0 * (row["metric"] - row["dense_metric"])


def topic_time_128k(rule, correction):
    doc = load({"row_max": "sparse_rowmax_h200.json", "probe_row_max": "sparse_probe_h200.json",
                "probe_row_max_per_head": "sparse_probe_s4_h200.json",
                "probe_row_mass_per_head": "sparse_probe_mass_s4_h200.json"}.get(rule, "sparse_h200.json"))
    if doc is None:
        return None
    for r in doc["rows"]:
        if r.get("L") == 131072:
            return r["index_ms"] + (r["attn_ms"] if correction else r["attn_no_corr_ms"])
    return None


# The library configurations of run.py's CONFIGS whose rule and correction the topic benchmark measured. "default" is
# the library's default at the commit that measured the rows: FlashPrefill V2's rule with correction before 6d7d020
# (issue 13 switched it to row max without correction), row max after.
SWITCH = "6d7d020"
SPEED_OF = {"rowmax_a01": ("row_max", False), "probe": ("probe_row_max", False), "fpv2": ("tile_energy", True), "fpv2_nocorr": ("tile_energy", False),
            "default_nocorr": ("tile_energy", False),
            # one selection per query head: SmolLM2 head_subgroups 3 = g; the topic workload's g is 4
            "sp:rule=probe_row_max;head_subgroups=3": ("probe_row_max_per_head", False),
            # measured at alpha 0.05 (bench_sparse --rule probe_row_mass --alpha 0.05 --mean-alpha 0.8)
            "sp:rule=probe_row_mass;mean_alpha=0.8;head_subgroups=3;alpha=0.05": ("probe_row_mass_per_head", False)}


def default_at(commit):
    import subprocess
    try:
        older = subprocess.run(["git", "merge-base", "--is-ancestor", commit, SWITCH], cwd=HERE,
                               capture_output=True).returncode == 0
        same = subprocess.run(["git", "rev-parse", "--short=7", commit], cwd=HERE, capture_output=True,
                              text=True).stdout.strip() == SWITCH
    except OSError:
        older = same = False
    return ("tile_energy", True) if older and not same else ("row_max", False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=8192)
    ap.add_argument("--out", default=os.path.join(RESULTS, "accuracy_frontier_issue13_h200.png"))
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lib = load("accuracy_h200.json")   # the latest run; older configurations from accuracy_h200_bcd9995.json
    old = load("accuracy_h200_bcd9995.json")
    mass = load("accuracy_probe_mass_h200.json")  # rule='probe_row_mass' on CUDA, 4K / 8K (4c14eff)
    emu = [d for d in (load("accuracy_estimators_emulated_h200.json"), load("accuracy_emulated_h200.json"),
                       load("accuracy_probe_mass_emulated_h200.json")) if d]
    tasks = ["copy", "kv", "ppl"]
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(6 * (len(tasks) + 1), 5))
    for ax, task in zip(axes, tasks):
        for doc, marker, what in ([(lib, "o", "library"), (old, "s", "library"), (mass, "^", "library")] +
                                  [(d, "x", "emulated") for d in emu]):
            if doc is None:
                continue
            for r in doc["rows"]:
                if r["task"] != task or r["L"] != args.L or r["config"] == "dense" or r.get("chunk"):
                    continue
                ax.scatter(r["density"], delta(r), marker=marker, c="C0" if what == "library" else "C1")
                ax.annotate(r["config"][:28], (r["density"], delta(r)), fontsize=6)
        ax.axhline(0, c="k", lw=0.5)
        ax.axhline(-1 if task != "ppl" else -0.5, c="r", lw=0.5, ls="--")
        ax.axvline(0.42, c="r", lw=0.5, ls="--")
        ax.set_xlabel("density (kept / visible blocks)")
        ax.set_ylabel("points vs dense" if task != "ppl" else "-% NLL vs dense")
        ax.set_title(f"SmolLM2 {task} L={args.L} (o library, s @bcd9995, ^ probe_row_mass, x emulated)",
                     fontsize=9)
    ax = axes[-1]
    for doc in (d for d in (lib, old, mass) if d is not None):
        speed_of = dict(SPEED_OF, default=default_at(doc.get("commit", "HEAD")))
        for r in doc["rows"]:
            if r["task"] != "copy" or r["L"] != args.L or r["config"] not in speed_of or r.get("chunk"):
                continue
            t = topic_time_128k(*speed_of[r["config"]])
            if t is not None:
                ax.scatter(t, delta(r), c="C0")
                ax.annotate(r["config"][:40] + ("" if doc is not old else " @bcd9995"), (t, delta(r)), fontsize=7)
    ax.axhline(0, c="k", lw=0.5)
    ax.set_xscale("log")   # the CUDA-core probe kernel is ~100x the others
    ax.set_xlabel("topic workload 128K: index + attention (ms, H200, log)")
    ax.set_ylabel("copy top-1, points vs dense")
    ax.set_title(f"accuracy vs time (copy L={args.L})")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()

"""Merge H200 accuracy runs of different commits into one results document, keeping each row's numbers as measured.

A run's `default` rows are the library default *of its commit*: when runs of commits with different defaults are
merged, the earlier default is renamed to the library keywords it stood for (the run's own `selection_defaults`
record them), so `default` means one configuration in the merged file. Rows an earlier run shares with the latest
(dense, the oracles: the same computation on the same prompts) are taken from the latest run only.

    python -m accuracy.merge_runs LATEST.json [EARLIER.json ...] --out results/accuracy_h200.json \\
        [--png results/accuracy_frontier_h200.png --summary results/accuracy_frontier_h200.md]
(from bench/). Renamed rows carry `renamed_from` and `default_of_commit`.
"""
import argparse
import json

from accuracy import report

DEFAULT_KEYS = ("alpha", "rule", "head_subgroups", "dense_fraction", "mean_alpha", "key_rank", "block_size", "sink",
                "window", "last_n", "correction")


def keywords(defaults, latest_defaults):
    """The 'sp:k=v;...' name of an earlier default: the keywords in which it differs from the latest default."""
    diff = [f"{k}={defaults[k]}" for k in DEFAULT_KEYS if k in defaults and defaults.get(k) != latest_defaults.get(k)]
    return "sp:" + ";".join(diff) if diff else "default"


def _key(r):
    return (r.get("model"), r.get("task"), r.get("layout"), r.get("format"), r.get("L"), r.get("chunk"), r["config"])


def merge(paths):
    docs = report.load(paths)
    latest = docs[0]
    # a run without its own record of the defaults (the retrieval runs) takes that of a run of the same commit
    by_commit = {d.get("commit"): d["selection_defaults"] for d in docs if d.get("selection_defaults")}
    latest_keys = {_key(r) for r in latest["rows"]}
    for d in docs[1:]:
        defaults = d.get("selection_defaults") or by_commit.get(d.get("commit"), {})
        name = keywords(defaults, latest.get("selection_defaults", {}))
        kept = []
        for r in d["rows"]:
            if r["config"] == "default" and name != "default":
                r = dict(r, config=name, renamed_from="default", default_of_commit=r.get("commit", d.get("commit")))
            if _key(r) in latest_keys:
                continue  # the same row (dense, an oracle) measured by the latest run: its
            kept.append(r)
        d["rows"] = kept
    return report.merge(docs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="the latest run first")
    ap.add_argument("--out", required=True)
    ap.add_argument("--png", default=None)
    ap.add_argument("--summary", default=None)
    args = ap.parse_args(argv)
    doc = merge(args.inputs)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{args.out}: {len(doc['rows'])} rows from {len(args.inputs)} runs")
    if args.png or args.summary:
        report.main([args.out] + (["--png", args.png] if args.png else []) +
                    (["--summary", args.summary] if args.summary else []) + ["--summary-json", ""])


if __name__ == "__main__":
    main()

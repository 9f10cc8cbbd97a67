"""Paired bootstrap intervals of a configuration's metric minus dense's on the same scored tokens.

Both runs score the same tokens of the same prompts, so the difference is estimated on pairs: each bootstrap
replicate draws units (with replacement) and recomputes mean(config) - mean(dense) over the drawn units' tokens, the
same draw for both (resampling the per-unit sums of the differences is exactly that). The unit (`unit`):
  'cluster' (default) the task's clusters (tasks.CLUSTERS): one question's answer tokens for kv, 128 consecutive
            scored positions for copy / ppl, one query's value tokens for the retrieval model. Tokens inside a
            cluster are not independent - a fact is found or missed as a whole, a dropped source block fails a run
            of copied tokens - so resampling single tokens would understate the spread; whole prompts would be the
            safest unit but there are only 2-8 per task, too few for a bootstrap.
  'prompt'  whole prompts (or sequences);
  'token'   single tokens (for comparison: the narrowest interval).
The interval is the percentile interval (2.5 %, 97.5 %) of n_boot replicates of the ratio estimator
sum(diff) / sum(count); the generator is seeded, so an interval is reproducible.
"""
import numpy as np

from sparse_prefill.calibrate.stats import bootstrap_difference


def units(clusters, prompt_ids, unit):
    """Unit id per token from the per-token cluster ids (local to their prompt) and prompt ids."""
    c = np.asarray(clusters, np.int64)
    p = np.asarray(prompt_ids, np.int64)
    if unit == "token":
        return np.arange(len(c))
    if unit == "prompt":
        return p
    if unit == "cluster":
        return p * (int(c.max()) + 1 if len(c) else 1) + c
    raise ValueError(f"bootstrap unit {unit!r}: token, cluster or prompt")


def paired_bootstrap(dense, config, unit_ids, n_boot=2000, seed=0, level=0.95, batch=256):
    """(mean(config) - mean(dense), low, high) over the scored tokens; dense, config: per-token outcomes (same
    tokens, same order); unit_ids: the resampling unit of each token. The package's bootstrap (the calibration
    command's), so both report the same interval for the same draws."""
    d = np.asarray(config, np.float64) - np.asarray(dense, np.float64)
    if d.shape != np.shape(unit_ids) or d.ndim != 1 or not len(d):
        raise ValueError("paired_bootstrap: dense, config and unit_ids must be 1-D of one length > 0")
    return bootstrap_difference(d, unit_ids, n_boot=n_boot, seed=seed, level=level, batch=batch)


def compare(dense_parts, config_parts, clusters_parts, unit="cluster", n_boot=2000, seed=0):
    """Per-prompt outcome arrays (lists, one entry per prompt) -> dict(metric, dense_metric, diff, ci_low, ci_high,
    n_tokens, n_units)."""
    dense = np.concatenate(dense_parts)
    cfg = np.concatenate(config_parts)
    clusters = np.concatenate(clusters_parts)
    prompt = np.concatenate([np.full(len(x), i) for i, x in enumerate(dense_parts)])
    u = units(clusters, prompt, unit)
    diff, lo, hi = paired_bootstrap(dense, cfg, u, n_boot=n_boot, seed=seed)
    return dict(metric=float(cfg.mean()), dense_metric=float(dense.mean()), diff=diff, ci_low=lo, ci_high=hi,
                n_tokens=int(len(cfg)), n_units=int(len(np.unique(u))))


def with_relative(row):
    """NLL rows: the difference and its interval also in % of dense's NLL (rel_pct, ci_low_pct, ci_high_pct)."""
    dm = row["dense_metric"]
    if dm:
        for k, kk in (("diff", "rel_pct"), ("ci_low", "ci_low_pct"), ("ci_high", "ci_high_pct")):
            row[kk] = 100.0 * row[k] / dm
    return row

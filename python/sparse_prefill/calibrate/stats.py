"""Paired bootstrap intervals of a setting's metric minus dense's on the same scored tokens.

Both runs score the same tokens, so the difference is estimated on pairs: a replicate draws clusters with
replacement and recomputes mean(setting) - mean(dense) over their tokens, the same draw for both. The cluster is the
unit because tokens inside it fail together (a kv question's answer tokens; 128 consecutive copied or NLL-scored
positions): resampling single tokens would understate the spread.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np


def paired_bootstrap(dense: Sequence[np.ndarray], setting: Sequence[np.ndarray], clusters: Sequence[np.ndarray],
                     n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> Tuple[float, float, float]:
    """(mean difference, low, high) of setting - dense over every scored token of the prompts.

    Args:
        dense, setting: per prompt, the per-token outcomes (1/0 hits or NLLs) of dense attention and of the setting.
        clusters: per prompt, the cluster id of each scored token (local to the prompt).
        n_boot: bootstrap replicates; seed: their generator's seed (an interval is reproducible); level: coverage.
    """
    d = np.concatenate([np.asarray(s, np.float64) - np.asarray(r, np.float64) for r, s in zip(dense, setting)])
    unit = np.concatenate([np.asarray(c, np.int64) * len(dense) + i for i, c in enumerate(clusters)])
    if d.shape != unit.shape or not len(d):
        raise ValueError("paired_bootstrap: dense, setting and clusters must hold one entry per scored token")
    return bootstrap_difference(d, unit, n_boot, seed, level)


def bootstrap_difference(d: np.ndarray, unit_ids: np.ndarray, n_boot: int = 1000, seed: int = 0,
                         level: float = 0.95, batch: int = 256) -> Tuple[float, float, float]:
    """(mean(d), low, high): the percentile interval of n_boot replicates that draw units with replacement and
    recompute sum(d) / count over their tokens. d: per-token differences (1-D); unit_ids: each token's unit."""
    _, inv = np.unique(np.asarray(unit_ids), return_inverse=True)
    sums, counts = np.bincount(inv, weights=d), np.bincount(inv).astype(np.float64)
    est = float(d.mean())
    if len(sums) == 1:
        return est, est, est
    rng = np.random.default_rng(seed)
    reps = []
    for b0 in range(0, n_boot, batch):        # batches bound the index matrix (batch x units)
        idx = rng.integers(0, len(sums), size=(min(batch, n_boot - b0), len(sums)))
        reps.append(sums[idx].sum(1) / counts[idx].sum(1))
    lo, hi = np.quantile(np.concatenate(reps), [(1 - level) / 2, (1 + level) / 2])
    return est, float(lo), float(hi)

"""bench/accuracy/stats.py: the paired bootstrap interval of a configuration's metric minus dense's, on cases whose
answer is known (no torch needed)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from accuracy import stats  # noqa: E402


def test_identical_and_shifted():
    rng = np.random.default_rng(0)
    d = rng.normal(2.0, 1.0, 500)
    u = np.arange(500) // 5
    assert stats.paired_bootstrap(d, d, u) == (0.0, 0.0, 0.0)
    est, lo, hi = stats.paired_bootstrap(d, d + 0.25, u)  # a constant shift: every replicate is the shift
    assert est == pytest.approx(0.25) and lo == pytest.approx(0.25) and hi == pytest.approx(0.25)


def test_iid_interval_matches_the_normal_approximation():
    """Independent 0/1 outcomes: the interval of the difference has the binomial width and covers the truth."""
    rng = np.random.default_rng(1)
    n = 4000
    dense = (rng.random(n) < 0.9).astype(float)
    cfg = (rng.random(n) < 0.85).astype(float)
    est, lo, hi = stats.paired_bootstrap(dense, cfg, np.arange(n), n_boot=4000, seed=3)
    se = np.sqrt((cfg - dense).var() / n)
    assert lo < est < hi and lo < -0.05 < hi
    assert (hi - lo) == pytest.approx(2 * 1.96 * se, rel=0.12)


def test_pairing_narrows_the_interval():
    """Config = dense with a few tokens flipped: the paired interval is far narrower than the spread of either
    metric alone (an unpaired comparison would see the task's whole variance)."""
    rng = np.random.default_rng(2)
    n = 2000
    dense = (rng.random(n) < 0.5).astype(float)
    cfg = dense.copy()
    flip = rng.choice(n, 20, replace=False)
    cfg[flip] = 1.0 - cfg[flip]
    _, lo, hi = stats.paired_bootstrap(dense, cfg, np.arange(n))
    unpaired_width = 2 * 1.96 * np.sqrt(0.25 / n + 0.25 / n)
    assert (hi - lo) < 0.35 * unpaired_width


def test_clusters_widen_correlated_outcomes():
    """Outcomes that move together inside clusters (a fact found or missed as a whole): resampling single tokens
    understates the spread by ~sqrt(cluster size); the cluster bootstrap does not."""
    rng = np.random.default_rng(4)
    C, m = 200, 6
    miss = rng.random(C) < 0.1
    dense = np.ones(C * m)
    cfg = np.repeat(np.where(miss, 0.0, 1.0), m)
    cl = np.repeat(np.arange(C), m)
    _, lo_t, hi_t = stats.paired_bootstrap(dense, cfg, np.arange(C * m), seed=5)
    _, lo_c, hi_c = stats.paired_bootstrap(dense, cfg, cl, seed=5)
    assert (hi_c - lo_c) == pytest.approx(np.sqrt(m) * (hi_t - lo_t), rel=0.2)
    # unit ids built from per-prompt cluster ids
    u = stats.units(np.array([0, 0, 1, 0, 1]), np.array([0, 0, 0, 1, 1]), "cluster")
    assert len(set(u.tolist())) == 4 and u[0] == u[1] and u[2] != u[3]
    assert len(set(stats.units([0, 0, 1], [0, 0, 0], "token").tolist())) == 3
    assert len(set(stats.units([0, 0, 1], [0, 0, 0], "prompt").tolist())) == 1


def test_seeded_and_checked():
    rng = np.random.default_rng(6)
    a, b = rng.random(300), rng.random(300)
    u = np.arange(300) // 3
    assert stats.paired_bootstrap(a, b, u, seed=9) == stats.paired_bootstrap(a, b, u, seed=9)
    assert stats.paired_bootstrap(a, b, u, seed=9) != stats.paired_bootstrap(a, b, u, seed=10)
    with pytest.raises(ValueError):
        stats.paired_bootstrap(a, b[:-1], u)


def test_compare_and_relative():
    d = [np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0])]
    c = [np.array([1.5, 2.5, 3.5]), np.array([2.5, 2.5])]
    r = stats.compare(d, c, [np.array([0, 0, 1]), np.array([0, 1])])
    assert r["metric"] == pytest.approx(2.5) and r["dense_metric"] == pytest.approx(2.0)
    assert r["diff"] == pytest.approx(0.5) and r["ci_low"] == pytest.approx(0.5) and r["ci_high"] == pytest.approx(0.5)
    assert r["n_tokens"] == 5 and r["n_units"] == 4
    stats.with_relative(r)
    assert r["rel_pct"] == pytest.approx(25.0) and r["ci_low_pct"] == pytest.approx(25.0)

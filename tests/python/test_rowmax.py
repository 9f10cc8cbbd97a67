"""The per-row selection rule (rule='row_max') through the Python API on the CPU reference, against sp_naive.select
(an independent float64 implementation of both rules): varlen, GQA, paged, head sub-groups, union mode, chunks;
alpha = 0 equals dense; the keyword's validation."""

import numpy as np
import pytest

import sparse_prefill as sp
import sp_naive as naive
from conftest import MECHANICS, to_paged
from conftest import topic_batch as conftest_topic_batch

BS = 64


def batch(q_lens, k_lens, hq=4, hkv=2, seed=0):
    return conftest_topic_batch(q_lens, k_lens, hq, hkv, 64, seed, block=BS)


def lists(index):
    h = index.host
    return [h["block_ids"][a:e].tolist() for a, e in zip(h["segment_start"], h["segment_end"])]


def compare(index, want):
    got = lists(index)
    assert len(got) == len(want)
    flips = 0
    for s, (g, (w, ties)) in enumerate(zip(got, want)):
        diff = set(g) ^ set(w)
        assert diff <= ties, (s, sorted(diff - ties), g, w)
        flips += len(diff)
    return flips


CASES = [
    ([700, 130, 64], [700, 600, 64], 4, 2),   # varlen, a chunk, GQA 2
    ([333], [900], 6, 2),                     # g = 3: positions straddle tiles
    ([129, 11], [1763, 11], 8, 1),            # GQA 8, a chunk against a long cache
]


@pytest.mark.parametrize("q_lens,k_lens,hq,hkv", CASES)
@pytest.mark.parametrize("alpha", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("rule", ["row_max", "tile_energy"])
def test_selection_matches_naive(q_lens, k_lens, hq, hkv, alpha, rule):
    q, k, v, cu_q, cu_k = batch(q_lens, k_lens, hq, hkv)
    sel = dict(block_size=BS, sink=64, window=64, last_n=1)
    index = sp.build_index(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), alpha=alpha, rule=rule, **sel, **MECHANICS)
    compare(index, naive.select(q, k, cu_q, cu_k, alpha, rule=rule, **sel))
    if rule == "row_max" and alpha > 0.05:
        assert index.density < 1


def test_row_max_differs_from_tile_energy_and_keeps_more():
    q, k, v, cu_q, cu_k = batch([1500], [1500], 4, 1)
    a = sp.build_index(q, k, v, cu_q, cu_k, 1500, 1500, alpha=0.3, block_size=BS, sink=0, window=0, last_n=0,
                       rule="tile_energy", **MECHANICS)
    r = sp.build_index(q, k, v, cu_q, cu_k, 1500, 1500, alpha=0.3, block_size=BS, sink=0, window=0, last_n=0,
                       rule="row_max", **MECHANICS)
    assert lists(a) != lists(r) and r.density < 1


@pytest.mark.parametrize("S", [2, 4])
@pytest.mark.parametrize("union", [False, True])
def test_head_subgroups_and_union(S, union):
    q_lens, k_lens = [300, 129], [900, 129]
    q, k, v, cu_q, cu_k = batch(q_lens, k_lens, 8, 2)
    sel = dict(block_size=BS, sink=64, window=64, last_n=1)
    index = sp.build_index(q, k, v, cu_q, cu_k, 300, 900, alpha=0.2, rule="row_max", head_subgroups=S,
                           union=union, dense_fraction=1.0, **sel)
    want = naive.select(q, k, cu_q, cu_k, 0.2, rule="row_max", head_subgroups=S, **sel)
    if not union:
        compare(index, want)
        return
    tiles = sp.build_index(q, k, v, cu_q, cu_k, 300, 900, alpha=0.2, rule="row_max", head_subgroups=S,
                           dense_fraction=1.0, **sel)
    flips = compare(tiles, want)
    assert lists(index) == lists(sp.union_index(tiles, q, k, v, cu_q, cu_k, 300, 900))
    if flips == 0:  # the union per (sequence, sub-group) of naive's lists
        seg, got = 0, lists(index)
        for b, (lq, lk) in enumerate(zip(q_lens, k_lens)):
            tiles_b = (lq * (8 // 2 // S) + 127) // 128
            for vh in range(2 * S):
                u = sorted(set().union(*[set(want[seg + vh * tiles_b + t][0]) for t in range(tiles_b)]))
                for t in range(tiles_b):
                    assert got[seg + vh * tiles_b + t] == u
            seg += 2 * S * tiles_b


def test_chunked_prefill_paged_matches_contiguous_and_naive():
    rng = np.random.default_rng(0)
    L, C = 1000, 256
    q, k, v, cu, _ = batch([L], [L], 4, 2)
    kc, vc, bt, _ = to_paged(rng, k, v, np.array([0, L], np.int32), 16)
    for c0 in range(0, L, C):
        c1 = min(L, c0 + C)
        cu_q, used = np.array([0, c1 - c0], np.int32), np.array([c1], np.int32)
        kw = dict(alpha=0.1, block_size=BS, sink=64, window=64, last_n=1, rule="row_max", correction=False,
                  **MECHANICS)
        got = sp.chunked_prefill(q[c0:c1], kc, vc, cu_q, bt, used, c1 - c0, c1, final_chunk=c1 == L, **kw)
        cu_k = np.array([0, c1], np.int32)
        idx = sp.build_index(q[c0:c1], k[:c1], v[:c1], cu_q, cu_k, c1 - c0, c1, final_chunk=c1 == L, **kw)
        compare(idx, naive.select(q[c0:c1], k[:c1], cu_q, cu_k, 0.1, BS, 64, 64, 1, "row_max",
                                  final_chunk=c1 == L))
        want = sp.sparse_attention(q[c0:c1], k[:c1], v[:c1], idx, cu_q, cu_k, c1 - c0, c1)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_alpha_zero_is_dense():
    q, k, v, cu_q, cu_k = batch([700, 130], [700, 600], 4, 2)
    index = sp.build_index(q, k, v, cu_q, cu_k, 700, 700, alpha=0.0, block_size=BS, rule="row_max", **MECHANICS)
    assert index.kept_blocks == index.visible_blocks
    out = sp.sparse_prefill(q, k, v, cu_q, cu_k, 700, 700, alpha=0.0, block_size=BS, rule="row_max")
    dense = sp.attention(q, k, v, cu_q, cu_k, 700, 700)
    np.testing.assert_allclose(out, dense, rtol=1e-5, atol=1e-6)


def test_bad_rule_is_a_value_error():
    q, k, v, cu_q, cu_k = batch([100], [100], 4, 2)
    for bad in ("rowmax", 1, None):
        with pytest.raises(ValueError, match="rule"):
            sp.build_index(q, k, v, cu_q, cu_k, 100, 100, rule=bad)
        with pytest.raises(ValueError, match="rule"):
            sp.sparse_prefill(q, k, v, cu_q, cu_k, 100, 100, rule=bad)


# rule='probe_row_max' (CPU reference; its exact agreement with the torch emulator: test_accuracy_emulator.py)

def test_probe_rule_alpha_zero_is_dense():
    q, k, v, cu_q, cu_k = batch([700, 130], [700, 600], 4, 2)
    out = sp.sparse_prefill(q, k, v, cu_q, cu_k, 700, 700, alpha=0.0, block_size=BS, rule="probe_row_max")
    np.testing.assert_allclose(out, sp.attention(q, k, v, cu_q, cu_k, 700, 700), rtol=1e-5, atol=1e-6)


def strong_key_case():
    """Blocks of 64 keys with offsets along w (block 5 the lowest, 9 the highest) and one key of block 5 matching the
    last query along u: (q, k, v, cu, L, nb)."""
    rng = np.random.default_rng(3)
    L, hq, hkv, D = 1024, 2, 1, 64
    u, w = np.linalg.qr(rng.standard_normal((D, 2)))[0].T.astype(np.float32)  # orthonormal directions
    nb = L // BS
    c = rng.uniform(-10, 10, nb).astype(np.float32)
    c[5], c[9] = -10, 10
    k = (0.1 * rng.standard_normal((L, hkv, D))).astype(np.float32) + np.repeat(c, BS)[:, None, None] * w
    q = (0.1 * rng.standard_normal((L, hq, D))).astype(np.float32) + 3 * w
    v = rng.standard_normal((L, hkv, D)).astype(np.float32)
    q[L - 1] += 8 * u                    # the last query: always a probe row
    k[5 * BS + 17, 0] = 12 * u           # one key of block 5, far from the last tile's window
    return q, k, v, np.array([0, L], np.int32), L, nb


def test_probe_rule_sees_the_one_strong_key_pooled_means_dilute():
    """Blocks carry offsets along a direction w that every query shares, so the pooled means rank them sharply; block
    5 has the lowest offset but holds one key that matches the last query (a probe row) along u: that key dominates
    the row's softmax, yet its pooled mean dilutes it 64x. row_max drops block 5, probe_row_max keeps it."""
    q, k, v, cu, L, nb = strong_key_case()
    sel = dict(alpha=0.1, block_size=BS, sink=0, window=64, last_n=0, **MECHANICS)
    probe = sp.build_index(q, k, v, cu, cu, L, L, rule="probe_row_max", **sel)
    mean = sp.build_index(q, k, v, cu, cu, L, L, rule="row_max", **sel)
    last = probe.num_segments - 1        # the tile of query L - 1 (one sequence, one KV head)
    kept_probe, kept_mean = set(probe.segment(0, 0, last).tolist()), set(mean.segment(0, 0, last).tolist())
    assert 5 in kept_probe and 5 not in kept_mean, (kept_probe, kept_mean)
    union_term = sp.build_index(q, k, v, cu, cu, L, L, rule="row_max", **dict(sel, alpha=0.5))
    assert set(union_term.segment(0, 0, last).tolist()) <= kept_probe and len(kept_probe) < nb  # still sparse


def test_probe_rule_mean_alpha_is_its_pooled_means_term():
    """mean_alpha sets the pooled-means row-max term of probe_row_max: each selection holds row_max at mean_alpha
    (sink, window and tail included), a higher mean_alpha keeps a subset, 0 keeps every visible block, and the
    default is 0.5. The probe rows' own blocks do not depend on it."""
    q, k, v, cu_q, cu_k = batch([700, 130, 64], [700, 600, 64], 4, 2, seed=5)
    sel = dict(alpha=0.2, block_size=BS, sink=64, window=64, last_n=1, **MECHANICS)
    assert sp.SELECTION_DEFAULTS["mean_alpha"] == 0.5
    default = lists(sp.build_index(q, k, v, cu_q, cu_k, 700, 700, rule="probe_row_max", **sel))
    assert default == lists(sp.build_index(q, k, v, cu_q, cu_k, 700, 700, rule="probe_row_max", mean_alpha=0.5,
                                           **sel))
    prev = None
    for m in (0.0, 0.3, 0.5, 0.8, 0.95, 1.0):
        got = lists(sp.build_index(q, k, v, cu_q, cu_k, 700, 700, rule="probe_row_max", mean_alpha=m, **sel))
        mean = lists(sp.build_index(q, k, v, cu_q, cu_k, 700, 700, rule="row_max", **dict(sel, alpha=m)))
        assert all(set(a) <= set(b) for a, b in zip(mean, got)), m
        if prev is not None:
            assert all(set(a) <= set(b) for a, b in zip(got, prev)), m   # monotone in mean_alpha
        prev = got
    dense = sp.build_index(q, k, v, cu_q, cu_k, 700, 700, rule="probe_row_max", mean_alpha=0.0, **sel)
    assert dense.kept_blocks == dense.visible_blocks
    sparse = sp.build_index(q, k, v, cu_q, cu_k, 700, 700, rule="probe_row_max", mean_alpha=0.95, **sel)
    assert sparse.kept_blocks < sp.build_index(q, k, v, cu_q, cu_k, 700, 700, rule="probe_row_max", **sel).kept_blocks
    # the attention follows the index it builds
    out = sp.sparse_prefill(q, k, v, cu_q, cu_k, 700, 700, rule="probe_row_max", mean_alpha=0.95, **sel)
    want = sp.sparse_attention(q, k, v, sparse, cu_q, cu_k, 700, 700)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_probe_rule_keeps_the_strong_key_block_at_any_mean_alpha():
    """The probe term alone finds the one strong key (test above): at mean_alpha 1 (each row's top pooled block
    only) block 5 stays in the last tile's list."""
    q, k, v, cu, L, _ = strong_key_case()
    sel = dict(alpha=0.1, block_size=BS, sink=0, window=64, last_n=0, **MECHANICS)
    for m in (0.5, 1.0):
        idx = sp.build_index(q, k, v, cu, cu, L, L, rule="probe_row_max", mean_alpha=m, **sel)
        assert 5 in set(idx.segment(0, 0, idx.num_segments - 1).tolist()), m


# rule='probe_row_mass': the probe rows' test against the row's whole mass (CPU reference; the emulator's
# score='probe', agg='rowmass' keeps the same blocks: test_accuracy_emulator.py)

def test_probe_row_mass_alpha_zero_is_dense_and_keeps_the_strong_key():
    q, k, v, cu_q, cu_k = batch([700, 130], [700, 600], 4, 2)
    out = sp.sparse_prefill(q, k, v, cu_q, cu_k, 700, 700, alpha=0.0, mean_alpha=0.0, block_size=BS,
                            rule="probe_row_mass")
    np.testing.assert_allclose(out, sp.attention(q, k, v, cu_q, cu_k, 700, 700), rtol=1e-5, atol=1e-6)
    q, k, v, cu, L, nb = strong_key_case()
    idx = sp.build_index(q, k, v, cu, cu, L, L, rule="probe_row_mass", alpha=0.05, mean_alpha=1.0, block_size=BS,
                         sink=0, window=64, last_n=0, **MECHANICS)
    kept = set(idx.segment(0, 0, idx.num_segments - 1).tolist())
    assert 5 in kept and len(kept) < nb, kept


def test_probe_row_mass_drops_the_blocks_of_a_diffuse_row():
    """Keys carry no structure and every query is the same small vector, so each row's attention is spread evenly
    over its blocks (and the pooled-means term keeps one top block per tile, the same for all rows): probe_row_max
    keeps every block within a factor alpha of a row's top block, i.e. nearly all, while probe_row_mass keeps a
    block only if it holds alpha of a probe row's mass, which no block of a row seeing more than 1 / alpha does."""
    rng = np.random.default_rng(7)
    L, hq, hkv, D = 1024, 2, 1, 64
    q = np.ascontiguousarray(np.broadcast_to(0.05 * rng.standard_normal((1, hq, D)), (L, hq, D)), np.float32)
    k = (0.05 * rng.standard_normal((L, hkv, D))).astype(np.float32)
    v = rng.standard_normal((L, hkv, D)).astype(np.float32)
    cu = np.array([0, L], np.int32)
    sel = dict(alpha=0.1, mean_alpha=1.0, block_size=BS, sink=0, window=64, last_n=0, **MECHANICS)
    top = sp.build_index(q, k, v, cu, cu, L, L, rule="probe_row_max", **sel)
    mass = sp.build_index(q, k, v, cu, cu, L, L, rule="probe_row_mass", **sel)
    forced = sp.build_index(q, k, v, cu, cu, L, L, rule="row_max", **dict(sel, alpha=1.0))  # top pooled + window
    last = mass.num_segments - 1  # the last tile's rows see 16 blocks of ~1 / 16 of their mass each: none passes
    assert set(mass.segment(0, 0, last).tolist()) == set(forced.segment(0, 0, last).tolist())
    assert top.density > 0.95 and mass.density < 0.7, (top.density, mass.density)  # measured 1.0 and 0.58

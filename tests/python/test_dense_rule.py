"""The dense rule (dense_fraction) and the per-query-head default (head_subgroups 0) through the Python API on the
CPU reference: the defaults, argument errors naming the argument, the rule's effect on the index and on sparse
attention, and union_index() following the fraction the index was built with."""

import math

import numpy as np
import pytest

import sparse_prefill as sp


def _case(L=1500, hq=8, hkv=2, seed=0):
    q, k, v = sp.workload.structured(L, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, seed=seed)
    cu = np.array([0, L], dtype=np.int32)
    return (q, k, v, cu, cu), L


def test_defaults():
    d = sp.SELECTION_DEFAULTS
    assert d["head_subgroups"] == 0 and d["dense_fraction"] == 0.85 and d["rule"] == "row_max"
    assert d["alpha"] == 0.003


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, math.nan])
def test_bad_dense_fraction_names_the_argument(bad):
    args, L = _case(300)
    with pytest.raises(ValueError, match="^dense_fraction"):
        sp.build_index(*args, L, L, dense_fraction=bad)
    with pytest.raises(ValueError, match="^dense_fraction"):
        sp.sparse_prefill(*args, L, L, dense_fraction=bad)
    with pytest.raises(TypeError, match="dense_fraction"):
        sp.build_index(*args, L, L, dense_fraction="high")


def test_bad_head_subgroups_names_the_argument():
    args, L = _case(300)
    with pytest.raises(ValueError, match="^head_subgroups"):
        sp.build_index(*args, L, L, head_subgroups=-1)
    with pytest.raises(ValueError, match="^head_subgroups"):
        sp.build_index(*args, L, L, head_subgroups=3)  # g = 4


def test_rule_fires_at_the_raw_density_and_gives_dense_attention():
    args, L = _case()
    raw = sp.build_index(*args, L, L, alpha=0.2, dense_fraction=1.0)
    assert 0 < raw.density < 1 and raw.binding.dense_fraction == 1.0
    fired = sp.build_index(*args, L, L, alpha=0.2, dense_fraction=raw.density * 0.999)
    assert fired.density == 1.0 and fired.kept_blocks == fired.visible_blocks == raw.visible_blocks
    for s in range(fired.num_segments):  # every segment: its tile's full list 0 .. n - 1
        ids = fired.block_ids[fired.segment_start[s]:fired.segment_end[s]]
        assert np.array_equal(ids, np.arange(len(ids)))
    kept = sp.build_index(*args, L, L, alpha=0.2, dense_fraction=min(1.0, raw.density + 1e-3))
    assert kept.density == raw.density
    for key in ("segment_start", "segment_end", "block_ids"):
        assert np.array_equal(getattr(kept, key), getattr(raw, key))
    dense = sp.attention(*args, L, L)
    sparse = sp.sparse_attention(*args[:3], fired, *args[3:], L, L)
    assert np.abs(np.asarray(sparse) - np.asarray(dense)).max() < 1e-5
    assert np.abs(np.asarray(sp.sparse_attention(*args[:3], raw, *args[3:], L, L)) - np.asarray(dense)).max() > 1e-4


def test_union_index_follows_the_built_fraction():
    args, L = _case(4000, seed=3)
    q, k, v, cu, _ = args
    C = 512
    chunk = (q[-C:], k, v, np.array([0, C], np.int32), cu)
    sel = dict(alpha=0.2, final_chunk=False)  # a mid-prompt chunk: no dense last tiles
    tiles = sp.build_index(*chunk, C, L, dense_fraction=1.0, **sel)
    union = sp.union_index(tiles, *chunk, C, L)
    assert tiles.density < union.density < 1.0
    frac = (tiles.density + union.density) / 2
    tiles = sp.build_index(*chunk, C, L, dense_fraction=frac, **sel)
    assert tiles.density < 1.0 and tiles.binding.dense_fraction == pytest.approx(frac)
    assert sp.union_index(tiles, *chunk, C, L).density == 1.0
    assert sp.build_index(*chunk, C, L, dense_fraction=frac, union=True, **sel).density == 1.0


def test_per_head_default_is_head_subgroups_g():
    args, L = _case(1000)
    a = sp.build_index(*args, L, L)
    b = sp.build_index(*args, L, L, head_subgroups=4)
    assert a.num_subgroups == 4 and a.group_size == 1 and a.num_kv_heads == 8
    for key in ("segment_start", "segment_end", "block_ids"):
        assert np.array_equal(getattr(a, key), getattr(b, key))

"""Issue 19 on the CPU: host validation of every index value, the NaN policy of the selection, the mean cache's block
size, allocation failures named, LaunchOptions(checked=...) and check_errors() without a GPU."""

import numpy as np
import pytest

import sparse_prefill as sp
from conftest import make_varlen, to_paged


def _arg(e):
    return getattr(e.value, "argument", None) or str(e.value).split(":")[0]


def test_cpu_arrays_fully_validated(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [10], [16], d=64)
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, 8, extra_pages=0)
    with pytest.raises(ValueError) as e:  # the example
        sp.attention(q, kc, vc, cu_q, None, 10, 5000, block_table=bt, seqused_k=np.array([5000], np.int32))
    assert _arg(e) == "seqused_k" and "seqused_k[0] = 5000 exceeds the" in str(e.value)
    with pytest.raises(ValueError) as e:
        sp.attention(q, k, v, np.array([0, 11], np.int32), cu_k, 11, 16)
    assert _arg(e) == "cu_seqlens_q"
    bad = bt.copy()
    bad[0, 0] = 99
    with pytest.raises(ValueError) as e:
        sp.attention(q, kc, vc, cu_q, None, 10, 16, block_table=bad, seqused_k=used)
    assert _arg(e) == "block_table"
    with pytest.raises(ValueError) as e:
        sp.attention(q, k, v, cu_q, np.array([0, 17], np.int32), 10, 17)
    assert _arg(e) == "cu_seqlens_k"


def _nan_problem(rng, where):
    q, k, v, cu_q, cu_k = make_varlen(rng, [300, 200], [300, 200], hq=4, hkv=2, d=64)
    if where == "q":
        q[250, 1, 3] = np.nan     # sequence 0, position 250, head 1 (KV head 0)
    else:
        k[120, 1, 0] = np.nan     # sequence 0, key 120, KV head 1
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("rule", ["tile_energy", "row_max", "exact_max"])
def test_nan_scores_keep_every_visible_block(rng, where, rule):
    """docs/semantics.md, NaN policy: a tile with a NaN score keeps every visible block, so sparse attention is NaN
    exactly where dense attention is (and nowhere else)."""
    q, k, v, cu_q, cu_k = _nan_problem(rng, where)
    kw = dict(alpha=0.9, block_size=64, sink=0, window=0, last_n=0, rule=rule, head_subgroups=1, dense_fraction=1.0)
    index = sp.build_index(q, k, v, cu_q, cu_k, 300, 300, **kw)
    g, B = 2, 64
    nan_tiles = 0
    for kvh in range(2):
        for t in range(index.tiles[0]):
            rows = np.arange(t * 128, min(t * 128 + 128, 300 * g))
            pos, heads = rows // g, kvh * g + rows % g
            last_pos = pos.max()
            visible = last_pos // B + 1  # causal, Lq = Lk: blocks 0 .. last_pos / B
            if where == "q":
                has_nan = bool(np.isnan(q[pos, heads]).any())
            else:
                has_nan = kvh == 1 and last_pos >= 120  # the NaN key's block is visible: its mean is NaN
            if has_nan:
                nan_tiles += 1
                assert list(index.segment(0, kvh, t)) == list(range(visible)), (kvh, t)
    assert nan_tiles > 0
    dense = sp.attention(q, k, v, cu_q, cu_k, 300, 300, return_lse=False)
    out = sp.sparse_prefill(q, k, v, cu_q, cu_k, 300, 300, **kw)
    assert np.array_equal(np.isnan(dense), np.isnan(out))
    assert np.isnan(out).any()


def test_mean_cache_of_another_block_size(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [64], [256], hq=4, hkv=2, d=64)
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, 64)
    means = sp.mean_cache(kc, block_size=64)
    assert isinstance(means, sp.MeanCache) and means.block_size == 64
    k_mean, v_mean = means  # still a pair
    assert k_mean.shape == (kc.shape[0], 2, 64)
    with pytest.raises(ValueError) as e:  # page 64: a block-64 and a block-128 cache have the same shape
        sp.chunked_prefill(q, kc, vc, cu_q, bt, used, 64, 256, final_chunk=True, block_size=128, mean_cache=means)
    assert str(e.value).startswith("mean_cache:")
    out = sp.chunked_prefill(q, kc, vc, cu_q, bt, used, 64, 256, final_chunk=True, block_size=64, mean_cache=means)
    assert np.isfinite(out).all()


def test_allocation_failure_names_the_argument():
    with pytest.raises(ValueError) as e:
        sp.workload.structured(10**12, 32, 8, 128)
    assert _arg(e) == "seqlen"
    with pytest.raises(ValueError) as e:
        sp.workload.topic(10**12, 32, 8, 128)
    assert _arg(e) == "seqlen"


def test_launch_options_checked(rng):
    o = sp.LaunchOptions(checked=True)
    assert o.checked and "checked=True" in repr(o)
    with pytest.raises(TypeError):
        sp.LaunchOptions(checked="yes")
    q, k, v, cu_q, cu_k = make_varlen(rng, [20], [20], d=64)
    a = sp.attention(q, k, v, cu_q, cu_k, 20, 20, options=o, return_lse=False)
    b = sp.attention(q, k, v, cu_q, cu_k, 20, 20, return_lse=False)
    assert np.array_equal(a, b)
    with pytest.raises(ValueError) as e:  # CPU arrays are validated whatever the mode
        sp.attention(q, k, v, np.array([0, 21], np.int32), cu_k, 21, 20, options=o)
    assert _arg(e) == "cu_seqlens_q"


def test_check_errors_without_device_errors():
    sp.check_errors()  # CPU-only build or no kernel flagged anything: returns None
    sp.check_errors(stream=0)

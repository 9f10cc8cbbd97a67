"""Head sub-groups (head_subgroups = S) through the Python API: the index and the outputs equal those of the model
whose K/V heads are each repeated S times (np.repeat here, independent of the library); union lists per sub-group;
bad values; the pooled-means cache with S = 2."""

import numpy as np
import pytest

import sparse_prefill as sp
import sp_naive as naive
from conftest import to_paged
from conftest import topic_batch as conftest_topic_batch

BS = 64
SEL = dict(block_size=BS, sink=64, window=64, last_n=1, dense_fraction=1.0)  # the rule off: test_dense_rule.py
HQ, HKV, D = 8, 2, 64          # g = 4: S in {1, 2, 4}
Q_LENS, K_LENS = [201, 67, 0], [451, 130, 33]


def topic_batch(q_lens, k_lens, hq=HQ, hkv=HKV, seed=0):
    """Topic sequences with topic blocks of BS keys, head dim D (conftest.topic_batch)."""
    return conftest_topic_batch(q_lens, k_lens, hq, hkv, D, seed, block=BS)


@pytest.fixture(scope="module")
def batch():
    return topic_batch(Q_LENS, K_LENS, seed=11)


def rep(x, s):
    """K/V (contiguous or paged) with every head repeated s times: virtual head v is head v // s."""
    return np.ascontiguousarray(np.repeat(x, s, axis=-2))


def args(q, k, v, cu_q, cu_k):
    return (q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS))


def assert_same_index(a, b):
    for name in ("block_size", "group_size", "num_kv_heads", "head_dim", "correction", "kept_blocks",
                 "visible_blocks", "mode", "num_segments"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("segment_start", "segment_end", "block_ids", "cu_blocks", "k_mean", "v_mean"):
        np.testing.assert_array_equal(a.host[name], b.host[name], err_msg=name)


@pytest.mark.parametrize("S", [2, 4])
@pytest.mark.parametrize("union", [False, True])
@pytest.mark.parametrize("final_chunk", [True, False])
def test_index_equals_repeated_model(batch, S, union, final_chunk):
    q, k, v, cu_q, cu_k = batch
    kw = dict(SEL, alpha=0.2, union=union, final_chunk=final_chunk)
    idx = sp.build_index(*args(q, k, v, cu_q, cu_k), head_subgroups=S, **kw)
    ref = sp.build_index(*args(q, rep(k, S), rep(v, S), cu_q, cu_k), head_subgroups=1, **kw)
    assert (idx.num_subgroups, ref.num_subgroups) == (S, 1)
    assert (idx.num_kv_heads, idx.group_size) == (HKV * S, HQ // HKV // S)
    assert idx.mode == ("union" if union else "tile")
    assert_same_index(idx, ref)
    assert "num_subgroups=%d" % S in repr(idx)
    # tiles and segments over the virtual heads
    tiles = [(lq * HQ // HKV // S + 127) // 128 for lq in Q_LENS]
    np.testing.assert_array_equal(idx.tiles, tiles)
    assert idx.num_segments == HKV * S * sum(tiles)
    # pooled means: virtual head v holds K/V head v // S's
    one = sp.build_index(*args(q, k, v, cu_q, cu_k), head_subgroups=1, **SEL)
    np.testing.assert_array_equal(idx.k_mean, np.repeat(one.k_mean, S, axis=1))
    assert idx.v_mean is None  # no correction: no V means
    corr = sp.build_index(*args(q, k, v, cu_q, cu_k), head_subgroups=S, **dict(kw, correction=True))
    one = sp.build_index(*args(q, k, v, cu_q, cu_k), head_subgroups=1, **dict(SEL, correction=True))
    np.testing.assert_array_equal(corr.v_mean, np.repeat(one.v_mean, S, axis=1))


def test_paged_index_and_outputs_equal_repeated_model(rng, batch):
    q, k, v, cu_q, cu_k = batch
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, 16)
    pkw = dict(block_table=bt, seqused_k=used)
    paged = (q, kc, vc, cu_q, None, max(Q_LENS), max(K_LENS))
    paged_rep = (q, rep(kc, 2), rep(vc, 2), cu_q, None, max(Q_LENS), max(K_LENS))
    idx = sp.build_index(*paged, alpha=0.2, head_subgroups=2, **SEL, **pkw)
    ref = sp.build_index(*paged_rep, alpha=0.2, head_subgroups=1, **SEL, **pkw)
    assert_same_index(idx, ref)
    out, lse = sp.sparse_attention(q, kc, vc, idx, cu_q, None, max(Q_LENS), max(K_LENS), return_lse=True, **pkw)
    want, want_lse = sp.sparse_attention(*paged_rep[:3], ref, cu_q, None, max(Q_LENS), max(K_LENS),
                                         return_lse=True, **pkw)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    np.testing.assert_array_equal(sp.sparse_prefill(*paged, alpha=0.2, head_subgroups=2, **SEL, **pkw), want)


@pytest.mark.parametrize("correction", [True, False])
@pytest.mark.parametrize("union", [False, True])
def test_sparse_attention_equals_repeated_model(batch, correction, union):
    q, k, v, cu_q, cu_k = batch
    S = 2
    kw = dict(SEL, alpha=0.2, correction=correction, union=union)
    kr, vr = rep(k, S), rep(v, S)
    idx = sp.build_index(*args(q, k, v, cu_q, cu_k), head_subgroups=S, **kw)
    ref = sp.build_index(*args(q, kr, vr, cu_q, cu_k), head_subgroups=1, **kw)
    out, lse = sp.sparse_attention(q, k, v, idx, *args(q, k, v, cu_q, cu_k)[3:], return_lse=True)
    want, want_lse = sp.sparse_attention(q, kr, vr, ref, *args(q, k, v, cu_q, cu_k)[3:], return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    # the float64 naive semantics on the repeated model, over the S index's lists
    ref_out, ref_lse = naive.sparse_attention(q, rep(k, S), rep(v, S), cu_q, cu_k, idx.host, BS, correction)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-4, rtol=0)
    one_call = sp.sparse_prefill(*args(q, k, v, cu_q, cu_k), head_subgroups=S, **kw)
    np.testing.assert_array_equal(one_call, out)
    o, i2 = sp.sparse_prefill(*args(q, k, v, cu_q, cu_k), head_subgroups=S, return_index=True, **kw)
    assert i2.num_subgroups == S
    np.testing.assert_array_equal(o, out)


@pytest.mark.parametrize("S", [2, 4])
def test_alpha_zero_is_dense(batch, S):
    q, k, v, cu_q, cu_k = batch
    dense, dense_lse = sp.attention(*args(q, k, v, cu_q, cu_k), return_lse=True)
    for union in (False, True):
        idx = sp.build_index(*args(q, k, v, cu_q, cu_k), alpha=0.0, head_subgroups=S, union=union, **SEL)
        assert idx.density == 1.0
        out, lse = sp.sparse_attention(q, k, v, idx, *args(q, k, v, cu_q, cu_k)[3:], return_lse=True)
        np.testing.assert_allclose(out, dense, atol=1e-5, rtol=0)
        np.testing.assert_allclose(lse, dense_lse, atol=1e-5, rtol=0)


def _unions_of_tiles(index):
    """{(b, virtual head): union of that head's tile lists}."""
    out = {}
    for b in range(index.batch):
        for h in range(index.num_kv_heads):
            out[b, h] = set()
            for t in range(int(index.tiles[b])):
                out[b, h].update(index.segment(b, h, t).tolist())
    return out


CHUNK_Q, CHUNK_K = [130, 67], [1501, 701]   # chunks at the end of long caches: unions that stay sparse
CHUNK_SEL = dict(block_size=BS, sink=0, window=64, last_n=0, alpha=0.3)


@pytest.fixture(scope="module")
def chunks():
    q, k, v, cu_q, cu_k = topic_batch(CHUNK_Q, CHUNK_K, seed=23)
    return q, k, v, cu_q, cu_k, max(CHUNK_Q), max(CHUNK_K)


@pytest.mark.parametrize("S", [2, 4])
def test_union_is_per_subgroup(chunks, S):
    tiles = sp.build_index(*chunks, head_subgroups=S, **CHUNK_SEL)
    u = sp.build_index(*chunks, head_subgroups=S, union=True, **CHUNK_SEL)
    u2 = sp.union_index(tiles, *chunks)
    assert u2.num_subgroups == S
    assert_same_index(u, u2)
    assert u.kept_blocks < u.visible_blocks and u.kept_blocks > tiles.kept_blocks  # the test is not trivial
    want = _unions_of_tiles(tiles)
    for b in range(u.batch):
        for h in range(u.num_kv_heads):
            spans = {(int(u.segment_start[s]), int(u.segment_end[s]))
                     for s in (u.segment_id(b, h, t) for t in range(int(u.tiles[b])))}
            assert len(spans) <= 1, "the tiles of a sub-group share one list"
            for t in range(int(u.tiles[b])):
                assert set(u.segment(b, h, t).tolist()) == want[b, h], (b, h, t)


def test_union_with_S_equal_g_is_per_query_head(chunks):
    q, k, v, cu_q, cu_k = chunks[:5]
    g = HQ // HKV
    tiles = sp.build_index(*chunks, head_subgroups=g, **CHUNK_SEL)
    u = sp.build_index(*chunks, head_subgroups=g, union=True, **CHUNK_SEL)
    assert (u.num_kv_heads, u.group_size) == (HQ, 1)
    np.testing.assert_array_equal(u.tiles, [(lq + 127) // 128 for lq in CHUNK_Q])  # 128 positions of one head
    assert u.kept_blocks < u.visible_blocks
    want = _unions_of_tiles(tiles)
    for b in range(u.batch):
        for h in range(HQ):                  # virtual head h = query head h
            for t in range(int(u.tiles[b])):
                assert set(u.segment(b, h, t).tolist()) == want[b, h]
    # and equals the model with one KV head per query head
    ref = sp.build_index(q, rep(k, g), rep(v, g), *chunks[3:], union=True, head_subgroups=1, **CHUNK_SEL)
    assert_same_index(u, ref)


SUB_ERRORS = [(-2, ValueError), (-1, ValueError), (3, ValueError), (8, ValueError), (2.0, TypeError),
              (True, TypeError), ("2", TypeError)]


@pytest.mark.parametrize("S,exc", SUB_ERRORS)
def test_bad_head_subgroups(batch, rng, S, exc):
    q, k, v, cu_q, cu_k = batch
    for call in (lambda: sp.build_index(*args(q, k, v, cu_q, cu_k), head_subgroups=S, **SEL),
                 lambda: sp.sparse_prefill(*args(q, k, v, cu_q, cu_k), head_subgroups=S, **SEL),
                 lambda: sp.sparse_prefill(*args(q, k, v, cu_q, cu_k), head_subgroups=S, return_index=True, **SEL)):
        with pytest.raises(exc) as e:
            call()
        assert str(e.value).startswith("head_subgroups"), str(e.value)
        assert getattr(e.value, "argument", "head_subgroups") == "head_subgroups"
    q1, k1, v1, cq, ck = topic_batch([100], [300])
    kc, vc, bt, used = to_paged(rng, k1, v1, ck, 64)
    for means in (None, sp.mean_cache(kc, block_size=BS)):
        with pytest.raises(exc, match="^head_subgroups"):
            sp.chunked_prefill(q1, kc, vc, cq, bt, used, 100, 300, final_chunk=True, head_subgroups=S,
                               mean_cache=means, **SEL)


def test_index_view_with_mismatched_head_subgroups(batch):
    q, k, v, cu_q, cu_k = batch
    a = args(q, k, v, cu_q, cu_k)
    idx = sp.build_index(*a, head_subgroups=2, correction=True, **SEL)  # correction: the means are read
    idx.num_subgroups = 1                       # segments laid out for 2 sub-groups
    with pytest.raises(ValueError, match="^index.segment_start") as e:
        sp.sparse_attention(q, k, v, idx, *a[3:])
    assert e.value.argument == "index.segment_start"
    for bad in (0, 3):
        idx.num_subgroups = bad
        with pytest.raises(ValueError, match="^index.num_subgroups") as e:
            sp.sparse_attention(q, k, v, idx, *a[3:])
        assert e.value.argument == "index.num_subgroups"
        with pytest.raises(ValueError, match="^index.num_subgroups"):
            sp.union_index(idx, *a)
    idx.num_subgroups = 2
    idx.k_mean = np.ascontiguousarray(idx.k_mean[:, ::2])   # the real heads' means: Hkv rows, not Hkv * S
    with pytest.raises(ValueError, match="^index.k_mean") as e:
        sp.sparse_attention(q, k, v, idx, *a[3:])
    assert "num_subgroups = 2" in str(e.value)


@pytest.mark.parametrize("page,block", [(16, 64), (128, 64)])
def test_chunked_prefill_mean_cache_with_subgroups(rng, page, block):
    """A prompt in chunks over one paged cache with a pooled-means cache and head_subgroups = 2: outputs equal the
    steps without the cache; the cache holds the real KV heads' means (pool_kv's)."""
    L, C = 777, 250
    q, k, v, cu_q, cu_k = topic_batch([L], [L])
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, page)
    sel = dict(SEL, block_size=block, alpha=0.2)
    means = sp.mean_cache(kc, block_size=block)
    assert means[0].shape[1] == HKV
    for union, corr in ((False, False), (False, True), (True, False)):
        for c0 in range(0, L, C):
            c1 = min(L, c0 + C)
            step = (q[c0:c1], kc, vc, np.array([0, c1 - c0], np.int32), bt, np.array([c1], np.int32), c1 - c0, c1)
            got = sp.chunked_prefill(*step, final_chunk=c1 == L, union=union, mean_cache=means, head_subgroups=2,
                                     correction=corr, **sel)
            want = sp.chunked_prefill(*step, final_chunk=c1 == L, union=union, head_subgroups=2, correction=corr,
                                      **sel)
            np.testing.assert_array_equal(got, want)
            same = sp.sparse_prefill(step[0], kc, vc, step[3], None, c1 - c0, c1, block_table=bt, seqused_k=step[5],
                                     final_chunk=c1 == L, union=union, correction=corr, head_subgroups=2, **sel)
            np.testing.assert_array_equal(want, same)
    k_mean, v_mean, _ = sp.pool_kv(k, v, cu_k, block_size=block)
    for J in range(L // block):
        last = (J + 1) * block - 1
        pg = bt[0, last // page]
        slot = pg * (page // block) + (last % page) // block if page >= block else pg
        np.testing.assert_array_equal(means[0][slot], k_mean[J])
        np.testing.assert_array_equal(means[1][slot], v_mean[J])

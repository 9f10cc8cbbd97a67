"""Block-sparse prefill through the Python API: index properties, the selection rule, sparse attention against a
naive float64 implementation with mean correction, union mode, pooling."""

import numpy as np
import pytest

import sparse_prefill as sp
import sp_naive as naive
from conftest import MECHANICS, make_varlen, to_paged
from conftest import topic_batch as conftest_topic_batch

BS = 64  # block size used by these tests (the smallest allowed)
SEL = dict(block_size=BS, sink=64, window=64, last_n=1, **MECHANICS)


def topic_batch(q_lens, k_lens, hq=4, hkv=2, d=64, seed=0):
    """Several topic sequences with topic blocks of BS keys (conftest.topic_batch)."""
    return conftest_topic_batch(q_lens, k_lens, hq, hkv, d, seed, block=BS)


Q_LENS, K_LENS = [700, 130, 64], [700, 600, 64]


@pytest.fixture(scope="module")
def batch():
    return topic_batch(Q_LENS, K_LENS)


def args(batch):
    q, k, v, cu_q, cu_k = batch
    return (q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS))


def visible_blocks(lq, lk, g, tile, causal=True):
    """Blocks whose first key some row of the tile sees (the blocks selection scores)."""
    r0, r1 = naive.tile_rows(tile, lq, g)
    last_diag = (r1 - 1) // g + lk - lq
    nb = (lk + BS - 1) // BS
    return [j for j in range(nb) if not causal or j * BS <= last_diag]


def iter_segments(index, cu_q, cu_k, g, hkv):
    seg = 0
    for b in range(len(cu_q) - 1):
        lq, lk = int(cu_q[b + 1] - cu_q[b]), int(cu_k[b + 1] - cu_k[b])
        tiles = (lq * g + 127) // 128
        for h in range(hkv):
            for t in range(tiles):
                s = seg + h * tiles + t
                ids = index.host["block_ids"][index.host["segment_start"][s]:index.host["segment_end"][s]]
                yield b, h, t, lq, lk, ids
        seg += hkv * tiles


def test_index_structure(batch):
    q, k, v, cu_q, cu_k = batch
    index = sp.build_index(*args(batch), alpha=0.1, **SEL)
    assert isinstance(index, sp.Index) and index.mode == "tile"
    g, hkv = 2, 2
    assert (index.block_size, index.group_size, index.num_kv_heads, index.head_dim) == (BS, g, hkv, 64)
    assert index.correction is False  # the default (SELECTION_DEFAULTS)
    assert sp.build_index(*args(batch), alpha=0.1, correction=True, **SEL).correction is True
    for name in ("segment_start", "segment_end", "block_ids", "cu_blocks"):
        a = getattr(index, name)
        assert isinstance(a, np.ndarray) and a.dtype == np.int32 and a.ndim == 1
    tiles = [(lq * g + 127) // 128 for lq in Q_LENS]
    np.testing.assert_array_equal(index.tiles, tiles)
    assert index.num_segments == hkv * sum(tiles)
    np.testing.assert_array_equal(index.cu_blocks, np.concatenate([[0], np.cumsum([(n + BS - 1) // BS
                                                                                    for n in K_LENS])]))
    assert index.k_mean.shape == (index.cu_blocks[-1], hkv, 64) and index.k_mean.dtype == np.float32
    assert 0 < index.density < 1 and index.kept_blocks < index.visible_blocks
    visible = kept = 0
    for b, h, t, lq, lk, ids in iter_segments(index, cu_q, cu_k, g, hkv):
        assert np.all(np.diff(ids) > 0), "ascending"
        vis = visible_blocks(lq, lk, g, t)
        assert set(ids.tolist()) <= set(range((lk + BS - 1) // BS))
        visible += len(vis)
        kept += len(set(ids.tolist()) & set(vis))
        np.testing.assert_array_equal(index.segment(b, h, t), ids)
        assert index.segment_id(b, h, t) == index.segment_offsets[b] + h * index.tiles[b] + t
    assert (kept, visible) == (index.kept_blocks, index.visible_blocks)
    assert index.density == pytest.approx(kept / visible)
    assert "density" in repr(index)


def test_pooled_means(batch):
    q, k, v, cu_q, cu_k = batch
    km, cub = naive.pool(k, cu_k, BS)
    vm, _ = naive.pool(v, cu_k, BS)
    for correction in (False, True):
        index = sp.build_index(*args(batch), correction=correction, **SEL)
        np.testing.assert_array_equal(index.cu_blocks, cub)
        np.testing.assert_allclose(index.k_mean, km, atol=1e-5, rtol=0)
        if correction:
            np.testing.assert_allclose(index.v_mean, vm, atol=1e-5, rtol=0)
        else:  # the correction is the only reader of the V means: none are pooled without it
            assert index.v_mean is None and index.host["v_mean"] is None
    k_mean, v_mean, cu_blocks = sp.pool_kv(k, v, cu_k, block_size=BS)
    np.testing.assert_array_equal(cu_blocks, cub)
    np.testing.assert_allclose(k_mean, km, atol=1e-5, rtol=0)
    np.testing.assert_allclose(v_mean, vm, atol=1e-5, rtol=0)


def test_index_without_v_mean(batch):
    """An index without the correction has no V means and still serves sparse_attention and union_index; one with
    the correction but its v_mean removed is rejected, naming index.v_mean."""
    q, k, v, cu_q, cu_k = batch
    lens = (max(Q_LENS), max(K_LENS))
    off = sp.build_index(*args(batch), alpha=0.1, **SEL)
    on = sp.build_index(*args(batch), alpha=0.1, correction=True, **SEL)
    assert off.v_mean is None and on.v_mean is not None
    for name in ("segment_start", "segment_end", "block_ids", "cu_blocks", "k_mean"):
        np.testing.assert_array_equal(off.host[name], on.host[name], err_msg=name)
    u = sp.union_index(off, *args(batch))
    assert u.correction is False and u.v_mean is None
    ref = naive.sparse_attention(q, k, v, cu_q, cu_k, u.host, BS, False)[0]
    np.testing.assert_allclose(sp.sparse_attention(q, k, v, u, cu_q, cu_k, *lens), ref, atol=2e-5, rtol=0)
    on.v_mean = None
    on.host["v_mean"] = None
    with pytest.raises(ValueError, match="^index.v_mean: is missing, but index.correction is set"):
        sp.sparse_attention(q, k, v, on, cu_q, cu_k, *lens)
    with pytest.raises(ValueError, match="^index.v_mean"):
        sp.union_index(on, *args(batch))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_pool_kv_paged(rng, page_size):
    q, k, v, cu_q, cu_k = make_varlen(rng, [1, 1], [150, 64])
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, page_size)
    k_mean, v_mean, cu_blocks = sp.pool_kv(kc, vc, None, block_size=BS, block_table=bt, seqused_k=used)
    km, cub = naive.pool(k, cu_k, BS)
    np.testing.assert_array_equal(cu_blocks, cub)
    np.testing.assert_allclose(k_mean, km, atol=1e-5, rtol=0)
    np.testing.assert_allclose(v_mean, naive.pool(v, cu_k, BS)[0], atol=1e-5, rtol=0)


def test_sink_window_last_n_always_kept(batch):
    q, k, v, cu_q, cu_k = batch
    index = sp.build_index(*args(batch), alpha=1.0, **SEL)  # alpha = 1: only the best block passes the threshold
    g, hkv = 2, 2
    for b, h, t, lq, lk, ids in iter_segments(index, cu_q, cu_k, g, hkv):
        vis = visible_blocks(lq, lk, g, t)
        ids = set(ids.tolist())
        assert 0 in ids, "sink block"
        r0, r1 = naive.tile_rows(t, lq, g)
        diag_lo, diag_hi = r0 // g + lk - lq, (r1 - 1) // g + lk - lq
        assert diag_lo // BS in ids and diag_hi // BS in ids, "blocks on the diagonal"
        tiles = (lq * g + 127) // 128
        if t >= tiles - SEL["last_n"]:
            assert set(vis) <= ids, "last_n tiles run dense"


def test_selection_rule(batch):
    """Kept blocks are forced (sink / window / last_n) or pass E_IJ >= alpha * max_J E_IJ; dropped ones fail it."""
    q, k, v, cu_q, cu_k = batch
    alpha = 0.1
    index = sp.build_index(*args(batch), alpha=alpha, rule="tile_energy", **SEL)
    g, hkv, d = 2, 2, 64
    scale = 1 / np.sqrt(d)
    km, cub = naive.pool(k, cu_k, BS)
    checked_drop = checked_keep = 0
    for b, h, t, lq, lk, ids in iter_segments(index, cu_q, cu_k, g, hkv):
        tiles = (lq * g + 127) // 128
        if t >= tiles - SEL["last_n"]:
            continue
        r0, r1 = naive.tile_rows(t, lq, g)
        rows = np.arange(r0, r1)
        pos, heads = rows // g, h * g + rows % g
        qr = q[cu_q[b] + pos, heads].astype(np.float64)              # [rows, D]
        diag = pos + lk - lq
        vis = visible_blocks(lq, lk, g, t)
        s = qr @ km[cub[b] + np.array(vis), h].T * scale              # [rows, J]
        sees = (np.array(vis)[None, :] * BS) <= diag[:, None]
        m = s[sees].max()
        e = np.where(sees, np.exp(np.where(sees, s, m) - m), 0).sum(axis=0)
        thresh = alpha * e.max()
        ids = set(ids.tolist())

        def forced(slack):
            """Always-kept blocks: sink, diagonal-crossing (not fully visible to every row), the local band
            [diag - window + 1, diag] of some row; `slack` widens the band to absorb off-by-one conventions."""
            out = set(j for j in vis if j * BS < SEL["sink"] or (j + 1) * BS - 1 > diag.min())
            for j in vis:
                if np.any((j * BS <= diag) & ((j + 1) * BS - 1 >= diag - SEL["window"] + 1 - slack)):
                    out.add(j)
            return out

        surely, maybe = forced(-1), forced(2)
        for col, j in enumerate(vis):
            if j in ids and j not in maybe:
                assert e[col] >= thresh * (1 - 1e-4), (b, h, t, j)
                checked_keep += 1
            if j not in ids:
                assert j not in surely, (b, h, t, j)
                assert e[col] < thresh * (1 + 1e-4), (b, h, t, j)
                checked_drop += 1
    assert checked_drop > 0 and checked_keep > 0


@pytest.mark.parametrize("correction", [True, False])
def test_sparse_attention_matches_naive(batch, correction):
    q, k, v, cu_q, cu_k = batch
    index = sp.build_index(*args(batch), alpha=0.1, correction=correction, **SEL)
    out, lse = sp.sparse_attention(q, k, v, index, cu_q, cu_k, max(Q_LENS), max(K_LENS), return_lse=True)
    ref_out, ref_lse = naive.sparse_attention(q, k, v, cu_q, cu_k, index.host, BS, correction)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-4, rtol=0)
    dense = sp.attention(*args(batch))
    assert not np.allclose(out, dense, atol=1e-3), "the test must actually drop blocks"


def test_correction_moves_toward_dense(batch):
    q, k, v, cu_q, cu_k = batch
    dense = sp.attention(*args(batch))
    errs = {}
    for corr in (True, False):
        out = sp.sparse_prefill(*args(batch), alpha=0.3, correction=corr, **SEL)
        errs[corr] = np.linalg.norm(out - dense) / np.linalg.norm(dense)
    assert errs[True] < errs[False]


def test_alpha_zero_is_dense(batch):
    q, k, v, cu_q, cu_k = batch
    index = sp.build_index(*args(batch), alpha=0.0, **SEL)
    assert index.density == 1.0 and index.kept_blocks == index.visible_blocks
    out, lse = sp.sparse_attention(q, k, v, index, *args(batch)[3:], return_lse=True)
    dense, dense_lse = sp.attention(*args(batch), return_lse=True)
    np.testing.assert_allclose(out, dense, atol=1e-5, rtol=0)
    np.testing.assert_allclose(lse, dense_lse, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_sparse_matches_contiguous(rng, batch, page_size):
    q, k, v, cu_q, cu_k = batch
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, page_size)
    paged = (q, kc, vc, cu_q, None, max(Q_LENS), max(K_LENS))
    pkw = dict(block_table=bt, seqused_k=used)
    ip = sp.build_index(*paged, alpha=0.1, **SEL, **pkw)
    ic = sp.build_index(*args(batch), alpha=0.1, **SEL)
    for name in ("segment_start", "segment_end", "block_ids", "cu_blocks"):
        np.testing.assert_array_equal(getattr(ip, name), getattr(ic, name))
    np.testing.assert_allclose(ip.k_mean, ic.k_mean, atol=1e-6, rtol=0)
    out_p = sp.sparse_attention(q, kc, vc, ip, cu_q, None, max(Q_LENS), max(K_LENS), **pkw)
    out_c = sp.sparse_attention(q, k, v, ic, *args(batch)[3:])
    np.testing.assert_allclose(out_p, out_c, atol=1e-5, rtol=0)
    # alpha = 0 on paged KV equals dense paged attention
    out0 = sp.sparse_prefill(*paged, alpha=0.0, **SEL, **pkw)
    np.testing.assert_allclose(out0, sp.attention(*paged, **pkw), atol=1e-5, rtol=0)


def test_sparse_prefill_one_shot(batch):
    q, k, v, cu_q, cu_k = batch
    index = sp.build_index(*args(batch), alpha=0.2, **SEL)
    two_step, lse2 = sp.sparse_attention(q, k, v, index, *args(batch)[3:], return_lse=True)
    one = sp.sparse_prefill(*args(batch), alpha=0.2, **SEL)
    np.testing.assert_array_equal(one, two_step)
    out, lse, idx = sp.sparse_prefill(*args(batch), alpha=0.2, **SEL, return_lse=True, return_index=True)
    np.testing.assert_array_equal(out, two_step)
    np.testing.assert_array_equal(lse, lse2)
    np.testing.assert_array_equal(idx.block_ids, index.block_ids)
    out, idx = sp.sparse_prefill(*args(batch), alpha=0.2, **SEL, return_index=True)
    assert isinstance(idx, sp.Index)
    buf = np.empty_like(q)
    assert sp.sparse_prefill(*args(batch), alpha=0.2, **SEL, out=buf) is buf
    np.testing.assert_array_equal(buf, two_step)


def test_union_index(batch):
    q, k, v, cu_q, cu_k = batch
    index = sp.build_index(*args(batch), alpha=0.1, **SEL)
    u = sp.union_index(index, *args(batch))
    assert isinstance(u, sp.Index) and u.mode == "union"
    assert u.num_segments == index.num_segments
    g, hkv = 2, 2
    lists = {}
    for (b, h, t, lq, lk, ids), (_, _, _, _, _, uids) in zip(iter_segments(index, cu_q, cu_k, g, hkv),
                                                           iter_segments(u, cu_q, cu_k, g, hkv)):
        assert set(ids.tolist()) <= set(uids.tolist()), "union contains each tile's list"
        assert np.all(np.diff(uids) > 0)
        lists.setdefault((b, h), set()).update(ids.tolist())
        # every tile of a (sequence, KV head) shares one list
        key = (b, h)
        s = u.segment_id(b, h, t)
        span = (int(u.segment_start[s]), int(u.segment_end[s]))
        lists.setdefault(("span",) + key, span)
        assert lists[("span",) + key] == span
    for b in range(len(Q_LENS)):
        for h in range(hkv):
            assert set(u.segment(b, h, 0).tolist()) == lists[(b, h)]
    assert u.density >= index.density
    # union execution equals the naive sparse semantics over the union lists
    out = sp.sparse_attention(q, k, v, u, *args(batch)[3:])
    ref = naive.sparse_attention(q, k, v, cu_q, cu_k, u.host, BS, u.correction)[0]
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


def test_build_index_union_mode_equals_union_index(batch):
    index = sp.build_index(*args(batch), alpha=0.1, **SEL)
    u = sp.build_index(*args(batch), alpha=0.1, **SEL, union=True)
    ref = sp.union_index(index, *args(batch))
    assert u.mode == "union" and u.density == ref.density and u.kept_blocks == ref.kept_blocks
    for name in ("segment_start", "segment_end", "block_ids"):
        np.testing.assert_array_equal(u.host[name], ref.host[name])
    q, k, v, cu_q, cu_k = batch
    out = sp.sparse_prefill(*args(batch), alpha=0.1, **SEL, union=True)
    np.testing.assert_array_equal(out, sp.sparse_attention(q, k, v, ref, *args(batch)[3:]))


def test_final_chunk_false_drops_the_dense_tail(batch):
    q, k, v, cu_q, cu_k = batch
    final = sp.build_index(*args(batch), alpha=1.0, **SEL)
    mid = sp.build_index(*args(batch), alpha=1.0, **SEL, final_chunk=False)
    no_tail = sp.build_index(*args(batch), alpha=1.0, **dict(SEL, last_n=0))
    np.testing.assert_array_equal(mid.host["block_ids"], no_tail.host["block_ids"])
    assert mid.kept_blocks < final.kept_blocks       # the last tiles of the 700-query sequence ran dense before
    with pytest.raises(TypeError, match="final_chunk"):
        sp.build_index(*args(batch), final_chunk="no")
    with pytest.raises(TypeError, match="union"):
        sp.sparse_prefill(*args(batch), union=1.5)


def _paged_chunk(rng, L=900, C=300, page=64):
    """The last C queries of an L-token topic prompt and its whole K/V in a paged cache (pages shuffled)."""
    q, k, v, cu_q, cu_k = topic_batch([C], [L])
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, page)
    return q, kc, vc, cu_q, bt, used, C, L


def test_chunked_prefill_step(rng):
    q, kc, vc, cu_q, bt, used, C, L = _paged_chunk(rng)
    for final in (True, False):
        for union in (False, True):
            for extra in ({}, dict(correction=True, rule="tile_energy")):
                got = sp.chunked_prefill(q, kc, vc, cu_q, bt, used, C, L, final_chunk=final, union=union, **extra,
                                         **SEL)
                want = sp.sparse_prefill(q, kc, vc, cu_q, None, C, L, block_table=bt, seqused_k=used,
                                         final_chunk=final, union=union, **extra, **SEL)
                np.testing.assert_array_equal(got, want)
    dense = sp.attention(q, kc, vc, cu_q, None, C, L, block_table=bt, seqused_k=used)
    np.testing.assert_allclose(sp.chunked_prefill(q, kc, vc, cu_q, bt, used, C, L, final_chunk=False, alpha=0.0,
                                                  **SEL), dense, atol=2e-5, rtol=0)


def test_chunked_prefill_bad_input(rng):
    q, kc, vc, cu_q, bt, used, C, L = _paged_chunk(rng)
    with pytest.raises(TypeError, match="final_chunk"):
        sp.chunked_prefill(q, kc, vc, cu_q, bt, used, C, L)   # final_chunk is required
    with pytest.raises(ValueError, match="^seqused_k: sequence 0 holds 200 tokens, fewer than its chunk of 300"):
        sp.chunked_prefill(q, kc, vc, cu_q, bt, np.array([200], np.int32), C, L, final_chunk=True)
    with pytest.raises(ValueError, match="^max_seqlen_k"):
        sp.chunked_prefill(q, kc, vc, cu_q, bt, used, C, L - 1, final_chunk=True)
    with pytest.raises(ValueError, match="^block_table"):
        sp.chunked_prefill(q, kc, vc, cu_q, None, used, C, L, final_chunk=True)
    bad = bt.copy()
    bad[0, 0] = kc.shape[0] + 5                                  # a page id past the cache
    with pytest.raises(ValueError, match="^block_table"):
        sp.chunked_prefill(q, kc, vc, cu_q, bad, used, C, L, final_chunk=True)
    with pytest.raises(ValueError, match="^cu_seqlens_q"):      # lengths that do not match q
        sp.chunked_prefill(q, kc, vc, np.array([0, C - 1], np.int32), bt, used, C, L, final_chunk=True)


@pytest.mark.parametrize("page,block", [(64, 128), (256, 128), (64, 64)])
def test_chunked_prefill_mean_cache(rng, page, block):
    """A 1000-token prompt in chunks of 300 over one paged cache, with a pooled-means cache passed to every step:
    outputs equal the steps without it, and afterwards every complete block's slot holds pool_kv's means (V too:
    the steps run without the correction, whose index has no V means, but the cache keeps them)."""
    L, C = 1000, 300
    q, k, v, cu_q, cu_k = topic_batch([L], [L])
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, page)
    sel = dict(SEL, block_size=block)
    means = sp.mean_cache(kc, block_size=block)
    assert means[0].shape == (kc.shape[0] * max(1, page // block), kc.shape[2], kc.shape[3])
    assert means[0].dtype == np.float32 and not means[0].any()
    for c0 in range(0, L, C):
        c1 = min(L, c0 + C)
        args_ = (q[c0:c1], kc, vc, np.array([0, c1 - c0], np.int32), bt, np.array([c1], np.int32), c1 - c0, c1)
        got = sp.chunked_prefill(*args_, final_chunk=c1 == L, mean_cache=means, **sel)
        want = sp.chunked_prefill(*args_, final_chunk=c1 == L, **sel)
        np.testing.assert_array_equal(got, want)
    k_mean, v_mean, _ = sp.pool_kv(k, v, cu_k, block_size=block)
    for J in range(L // block):                                  # complete blocks only
        last = (J + 1) * block - 1
        pg = bt[0, last // page]
        slot = pg * (page // block) + (last % page) // block if page >= block else pg
        np.testing.assert_allclose(means[0][slot], k_mean[J], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(means[1][slot], v_mean[J], rtol=1e-6, atol=1e-6)


def test_mean_cache_bad_input(rng):
    q, kc, vc, cu_q, bt, used, C, L = _paged_chunk(rng)
    means = sp.mean_cache(kc)
    step = (q, kc, vc, cu_q, bt, used, C, L)
    with pytest.raises(ValueError, match="^mean_cache.k_mean"):
        sp.chunked_prefill(*step, final_chunk=True, mean_cache=(means[0][:-1], means[1]))
    with pytest.raises(TypeError, match="^mean_cache.v_mean"):
        sp.chunked_prefill(*step, final_chunk=True, mean_cache=(means[0], means[1].astype(np.float64)))
    with pytest.raises(TypeError, match="^mean_cache"):
        sp.chunked_prefill(*step, final_chunk=True, mean_cache=means[0])
    with pytest.raises(ValueError, match="^mean_cache.v_mean"):
        sp.chunked_prefill(*step, final_chunk=True, mean_cache=(means[0], means[0]))
    qc, k, v, cu_q2, cu_k = topic_batch([C], [L])
    with pytest.raises(ValueError, match="^mean_cache"):            # contiguous KV: no pages to key the slots by
        sp.sparse_prefill(qc, k, v, cu_q2, cu_k, C, L, mean_cache=means)
    with pytest.raises(ValueError, match="^block_size"):
        sp.mean_cache(kc[:, :48], block_size=128)                   # 48-token pages and 128-token blocks
    with pytest.raises(ValueError, match="^k_cache"):
        sp.mean_cache(kc[0])


def test_index_reused_across_array_libraries(batch):
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = batch
    index = sp.build_index(*args(batch), **SEL)
    t = torch.from_numpy
    out_t = sp.sparse_attention(t(q), t(k), t(v), index, t(cu_q), t(cu_k), max(Q_LENS), max(K_LENS))
    assert isinstance(out_t, torch.Tensor)
    out_n = sp.sparse_attention(q, k, v, index, cu_q, cu_k, max(Q_LENS), max(K_LENS))
    np.testing.assert_array_equal(out_t.numpy(), out_n)
    index_t = sp.build_index(t(q), t(k), t(v), t(cu_q), t(cu_k), max(Q_LENS), max(K_LENS), **SEL)
    assert isinstance(index_t.block_ids, torch.Tensor)
    np.testing.assert_array_equal(index_t.block_ids.numpy(), index.block_ids)


def test_pool_kv_generic_dlpack_and_stream(batch):
    from test_attention import DLPackOnly
    q, k, v, cu_q, cu_k = batch
    k_mean, v_mean, cu_blocks = sp.pool_kv(DLPackOnly(k), DLPackOnly(v), DLPackOnly(cu_k), block_size=BS, stream=0)
    assert isinstance(k_mean, np.ndarray)
    np.testing.assert_allclose(k_mean, naive.pool(k, cu_k, BS)[0], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(cu_blocks, naive.pool(k, cu_k, BS)[1])

"""The exact oracle of issue 37 in chunks of query positions (bench/accuracy/emulate.py: oracle_chunks,
oracle_attention, oracle_select) against the unchunked emulation of the same rule (select(score='exact',
agg='rowcum') + sparse_attention), its defining property (every row keeps >= F of its softmax mass), dense at
frac None, and the chunk size's memory bound. CPU, float64 where selections are compared."""
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from accuracy import emulate as E  # noqa: E402

SCALE = 1.0 / 8
B = 64  # small blocks and geometry: short sequences with many prunable blocks (fast tests)
GEOM = dict(sink=64, window=64, last_n=1, block=B)


def topic_qkv(L, hq, hkv, D=64, seed=0):
    """Selective attention (the topic workload's recipe, small): per KV head and B-key block a topic; keys are
    their block's topic plus noise, each B-position query group attends to 2 earlier topics."""
    g = torch.Generator().manual_seed(seed)
    nb = (L + B - 1) // B
    t = torch.randn(hkv, nb, D, generator=g)
    k = t.transpose(0, 1).repeat_interleave(B, 0)[:L] + torch.randn(L, hkv, D, generator=g)
    v = torch.randn(L, hkv, D, generator=g)
    tgt = (torch.rand(hkv, nb, 2, generator=g) * torch.arange(nb).clamp(min=1)[None, :, None]).long()
    tq = torch.gather(t, 1, tgt.reshape(hkv, -1)[..., None].expand(-1, -1, D)).reshape(hkv, nb, 2, D).sum(2)
    q = tq.transpose(0, 1).repeat_interleave(B, 0)[:L].repeat_interleave(hq // hkv, 1)
    q = q + torch.randn(L, hq, D, generator=g)
    return q, k, v


def row_masks(keep, L, g, S):
    """keep [Hkv * S, T, nb] -> [Hq, L, nb]: the tile entry of each (query head, position)."""
    gs = g // S
    sel = E.Selection(keep, torch.zeros_like(keep), torch.ones(keep.shape[1:], dtype=torch.bool), gs, L,
                      keep.shape[2], None, None, None)
    return sel.per_row(keep)


@pytest.mark.parametrize("hq,hkv", [(6, 2), (8, 2)])
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("frac", [0.5, 0.9])
def test_chunked_equals_unchunked(hq, hkv, per_head, frac):
    L = 780  # not a multiple of 128: a partial last block and tile
    q, k, v = topic_qkv(L, hq, hkv, seed=hq + int(10 * frac))
    g = hq // hkv
    S = g if per_head else 1
    ref = E.select(q, k, v, dict(score="exact", agg="rowcum", gamma=frac, subgroups=S, **GEOM), SCALE)
    assert ref.density < 0.8, "the data must make the oracle prune"
    ref_out = E.sparse_attention(q, k, v, ref, SCALE, B)
    for chunk in (128, 256, None):
        keep, vis = E.oracle_select(q, k, SCALE, frac, S, chunk=chunk, **GEOM)
        assert torch.equal(vis, ref.visible)
        assert torch.equal(keep & vis[None], ref.keep & ref.visible[None]), f"chunk {chunk}"
        out, kept, visible = E.oracle_attention(q, k, v, SCALE, frac, S, chunk=chunk, dtype=torch.float64, **GEOM)
        assert (kept, visible) == (ref.kept_blocks, ref.visible_blocks)
        assert float((out.float() - ref_out).abs().max()) < 5e-5
    out32, kept32, _ = E.oracle_attention(q, k, v, SCALE, frac, S, **GEOM)  # float32 (the GPU path's dtype)
    assert out32.dtype == torch.float32 and float((out32 - ref_out).abs().max()) < 1e-4
    assert abs(kept32 - ref.kept_blocks) <= 2  # rounding may move a block at the threshold


@pytest.mark.parametrize("per_head", [True, False])
def test_every_row_keeps_its_fraction_of_the_mass(per_head):
    L, hq, hkv, frac = 700, 6, 2, 0.7
    q, k, v = topic_qkv(L, hq, hkv, seed=11)
    g = hq // hkv
    S = g if per_head else 1
    keep, vis = E.oracle_select(q, k, SCALE, frac, S, chunk=256, **GEOM)
    rows = row_masks(keep & vis[None], L, g, S)  # [Hq, L, nb]
    nb = keep.shape[2]
    causal = torch.arange(nb * B)[None, :] <= torch.arange(L)[:, None]
    kept_mass, sizes = [], []
    for h in range(hq):
        lg = (q[:, h].double() @ torch.cat([k[:, h // g].double(), torch.zeros(nb * B - L, 64).double()]).T) * SCALE
        p = torch.softmax(lg.masked_fill(~causal, -math.inf), -1).view(L, nb, B).sum(-1)  # [L, nb]
        kept_mass.append((p * rows[h]).sum(-1))
        sizes.append(rows[h].sum(-1))
    kept_mass = torch.stack(kept_mass)
    assert float(kept_mass.min()) >= frac - 1e-9
    assert float(torch.stack(sizes).float().mean()) < 0.95 * (torch.arange(L) // B + 1).float().mean()  # pruned


def test_monotone_in_frac_and_dense_at_none():
    L = 700
    q, k, v = topic_qkv(L, 8, 2, seed=3)
    prev = None
    for frac in (0.3, 0.5, 0.7, 0.9):
        keep, vis = E.oracle_select(q, k, SCALE, frac, None, **GEOM)
        if prev is not None:
            assert bool((prev <= keep).all()), "a larger fraction keeps a superset of the blocks"
        prev = keep
    out, kept, visible = E.oracle_attention(q, k, v, SCALE, None, 1, **GEOM)
    assert kept == visible
    kk = k.repeat_interleave(4, 1).transpose(0, 1)
    vv = v.repeat_interleave(4, 1).transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True,
                                                             scale=SCALE).transpose(0, 1)
    assert float((out - dense).abs().max()) < 1e-5


def test_chunk_rows_bound_memory():
    for L, g in ((8192, 3), (32768, 4), (16384, 4), (300, 1)):
        for mem in (2 << 30, 64 << 20):
            rows = E.oracle_chunk_rows(L, g, mem, 4)
            assert rows % 128 == 0 and rows >= 128
            assert rows == 128 or 2 * g * (L + 128) * 4 * rows <= mem
    assert E.oracle_chunk_rows(32768, 4, 2 << 30, 4) >= 1024  # big enough chunks on the GPU at 32K
    # a tiny budget forces 128-position chunks; the result does not change
    q, k, v = topic_qkv(700, 6, 2, seed=5)
    a = E.oracle_attention(q, k, v, SCALE, 0.5, None, mem_bytes=1 << 16, **GEOM)
    b = E.oracle_attention(q, k, v, SCALE, 0.5, None, **GEOM)
    assert a[1:] == b[1:] and float((a[0] - b[0]).abs().max()) < 1e-5
    with pytest.raises(AssertionError):
        next(E.oracle_chunks(q, k, SCALE, 0.5, chunk=100))


@pytest.mark.parametrize("frac", [0.5, 0.7])
def test_rowcum_on_the_mass_lower_bound_is_the_oracle_for_alike_keys(frac):
    """emulate.select's cummass 'lb' (estimators.py's lbcum, end to end): each block's mass bounded from its maximum and
    its pooled mean logit is its exact mass when the block's keys are alike, so the per-row mass target on the bound
    selects what the oracle selects, but where a row's diagonal block counts keys it does not see; and the options
    are checked."""
    L, hq, hkv = 1500, 6, 2  # ~24 blocks a row: most are neither sink, window nor diagonal
    q, k, v = topic_qkv(L, hq, hkv, seed=int(100 * frac))
    nb = (L + B - 1) // B
    g = torch.Generator().manual_seed(7)
    k = (torch.randn(nb, hkv, 64, generator=g) * 3).repeat_interleave(B, 0)[:L]  # one key per block, repeated
    geom = dict(GEOM, dense_fraction=1.0)
    ref = E.select(q, k, v, dict(score="exact", agg="rowcum", gamma=frac, **geom), SCALE)
    got = E.select(q, k, v, dict(score="kmax", agg="rowcum", gamma=frac, cummass="lb", **geom), SCALE)
    assert ref.density < 0.9, "the data must make the oracle prune"
    a, b = ref.keep & ref.visible[None], got.keep & got.visible[None]
    # equal but for a row's partly seen diagonal block: its pooled mean holds the keys the row does not see yet, so the
    # bound counts the whole block (here n alike keys where the row sees fewer); always kept and first in the order, it
    # reaches the target sooner: a subset, a block or a few a call
    assert bool((b & ~a).sum() == 0) and int((a & ~b).sum()) <= 0.01 * int(a.sum()), (int((a & ~b).sum()), int(a.sum()))
    # on keys that differ within their blocks the bound is not softmax over the maxima (cummass 'max')
    q2, k2, v2 = topic_qkv(L, hq, hkv, seed=int(100 * frac))
    lb, mx = (E.select(q2, k2, v2, dict(score="kmax", agg="rowcum", gamma=frac, cummass=c, **geom), SCALE).keep
              for c in ("lb", "max"))
    assert not torch.equal(lb, mx)
    with pytest.raises(ValueError, match="cummass"):
        E.select(q, k, v, dict(score="kmax", agg="rowcum", cummass="sum", **GEOM), SCALE)
    with pytest.raises(ValueError, match="cummass 'lb'"):
        E.select(q, k, v, dict(score="mean", agg="rowcum", cummass="lb", **GEOM), SCALE)

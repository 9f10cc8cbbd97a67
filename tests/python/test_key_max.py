"""rule='key_max' through the package on the CPU reference, beyond the emulator comparison (test_accuracy_emulator.py):
FP8 keys enter the basis and the scores in real units (keys times their descale), paged KV equals contiguous, chunks
(Lq < Lk) and union mode run, and the dense rule applies as under every rule."""
import numpy as np
import pytest

import sparse_prefill as sp
from conftest import make_varlen, to_paged

Q_LENS, K_LENS = [300, 777], [300, 1500]
# alpha 0.9: over Gaussian keys every block's per-key maximum sits near the row's top, so lower alphas keep all
SEL = dict(rule="key_max", alpha=0.9, block_size=64, sink=0, window=64, last_n=0, dense_fraction=1.0)


def _lists(index, hkv):
    return [list(index.segment(b, h, t)) for b in range(index.batch) for h in range(hkv)
            for t in range(int(index.tiles[b]))]


def _spiky(rng, hq=4, hkv=2):
    """make_varlen with a query direction u shared by each KV group and a few spike keys along it early in each
    sequence: a row's running maximum reaches a spike and the blocks before it fall below alpha."""
    q, k, v, cu_q, cu_k = make_varlen(rng, Q_LENS, K_LENS, hq=hq, hkv=hkv, d=64)
    u = rng.standard_normal((hkv, 64)).astype(np.float32)
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    q += 8.0 * np.repeat(u, hq // hkv, axis=0)[None]
    for b, n in enumerate(np.diff(cu_k)):
        for h in range(hkv):
            k[cu_k[b] + rng.integers(n // 4, n // 2, 2), h] += 6.0 * u[h]
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("subgroups", [1, 0])
def test_fp8_equals_its_dequantised_values(rng, subgroups):
    """FP8 q/k/v with per-(sequence, KV head) descales select exactly what their float32 values (e4m3 times the
    descale, the product the reference forms) select: the basis and the scores read keys in real units."""
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = _spiky(rng)
    f8 = torch.float8_e4m3fn
    ds = {n: rng.uniform(0.03, 0.06, (len(Q_LENS), 2)).astype(np.float32) for n in ("q", "k", "v")}  # no clamping

    def quant(x, d, cu):
        seq = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
        per = d[seq][:, np.repeat(np.arange(2), x.shape[1] // 2), None]
        x8 = torch.from_numpy(x / per).clamp(-448, 448).to(f8)
        return x8, (x8.float().numpy() * per).astype(np.float32)

    (q8, qf), (k8, kf), (v8, vf) = (quant(x, ds[n], cu) for x, n, cu in ((q, "q", cu_q), (k, "k", cu_k),
                                                                            (v, "v", cu_k)))
    mq, mk = max(Q_LENS), max(K_LENS)
    cq, ck = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    sel = dict(SEL, head_subgroups=subgroups)
    a = sp.build_index(q8, k8, v8, cq, ck, mq, mk, q_descale=torch.from_numpy(ds["q"]),
                       k_descale=torch.from_numpy(ds["k"]), v_descale=torch.from_numpy(ds["v"]), **sel)
    b = sp.build_index(qf, kf, vf, cu_q, cu_k, mq, mk, **sel)
    assert a.density < 1.0
    assert _lists(a, a.num_kv_heads) == _lists(b, b.num_kv_heads)


def test_paged_equals_contiguous(rng):
    q, k, v, cu_q, cu_k = _spiky(rng)
    kc, vc, table, used = to_paged(rng, k, v, cu_k, 16)
    mq, mk = max(Q_LENS), max(K_LENS)
    a = sp.build_index(q, k, v, cu_q, cu_k, mq, mk, **SEL)
    b = sp.build_index(q, kc, vc, cu_q, None, mq, mk, block_table=table, seqused_k=used, **SEL)
    assert a.density < 1.0
    assert _lists(a, a.num_kv_heads) == _lists(b, b.num_kv_heads)


def test_chunks_union_and_the_dense_rule(rng):
    q, k, v, cu_q, cu_k = _spiky(rng)
    mq, mk = max(Q_LENS), max(K_LENS)
    tiles = sp.build_index(q, k, v, cu_q, cu_k, mq, mk, **SEL)
    union = sp.build_index(q, k, v, cu_q, cu_k, mq, mk, union=True, **SEL)
    assert tiles.density < 1.0 and union.density >= tiles.density
    for b in range(tiles.batch):  # the union list of a (sequence, head) is the union of its tiles' lists
        for h in range(tiles.num_kv_heads):
            want = set().union(*(set(tiles.segment(b, h, t)) for t in range(int(tiles.tiles[b]))))
            assert set(union.segment(b, h, 0)) == want
    # the dense rule: a fraction just below the selection's density keeps every visible block
    dense = sp.build_index(q, k, v, cu_q, cu_k, mq, mk, **dict(SEL, dense_fraction=tiles.density - 1e-3))
    assert dense.density == 1.0
    out = sp.sparse_prefill(q, k, v, cu_q, cu_k, mq, mk, **SEL)
    ref = sp.sparse_attention(q, k, v, tiles, cu_q, cu_k, mq, mk)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))

"""Dense attention through the Python API against a naive float64 numpy implementation."""

import numpy as np
import pytest

import sparse_prefill as sp
import sp_naive as naive
from conftest import make_varlen, to_paged

ATOL = 2e-5

# Lq < Lk (prefix), Lq == Lk, Lq > Lk (leading rows see nothing when causal), a single query, an empty sequence.
Q_LENS = [5, 130, 1, 70, 0, 9]
K_LENS = [9, 200, 70, 70, 4, 3]


def check(out, lse, ref_out, ref_lse, atol=ATOL):
    np.testing.assert_allclose(out, ref_out, atol=atol, rtol=0)
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=atol * 10, rtol=0)
    assert np.all(lse[~finite] == -np.inf)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gqa(rng, hq, hkv, causal):
    q, k, v, cu_q, cu_k = make_varlen(rng, Q_LENS, K_LENS, hq=hq, hkv=hkv)
    out, lse = sp.attention(q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS), causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == np.float32 and isinstance(out, np.ndarray)
    assert lse.shape == (hq, q.shape[0]) and lse.dtype == np.float32
    ref_out, ref_lse = naive.attention(q, k, v, cu_q, cu_k, causal=causal)
    check(out, lse, ref_out, ref_lse)


def test_default_returns_out_only(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [7], [11])
    out = sp.attention(q, k, v, cu_q, cu_k, 7, 11)
    assert isinstance(out, np.ndarray) and out.shape == q.shape


def test_head_dim_128_and_scale(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [33, 17], [40, 90], hq=2, hkv=1, d=128)
    out, lse = sp.attention(q, k, v, cu_q, cu_k, 33, 90, softmax_scale=0.3, return_lse=True)
    check(out, lse, *naive.attention(q, k, v, cu_q, cu_k, scale=0.3))


@pytest.mark.parametrize("window", [(16, 0), (32, 8), (-1, 4), (0, 0), (5, -1)])
@pytest.mark.parametrize("causal", [True, False])
def test_window(rng, window, causal):
    q, k, v, cu_q, cu_k = make_varlen(rng, [40, 64, 3], [100, 64, 50])
    out, lse = sp.attention(q, k, v, cu_q, cu_k, 64, 100, causal=causal, window=window, return_lse=True)
    check(out, lse, *naive.attention(q, k, v, cu_q, cu_k, causal=causal, window=window))


def test_window_list_accepted(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [20], [20])
    a = sp.attention(q, k, v, cu_q, cu_k, 20, 20, window=[4, 0])
    b = sp.attention(q, k, v, cu_q, cu_k, 20, 20, window=(4, 0))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged(rng, page_size):
    q_lens, k_lens = [5, 70, 1, 33], [9, 150, 70, 33]
    q, k, v, cu_q, cu_k = make_varlen(rng, q_lens, k_lens)
    k_cache, v_cache, block_table, seqused_k = to_paged(rng, k, v, cu_k, page_size)
    out, lse = sp.attention(q, k_cache, v_cache, cu_q, None, max(q_lens), max(k_lens), block_table=block_table,
                            seqused_k=seqused_k, return_lse=True)
    check(out, lse, *naive.attention(q, k, v, cu_q, cu_k))
    dense = sp.attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens))
    np.testing.assert_allclose(out, dense, atol=1e-5, rtol=0)


def test_paged_window(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [30, 8], [80, 8])
    k_cache, v_cache, bt, used = to_paged(rng, k, v, cu_k, 16)
    out = sp.attention(q, k_cache, v_cache, cu_q, None, 30, 80, window=(10, 2), block_table=bt, seqused_k=used)
    np.testing.assert_allclose(out, naive.attention(q, k, v, cu_q, cu_k, window=(10, 2))[0], atol=ATOL, rtol=0)


def test_rows_without_keys(rng):
    # causal with Lq > Lk: the first Lq - Lk rows see nothing; an Lk = 0 sequence sees nothing at all
    q, k, v, cu_q, cu_k = make_varlen(rng, [10, 4], [3, 0])
    out, lse = sp.attention(q, k, v, cu_q, cu_k, 10, 3, return_lse=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[:7], 0)
    assert np.all(lse[:, :7] == -np.inf)
    assert np.all(np.isfinite(lse[:, 7:10]))
    np.testing.assert_array_equal(out[10:], 0)
    assert np.all(lse[:, 10:] == -np.inf)
    check(out, lse, *naive.attention(q, k, v, cu_q, cu_k))


def test_window_empties_rows(rng):
    # non-causal, window (-1, 0), Lq > Lk: the first Lq - Lk rows have their diagonal before the first key
    q, k, v, cu_q, cu_k = make_varlen(rng, [8], [4])
    out, lse = sp.attention(q, k, v, cu_q, cu_k, 8, 4, causal=False, window=(-1, 0), return_lse=True)
    assert np.all(lse[:, :4] == -np.inf) and np.all(out[:4] == 0)
    check(out, lse, *naive.attention(q, k, v, cu_q, cu_k, causal=False, window=(-1, 0)))


def test_out_in_place(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [12, 30], [20, 30])
    buf = np.full_like(q, np.nan)
    res, lse = sp.attention(q, k, v, cu_q, cu_k, 30, 30, out=buf, return_lse=True)
    assert res is buf
    np.testing.assert_allclose(buf, naive.attention(q, k, v, cu_q, cu_k)[0], atol=ATOL, rtol=0)
    res2 = sp.attention(q, k, v, cu_q, cu_k, 30, 30, out=buf)
    assert res2 is buf


def test_workspace_is_accepted_and_ignored_on_cpu(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [3, 40], [300, 41])
    ref = sp.attention(q, k, v, cu_q, cu_k, 40, 300)
    got = sp.attention(q, k, v, cu_q, cu_k, 40, 300, workspace=np.zeros(16, np.int32))
    assert np.array_equal(got, ref)
    assert sp.attention_workspace_bytes(128) >= 0   # 0 without a CUDA build, ~35 MB on an H200
    for bad in (0, -128, 77, 256):
        with pytest.raises(ValueError, match="^head_dim: unsupported head dim"):
            sp.attention_workspace_bytes(bad)


def test_head_dims_are_what_every_call_takes(rng):
    """sp.HEAD_DIMS (the library's one list, read by the engine adapters) is exactly what a call accepts, and the
    error for any other head dim names the list."""
    assert sp.HEAD_DIMS == (64, 128)
    supported = ", ".join(map(str, sp.HEAD_DIMS))
    for d in (16, 32, 48, 64, 96, 128, 160, 256):
        q, k, v, cu_q, cu_k = make_varlen(rng, [5], [9], d=d)
        if d in sp.HEAD_DIMS:
            assert np.isfinite(sp.attention(q, k, v, cu_q, cu_k, 5, 9)).all()
        else:
            with pytest.raises(ValueError, match=rf"^q: unsupported head dim {d} \(supported: {supported}\)"):
                sp.attention(q, k, v, cu_q, cu_k, 5, 9)


def test_out_strided_view(rng):
    # out may be a view with strided leading dimensions as long as the last one is contiguous
    q, k, v, cu_q, cu_k = make_varlen(rng, [12], [20], hq=2, hkv=1)
    big = np.zeros((12, 4, 64), np.float32)
    view = big[:, ::2]
    res = sp.attention(q, k, v, cu_q, cu_k, 12, 20, out=view)
    assert res is view
    np.testing.assert_allclose(big[:, ::2], naive.attention(q, k, v, cu_q, cu_k)[0], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(big[:, 1::2], 0)


def test_strided_inputs(rng):
    # q and k/v slices with non-unit head strides (last dimension contiguous)
    q, k, v, cu_q, cu_k = make_varlen(rng, [16], [24], hq=8, hkv=4)
    qs, ks, vs = q[:, ::2], k[:, ::2], v[:, ::2]
    out = sp.attention(qs, ks, vs, cu_q, cu_k, 16, 24)
    ref = naive.attention(np.ascontiguousarray(qs), np.ascontiguousarray(ks), np.ascontiguousarray(vs), cu_q, cu_k)
    np.testing.assert_allclose(out, ref[0], atol=ATOL, rtol=0)


def test_readonly_inputs(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [9], [9])
    for a in (q, k, v, cu_q, cu_k):
        a.flags.writeable = False
    out = sp.attention(q, k, v, cu_q, cu_k, 9, 9)
    np.testing.assert_allclose(out, naive.attention(q, k, v, cu_q, cu_k)[0], atol=ATOL, rtol=0)


def test_float16(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [20, 50], [64, 50], dtype=np.float16)
    out, lse = sp.attention(q, k, v, cu_q, cu_k, 50, 64, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    ref_out, ref_lse = naive.attention(q, k, v, cu_q, cu_k)
    np.testing.assert_allclose(out.astype(np.float64), ref_out, atol=2e-3, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-3, rtol=0)


class DLPackOnly:
    """A minimal foreign DLPack producer (not numpy, torch, cupy or jax)."""

    def __init__(self, a):
        self._a = a
        self.shape = a.shape
        self.dtype = a.dtype

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_generic_dlpack_producer(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [9, 4], [9, 12])
    wrapped = [DLPackOnly(a) for a in (q, k, v, cu_q, cu_k)]
    out = sp.attention(*wrapped, 9, 12)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, naive.attention(q, k, v, cu_q, cu_k)[0], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# torch on the CPU (skipped when torch is not installed)
# ---------------------------------------------------------------------------------------------------------------------

def test_torch_cpu(rng):
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = make_varlen(rng, [20, 7], [30, 40])
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    tcq, tck = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    out, lse = sp.attention(tq, tk, tv, tcq, tck, 20, 40, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.device.type == "cpu"
    check(out.numpy(), lse.numpy(), *naive.attention(q, k, v, cu_q, cu_k))
    buf = torch.empty_like(tq)
    assert sp.attention(tq, tk, tv, tcq, tck, 20, 40, out=buf) is buf
    np.testing.assert_array_equal(buf.numpy(), out.numpy())
    # tensors that require grad are read through detach()
    out2 = sp.attention(tq.clone().requires_grad_(True), tk, tv, tcq, tck, 20, 40)
    np.testing.assert_array_equal(out2.numpy(), out.numpy())


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_torch_cpu_half(rng, dtype_name):
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)
    q, k, v, cu_q, cu_k = make_varlen(rng, [20, 33], [30, 40])
    tq, tk, tv = (torch.from_numpy(a).to(dtype) for a in (q, k, v))
    out = sp.attention(tq, tk, tv, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 33, 40)
    assert out.dtype == dtype
    ref = naive.attention(*(x.float().numpy() for x in (tq, tk, tv)), cu_q, cu_k)[0]
    np.testing.assert_allclose(out.float().numpy(), ref, atol=2e-2 if dtype_name == "bfloat16" else 2e-3, rtol=0)


def test_torch_paged(rng):
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = make_varlen(rng, [10, 3], [70, 20])
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, 16)
    t = torch.from_numpy
    out = sp.attention(t(q), t(kc), t(vc), t(cu_q), None, 10, 70, block_table=t(bt), seqused_k=t(used))
    np.testing.assert_allclose(out.numpy(), naive.attention(q, k, v, cu_q, cu_k)[0], atol=ATOL, rtol=0)

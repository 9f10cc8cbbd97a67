"""FP8 inputs as uint8 bit patterns (qkv_dtype='float8_e4m3fn', for array libraries without float8): the CPU results
equal those of torch float8_e4m3fn tensors holding the same bits, bit for bit, for every public function; the
bfloat16 output comes back as uint16 bit patterns. The numpy quantize_fp8 and its e4m3 cast against torch's cast.
The errors of bad qkv_dtype calls."""

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import sparse_prefill as sp  # noqa: E402
from sparse_prefill.fp8 import _e4m3_bits  # noqa: E402
from conftest import to_paged  # noqa: E402

F8 = torch.float8_e4m3fn
E4M3 = "float8_e4m3fn"
BF16_NAN = 0x7FC0  # poisons uint16 outputs


def _codes(rng, shape):
    """Random e4m3 bit patterns, every finite code (subnormals, -0) possible; NaN codes (0x7F, 0xFF) left out."""
    c = rng.integers(0, 254, shape).astype(np.uint8)
    return np.where(c >= 0x7F, c + 1, c).astype(np.uint8)


def _t(x):
    """The torch twin of a numpy argument: uint8 bits as float8_e4m3fn, other arrays as they are."""
    if isinstance(x, np.ndarray):
        t = torch.from_numpy(x if x.flags.writeable else x.copy())
        return t.view(F8) if x.dtype == np.uint8 else t
    return x


def _bits(t):
    """A torch bfloat16 tensor's bit patterns as a numpy uint16 array."""
    assert t.dtype == torch.bfloat16
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _problem(rng, q_lens, k_lens, hq=6, hkv=3, d=64):
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q = _codes(rng, (cu_q[-1], hq, d))
    k, v = _codes(rng, (cu_k[-1], hkv, d)), _codes(rng, (cu_k[-1], hkv, d))
    B = len(q_lens)
    ds = tuple(rng.uniform(0.002, 0.02, (B, hkv)).astype(np.float32) for _ in range(3))
    return q, k, v, cu_q, cu_k, ds


def _paged(rng, k, v, cu_k, page_size):
    """A paged copy of contiguous bit arrays: shuffled pages, spare pages of NaN codes (read, they would NaN the
    output), a block_table padded with -1."""
    return to_paged(rng, k, v, cu_k, page_size, extra_pages=2, fill=0x7F)


def _both(fn, *args, **kw):
    """fn on the numpy uint8 arguments with qkv_dtype, and on their torch float8 twins without it (an `out` only
    for the numpy call: the torch call allocates its bfloat16 output)."""
    got = fn(*args, qkv_dtype=E4M3, **kw)
    ref = fn(*(_t(a) for a in args), **{n: _t(x) for n, x in kw.items() if n != "out"})
    return got, ref


def _descales(ds):
    return dict(q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])


# ---------------------------------------------------------------------------------------------------------------------
# numpy uint8 == torch float8, bit for bit
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (True, (19, 0)), (False, (5, 7))])
def test_attention_numpy_bits_equal_torch_fp8(rng, causal, window):
    q, k, v, cu_q, cu_k, ds = _problem(rng, [1, 37, 70], [5, 37, 101])
    # non-contiguous q and k: the bit view keeps the strides
    q_wide = _codes(rng, (q.shape[0], 2 * q.shape[1], q.shape[2]))
    q_wide[:, ::2] = q
    qs = q_wide[:, ::2]
    k_wide = _codes(rng, (k.shape[0], k.shape[1] + 1, k.shape[2]))
    k_wide[:, 1:] = k
    ks = k_wide[:, 1:]
    assert not qs.flags.c_contiguous and not ks.flags.c_contiguous
    out = np.full(q.shape, BF16_NAN, np.uint16)
    kw = dict(causal=causal, window=window, return_lse=True, **_descales(ds))
    got, lse = sp.attention(qs, ks, v, cu_q, cu_k, 70, 101, out=out, qkv_dtype=E4M3, **kw)
    assert got is out and out.dtype == np.uint16
    ref, ref_lse = sp.attention(_t(q), _t(k), _t(v), _t(cu_q), _t(cu_k), 70, 101, **{n: _t(x) for n, x in kw.items()})
    assert not torch.isnan(ref).any()
    np.testing.assert_array_equal(got, _bits(ref))
    np.testing.assert_array_equal(lse, ref_lse.numpy())
    # the output the library allocates: uint16 bit patterns, the same
    alloc = sp.attention(q, k, v, cu_q, cu_k, 70, 101, qkv_dtype=E4M3, causal=causal, window=window, **_descales(ds))
    assert isinstance(alloc, np.ndarray) and alloc.dtype == np.uint16
    np.testing.assert_array_equal(alloc, got)


def test_attention_descales_default_broadcast_and_spellings(rng):
    q, k, v, cu_q, cu_k, ds = _problem(rng, [9, 24], [30, 24], hq=4, hkv=2)
    # no descales (1), and a per-tensor descale broadcast with stride 0 (read-only numpy view)
    per_tensor = np.broadcast_to(np.float32(0.01), (2, 2))
    for kw in (dict(), dict(k_descale=per_tensor), dict(v_descale=ds[2], q_descale=per_tensor)):
        got, ref = _both(sp.attention, q, k, v, cu_q, cu_k, 24, 30, **kw)
        np.testing.assert_array_equal(got, _bits(ref))
    # qkv_dtype spelled as torch's dtype: the same call
    a = sp.attention(q, k, v, cu_q, cu_k, 24, 30, qkv_dtype=E4M3, **_descales(ds))
    b = sp.attention(q, k, v, cu_q, cu_k, 24, 30, qkv_dtype=torch.float8_e4m3fn, **_descales(ds))
    np.testing.assert_array_equal(a, b)
    # out= may also be bfloat16 where the library has it (torch uint8 tensors here), and torch uint8 tensors
    # give uint16 outputs like numpy's
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    td = {n: torch.from_numpy(x) for n, x in _descales(ds).items()}
    bf = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    sp.attention(tq, tk, tv, _t(cu_q), _t(cu_k), 24, 30, out=bf, qkv_dtype=E4M3, **td)
    np.testing.assert_array_equal(_bits(bf), a)
    t16 = sp.attention(tq, tk, tv, _t(cu_q), _t(cu_k), 24, 30, qkv_dtype=E4M3, **td)
    assert t16.dtype == torch.uint16
    np.testing.assert_array_equal(t16.view(torch.int16).numpy().view(np.uint16), a)


def test_any_dlpack_producer_takes_the_bit_path(rng):
    # an array library the package does not know (a bare DLPack producer): read through numpy, numpy outputs
    class Producer:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    q, k, v, cu_q, cu_k, ds = _problem(rng, [13], [21], hq=2, hkv=1)
    got = sp.attention(*(Producer(x) for x in (q, k, v, cu_q, cu_k)), 13, 21, qkv_dtype=E4M3,
                       **{n: Producer(x) for n, x in _descales(ds).items()})
    ref = sp.attention(q, k, v, cu_q, cu_k, 13, 21, qkv_dtype=E4M3, **_descales(ds))
    assert isinstance(got, np.ndarray) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_attention_numpy_bits_equal_torch_fp8(rng, page_size):
    q, k, v, cu_q, cu_k, ds = _problem(rng, [3, 45], [70, 129])
    kc, vc, bt, used = _paged(rng, k, v, cu_k, page_size)
    out = np.full(q.shape, BF16_NAN, np.uint16)
    got, ref = _both(sp.attention, q, kc, vc, cu_q, None, 45, 129, block_table=bt, seqused_k=used, out=out,
                     **_descales(ds))
    assert got is out
    np.testing.assert_array_equal(got, _bits(ref))
    # and the paged call equals the contiguous one
    flat = sp.attention(q, k, v, cu_q, cu_k, 45, 129, qkv_dtype=E4M3, **_descales(ds))
    np.testing.assert_array_equal(got, flat)


def _sparse_problem(rng):
    """FP8 bits of a structured workload (numpy quantize_fp8): two sequences, a chunk of queries in the first."""
    seqs = [sp.workload.structured(L, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=int(rng.integers(1 << 30)))
            for L in (450, 333)]
    q = np.concatenate([seqs[0][0][150:], seqs[1][0]])
    k, v = (np.concatenate([s[i] for s in seqs]) for i in (1, 2))
    cu_q, cu_k = np.array([0, 300, 633], np.int32), np.array([0, 450, 783], np.int32)
    (q8, dq), (k8, dk), (v8, dv) = (sp.quantize_fp8(x, batch=2, num_kv_heads=2) for x in (q, k, v))
    return q8, k8, v8, cu_q, cu_k, (dq, dk, dv)


_SEL = dict(alpha=0.1, block_size=64, sink=64, window=64, last_n=1, dense_fraction=1.0)  # the raw selection


def _same_index(a, b):
    assert a.kept_blocks == b.kept_blocks and a.visible_blocks == b.visible_blocks
    for name in sp.Index._ARRAYS:
        np.testing.assert_array_equal(a.host[name], b.host[name], err_msg=name)


@pytest.mark.parametrize("correction, union, rule", [(False, False, "row_max"), (True, False, "tile_energy"),
                                                     (False, True, "probe_row_max")])
def test_index_and_sparse_numpy_bits_equal_torch_fp8(rng, correction, union, rule):
    q, k, v, cu_q, cu_k, ds = _sparse_problem(rng)
    kw = dict(_SEL, correction=correction, union=union, rule=rule, **_descales(ds))
    i_np, i_t = _both(sp.build_index, q, k, v, cu_q, cu_k, 333, 450, **kw)
    assert 0 < i_np.density < 1 or union
    _same_index(i_np, i_t)
    out = np.full(q.shape, BF16_NAN, np.uint16)
    got, ref = _both(sp.sparse_attention, q, k, v, i_np, cu_q, cu_k, 333, 450, out=out, **_descales(ds))
    assert got is out
    np.testing.assert_array_equal(got, _bits(ref))
    (got_p, lse_p, idx_p), (ref_p, ref_lse, _) = _both(sp.sparse_prefill, q, k, v, cu_q, cu_k, 333, 450,
                                                       return_lse=True, return_index=True, **kw)
    _same_index(idx_p, i_np)
    np.testing.assert_array_equal(got_p, _bits(ref_p))
    np.testing.assert_array_equal(lse_p, ref_lse.numpy())
    one = sp.sparse_prefill(q, k, v, cu_q, cu_k, 333, 450, qkv_dtype=E4M3, **kw)
    np.testing.assert_array_equal(one, got_p)
    np.testing.assert_array_equal(got, got_p)  # build_index + sparse_attention = sparse_prefill


def test_paged_index_union_pool_and_shape_functions(rng):
    q, k, v, cu_q, cu_k, ds = _sparse_problem(rng)
    kc, vc, bt, used = _paged(rng, k, v, cu_k, 32)
    paged = dict(block_table=bt, seqused_k=used)
    i_np, i_t = _both(sp.build_index, q, kc, vc, cu_q, None, 333, 450, **paged, **_SEL, **_descales(ds))
    _same_index(i_np, i_t)
    u_np, u_t = _both(sp.union_index, i_np, q, kc, vc, cu_q, None, 333, 450, **paged)
    _same_index(u_np, u_t)
    for got, ref in zip(*_both(sp.pool_kv, k, v, cu_k, 64)):
        np.testing.assert_array_equal(got, ref.numpy())
    for got, ref in zip(*_both(sp.pool_kv, kc, vc, None, 64, 450, **paged)):
        np.testing.assert_array_equal(got, ref.numpy())
    assert sp.attention_path(q, k, v, cu_q, cu_k, 333, 450, qkv_dtype=E4M3) == "dense"
    shape_fns = [(sp.index_workspace_bytes, (q, k, v, cu_q, cu_k, 333, 450)),
                 (sp.sparse_prefill_workspace_bytes, (q, k, v, cu_q, cu_k, 333, 450)),
                 (sp.sparse_attention_workspace_bytes, (q, k, v, i_np, cu_q, cu_k, 333, 450)),
                 (sp.chunked_prefill_workspace_bytes, (q[:40], kc, vc, np.array([0, 20, 40], np.int32), bt, used,
                                                       20, 450))]
    for fn, args in shape_fns:
        assert fn(*args, qkv_dtype=E4M3) == 0  # CPU arrays
        with pytest.raises(TypeError, match="^q: dtype must be .*got uint8"):
            fn(*args)


@pytest.mark.parametrize("final_chunk, union", [(True, False), (False, True)])
def test_chunked_prefill_numpy_bits_equal_torch_fp8(rng, final_chunk, union):
    q, k, v, cu_q, cu_k, ds = _sparse_problem(rng)
    kc, vc, bt, used = _paged(rng, k, v, cu_k, 64)
    # a chunk of the last 37 queries of sequence 0 and the last one of sequence 1
    qc = np.concatenate([q[300 - 37:300], q[-1:]])
    cu_c = np.array([0, 37, 38], np.int32)
    kw = dict(final_chunk=final_chunk, union=union, **_SEL, **_descales(ds))
    out = np.full(qc.shape, BF16_NAN, np.uint16)
    got, ref = _both(sp.chunked_prefill, qc, kc, vc, cu_c, bt, used, 37, 450, out=out, **kw)
    assert got is out
    np.testing.assert_array_equal(got, _bits(ref))
    # with the pooled-means cache: the same output, and the same cache written
    m_np, m_t = sp.mean_cache(kc, 64), sp.mean_cache(_t(kc), 64)
    a = sp.chunked_prefill(qc, kc, vc, cu_c, bt, used, 37, 450, mean_cache=m_np, qkv_dtype=E4M3, **kw)
    b = sp.chunked_prefill(_t(qc), _t(kc), _t(vc), _t(cu_c), _t(bt), _t(used), 37, 450, mean_cache=m_t,
                           **{n: _t(x) for n, x in kw.items()})
    np.testing.assert_array_equal(a, _bits(b))
    for x, y in zip(m_np, m_t):
        np.testing.assert_array_equal(x, y.numpy())


def test_numpy_quantize_then_attention_equals_torch(rng):
    x = [rng.standard_normal((n, h, 64)).astype(np.float32) for n, h in ((31, 4), (57, 2), (57, 2))]
    cu_q, cu_k = np.array([0, 31], np.int32), np.array([0, 57], np.int32)
    qn = [sp.quantize_fp8(a, num_kv_heads=2) for a in x]
    qt = [sp.quantize_fp8(torch.from_numpy(a), num_kv_heads=2) for a in x]
    got = sp.attention(*(b for b, _ in qn), cu_q, cu_k, 31, 57, qkv_dtype=E4M3,
                       **_descales([d for _, d in qn]))
    ref = sp.attention(*(b for b, _ in qt), _t(cu_q), _t(cu_k), 31, 57, **_descales([d for _, d in qt]))
    np.testing.assert_array_equal(got, _bits(ref))
    # the float32 values of the bits (the conversion the docs give)
    np.testing.assert_array_equal((got.astype(np.uint32) << 16).view(np.float32), ref.float().numpy())


def test_the_numpy_path_needs_no_torch():
    # a numpy-only user: torch cannot be imported at all
    code = """
import sys
sys.modules["torch"] = None
import numpy as np
import sparse_prefill as sp
rng = np.random.default_rng(0)
x = [rng.standard_normal((n, h, 64)).astype(np.float32) for n, h in ((12, 4), (12, 2), (12, 2))]
(q, dq), (k, dk), (v, dv) = (sp.quantize_fp8(a, batch=2, num_kv_heads=2) for a in x)
cu = np.array([0, 5, 12], np.int32)
out = sp.sparse_prefill(q, k, v, cu, cu, 7, 7, qkv_dtype="float8_e4m3fn", q_descale=dq, k_descale=dk, v_descale=dv)
f = (out.astype(np.uint32) << 16).view(np.float32)
ref = sp.attention(*x, cu, cu, 7, 7)
err = np.abs(f - ref).mean() / np.abs(ref).mean()  # e4m3 keeps 3 mantissa bits: a few % (measured 3 %)
assert out.dtype == np.uint16 and q.dtype == np.uint8 and err < 0.1, err
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(sp.__file__)))] + os.environ.get("PYTHONPATH", "").split(
            os.pathsep)))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# ---------------------------------------------------------------------------------------------------------------------
# the numpy e4m3 cast and quantize_fp8
# ---------------------------------------------------------------------------------------------------------------------

def _torch_cast(x):
    """torch's cast of x saturated to +-448 (torch 2.11 turns |x| >= 464 into NaN, 2.15 saturates: clamping first
    makes the reference the same in both; NaN stays NaN)."""
    x = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    return x.clamp(-448.0, 448.0).to(F8).view(torch.uint8).numpy()


def test_e4m3_cast_every_code_round_trips():
    codes = np.arange(256, dtype=np.uint8)
    values = torch.from_numpy(codes).view(F8).float().numpy()
    np.testing.assert_array_equal(_e4m3_bits(values), codes)  # NaN codes included: 0x7F, 0xFF
    np.testing.assert_array_equal(_torch_cast(values), codes)


def test_e4m3_cast_equals_torch_on_ties_edges_and_random_floats(rng):
    codes = np.arange(256, dtype=np.uint8)
    finite = np.unique(torch.from_numpy(codes).view(F8).float().numpy())
    finite = finite[np.isfinite(finite)]
    mid64 = (finite[1:].astype(np.float64) + finite[:-1]) / 2
    mid = mid64.astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), mid64)  # exact ties (5 significant bits)
    up, down = np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))
    edges = np.array([448, 449, 463.9, 464, 464.1, 479, 480, 481, 1e4, 3e38, np.inf, -np.inf, np.nan, -np.nan,
                      2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 2.0 ** -10 * 1.0001, 2.0 ** -11, 3 * 2.0 ** -11, 1e-30, 1e-45,
                      0.0, -0.0], np.float32)
    edges = np.concatenate([edges, -edges])
    scales = np.float32(2.0) ** rng.integers(-14, 12, 200_000).astype(np.float32)
    rand = rng.standard_normal(200_000).astype(np.float32) * scales
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)  # any float32
    with np.errstate(all="raise"):
        for x in (mid, -mid, up, down, -up, -down, edges, rand, bits):
            np.testing.assert_array_equal(_e4m3_bits(x), _torch_cast(x))
    assert _e4m3_bits(np.float32(1e6)) == 0x7E and _e4m3_bits(np.float32(-np.inf)) == 0xFE  # saturation
    assert _e4m3_bits(np.full((2, 3), 1.0, np.float32)).shape == (2, 3)


@pytest.mark.parametrize("shape, hkv, per_head, dtype", [
    ((37, 6, 64), 3, True, np.float32), ((37, 6, 64), None, False, np.float32), ((9, 16, 2, 64), 2, True, np.float16),
    ((20, 4, 128), 1, True, np.float64), ((5, 3, 64), None, True, np.float32)])
def test_quantize_fp8_numpy_equals_torch(rng, shape, hkv, per_head, dtype):
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, (1,) * (len(shape) - 2) + (shape[-2], 1)))
    x = x.astype(dtype)
    x.reshape(-1)[:3] = 0
    b8, d = sp.quantize_fp8(x, batch=3, num_kv_heads=hkv, per_head=per_head)
    t8, td = sp.quantize_fp8(torch.from_numpy(x), batch=3, num_kv_heads=hkv, per_head=per_head)
    assert isinstance(b8, np.ndarray) and b8.dtype == np.uint8 and b8.shape == x.shape
    assert d.dtype == np.float32 and d.shape == tuple(td.shape) and d.strides[0] == 0
    np.testing.assert_array_equal(b8, t8.view(torch.uint8).numpy())
    np.testing.assert_array_equal(d, td.numpy())


def test_quantize_fp8_numpy_zeros_and_nan():
    z8, dz = sp.quantize_fp8(np.zeros((4, 2, 64), np.float32))
    assert np.all(z8 == 0) and np.all(np.isfinite(dz))
    x = np.ones((4, 2, 64), np.float32)
    x[1, 1, 3] = np.nan
    _, dn = sp.quantize_fp8(x)
    assert np.isfinite(dn[0, 0]) and np.isnan(dn[0, 1])


@pytest.mark.parametrize("x, exc", [
    ([[[1.0]]], TypeError), (np.zeros((4, 2, 64), np.int32), TypeError), (np.zeros((4, 2, 64), np.uint8), TypeError),
    (np.zeros((4, 64), np.float32), ValueError)])
def test_quantize_fp8_numpy_errors(x, exc):
    with pytest.raises(exc, match="^x:"):
        sp.quantize_fp8(x)


# ---------------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------------

def _small(rng):
    q, k, v, cu_q, cu_k, ds = _problem(rng, [4, 6], [4, 6], hq=4, hkv=2)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("value", ["float8_e5m2", "fp8", "e4m3", "uint8", 8, np.float32, "bfloat16"])
def test_bad_qkv_dtype_values(rng, value):
    q, k, v, cu_q, cu_k = _small(rng)
    with pytest.raises(ValueError, match="^qkv_dtype: expected None or 'float8_e4m3fn'"):
        sp.attention(q, k, v, cu_q, cu_k, 6, 6, qkv_dtype=value)
    with pytest.raises(ValueError, match="^qkv_dtype:"):
        sp.attention(q, k, v, cu_q, cu_k, 6, 6, qkv_dtype=getattr(torch, str(value), value))


def test_uint8_without_qkv_dtype_keeps_its_errors(rng):
    q, k, v, cu_q, cu_k = _small(rng)
    f = np.zeros(q.shape, np.float32)
    with pytest.raises(TypeError, match=r"^q: dtype must be float16, bfloat16, float32 or float8_e4m3fn, got uint8 "
                                        r"\(for uint8 arrays of float8_e4m3fn bit patterns pass "
                                        r"qkv_dtype='float8_e4m3fn'\)") as e:
        sp.attention(q, k, v, cu_q, cu_k, 6, 6)
    assert e.value.argument == "q"
    with pytest.raises(TypeError, match="^k: dtype uint8 does not match q's float32"):
        sp.attention(f, k, v.astype(np.float32), cu_q, cu_k, 6, 6)
    with pytest.raises(TypeError, match="^out: unsupported dtype uint16"):  # uint16 out: bits only with qkv_dtype
        sp.attention(f, k.astype(np.float32), v.astype(np.float32), cu_q, cu_k, 6, 6,
                     out=np.zeros(q.shape, np.uint16))
    with pytest.raises(TypeError, match="^q: dtype must be .*got uint8"):
        sp.build_index(q, k, v, cu_q, cu_k, 6, 6)
    # workspaces are still any dtype, uint8 included (CPU: ignored)
    ok = sp.attention(q, k, v, cu_q, cu_k, 6, 6, qkv_dtype=E4M3, workspace=np.zeros(256, np.uint8))
    assert ok.dtype == np.uint16


_FNS = {
    "attention": lambda q, k, v, cu_q, cu_k, **kw: sp.attention(q, k, v, cu_q, cu_k, 6, 6, **kw),
    "build_index": lambda q, k, v, cu_q, cu_k, **kw: sp.build_index(q, k, v, cu_q, cu_k, 6, 6, **kw),
    "sparse_prefill": lambda q, k, v, cu_q, cu_k, **kw: sp.sparse_prefill(q, k, v, cu_q, cu_k, 6, 6, **kw),
    "sparse_prefill_index": lambda q, k, v, cu_q, cu_k, **kw: sp.sparse_prefill(q, k, v, cu_q, cu_k, 6, 6,
                                                                                  return_index=True, **kw),
    "chunked_prefill": lambda q, k, v, cu_q, cu_k, **kw: sp.chunked_prefill(
        q, k.reshape(5, 2, *k.shape[1:]), v.reshape(5, 2, *v.shape[1:]), cu_q, np.array([[0, 1, -1], [2, 3, 4]],
                                                                                        np.int32),
        np.array([4, 6], np.int32), 6, 6, final_chunk=True, **kw),
    "attention_path": lambda q, k, v, cu_q, cu_k, **kw: sp.attention_path(q, k, v, cu_q, cu_k, 6, 6, **kw),
    "index_workspace_bytes": lambda q, k, v, cu_q, cu_k, **kw: sp.index_workspace_bytes(q, k, v, cu_q, cu_k, 6, 6,
                                                                                        **kw),
    "pool_kv": lambda q, k, v, cu_q, cu_k, **kw: sp.pool_kv(k, v, cu_k, 64, **kw),
}


def _mixed_cases(rng):
    q, k, v, cu_q, cu_k = _small(rng)
    b16 = lambda x: x.astype(np.float16)  # noqa: E731
    return [
        ("q", dict(q=b16(q))),                                     # qkv_dtype with non-uint8 q
        ("k", dict(k=b16(k))),                                     # uint8 q, float16 k
        ("v", dict(v=v.astype(np.float32))),                       # uint8 q and k, float32 v
        ("k", dict(k=k.astype(np.int8))),
    ], (q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("fn", sorted(_FNS))
def test_qkv_dtype_with_non_uint8_arrays_names_the_array(rng, fn):
    cases, (q, k, v, cu_q, cu_k) = _mixed_cases(rng)
    for name, change in cases:
        if fn == "pool_kv" and name == "q":
            continue  # pool_kv takes no q
        args = dict(q=q, k=k, v=v)
        args.update(change)
        dt = str(change[name].dtype)
        with pytest.raises(TypeError, match=f"^{name}: dtype {dt} is not uint8: qkv_dtype='float8_e4m3fn' takes "
                                            "q, k and v as uint8 arrays") as e:
            _FNS[fn](args["q"], args["k"], args["v"], cu_q, cu_k, qkv_dtype=E4M3)
        assert e.value.argument == name
    # and the same call with uint8 arrays runs
    _FNS[fn](q, k, v, cu_q, cu_k, qkv_dtype=E4M3)


def test_qkv_dtype_with_torch_arrays(rng):
    q, k, v, cu_q, cu_k = (torch.from_numpy(x) for x in _small(rng))
    with pytest.raises(TypeError, match="^q: dtype float8_e4m3fn is not uint8: .*needs no qkv_dtype"):
        sp.attention(q.view(F8), k.view(F8), v.view(F8), cu_q, cu_k, 6, 6, qkv_dtype=E4M3)
    with pytest.raises(TypeError, match="^k: dtype float8_e4m3fn is not uint8"):
        sp.attention(q, k.view(F8), v, cu_q, cu_k, 6, 6, qkv_dtype=E4M3)
    with pytest.raises(TypeError, match="^v: dtype bfloat16 is not uint8"):
        sp.attention(q, k, v.to(torch.bfloat16), cu_q, cu_k, 6, 6, qkv_dtype=E4M3)
    with pytest.raises(TypeError, match="^out: dtype float16 must be uint16 .*or bfloat16"):
        sp.attention(q, k, v, cu_q, cu_k, 6, 6, qkv_dtype=E4M3, out=torch.empty(q.shape, dtype=torch.float16))


def test_qkv_dtype_bad_outputs_shapes_and_descales(rng):
    q, k, v, cu_q, cu_k = _small(rng)
    call = lambda *a, **kw: sp.attention(*a, cu_q, cu_k, 6, 6, qkv_dtype=E4M3, **kw)  # noqa: E731
    for dt in (np.float32, np.uint8, np.int16):
        with pytest.raises(TypeError, match=f"^out: dtype {np.dtype(dt).name} must be uint16 \\(bfloat16 bit "
                                            "patterns\\) or bfloat16 for qkv_dtype='float8_e4m3fn' inputs"):
            call(q, k, v, out=np.zeros(q.shape, dt))
    with pytest.raises(ValueError, match=r"^out: shape \[10, 4, 32\] must equal q's shape \[10, 4, 64\]"):
        call(q, k, v, out=np.zeros((10, 4, 32), np.uint16))
    ro = np.zeros(q.shape, np.uint16)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="^out: expected a writable array"):
        call(q, k, v, out=ro)
    with pytest.raises(ValueError, match="^q: expected a 3-dimensional array"):
        call(q[:, 0], k, v)
    with pytest.raises(ValueError, match="^k: the number of query heads"):
        call(q, np.zeros((10, 3, 64), np.uint8), np.zeros((10, 3, 64), np.uint8))
    with pytest.raises(ValueError, match="^v: shape"):
        call(q, k, v[:, :, :32])
    with pytest.raises(ValueError, match="^k_descale: expected shape \\[2, 2\\]"):
        call(q, k, v, k_descale=np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="^q_descale: unsupported dtype float64"):  # numpy's default float
        call(q, k, v, q_descale=np.ones((2, 2)))
    with pytest.raises(ValueError, match="^block_table: chunked_prefill runs over a paged KV cache"):
        sp.chunked_prefill(q, k, v, cu_q, None, None, 6, 6, final_chunk=True, qkv_dtype=E4M3)

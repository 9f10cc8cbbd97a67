"""FP8 (float8_e4m3fn) inputs with per-(sequence, KV head) descales on the CPU reference, quantize_fp8, and the
errors of bad FP8 arguments; on CUDA the dense FP8 kernel (head dim 128, contiguous or TMA-paged KV) against the CPU
oracle, FA3's self-calibrating rule and a 32K needle workload, and the combinations that are not built (head dim 64,
the cp.async page gather) raising NotImplementedError. The FP8 index stage and block-sparse kernel:
test_fp8_sparse.py."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import sparse_prefill as sp  # noqa: E402
import sp_naive  # noqa: E402
from conftest import make_varlen, to_paged  # noqa: E402

F8 = torch.float8_e4m3fn


def _fp8_call(rng, q_lens, k_lens, hq=4, hkv=2, d=64):
    """FP8 q, k, v with random per-(sequence, KV head) descales, and their float64 dequantised values."""
    q, k, v, cu_q, cu_k = make_varlen(rng, q_lens, k_lens, hq, hkv, d)
    B, g = len(q_lens), hq // hkv
    q8, k8, v8 = (torch.from_numpy(x * 4).to(F8) for x in (q, k, v))
    ds = [torch.from_numpy(rng.uniform(0.05, 0.5, (B, hkv)).astype(np.float32)) for _ in range(3)]
    seq_q = np.repeat(np.arange(B), q_lens)
    seq_k = np.repeat(np.arange(B), k_lens)
    deq_q = q8.double().numpy() * ds[0].double().numpy()[seq_q][:, np.repeat(np.arange(hkv), g), None]
    deq_k = k8.double().numpy() * ds[1].double().numpy()[seq_k][:, :, None]
    deq_v = v8.double().numpy() * ds[2].double().numpy()[seq_k][:, :, None]
    return (q8, k8, v8, torch.from_numpy(cu_q), torch.from_numpy(cu_k)), ds, (deq_q, deq_k, deq_v, cu_q, cu_k)


def test_fp8_attention_is_the_exact_math_on_dequantised_values(rng):
    (q8, k8, v8, cu_q, cu_k), ds, (dq, dk, dv, cq, ck) = _fp8_call(rng, [1, 77, 300], [1, 77, 513])
    out = torch.full(q8.shape, float("nan"), dtype=torch.bfloat16)  # poisoned
    got = sp.attention(q8, k8, v8, cu_q, cu_k, 300, 513, out=out, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    assert got.dtype == torch.bfloat16 and not torch.isnan(got).any()
    ref, _ = sp_naive.attention(dq, dk, dv, cq, ck)
    np.testing.assert_allclose(got.double().numpy(), ref, rtol=2 ** -7, atol=2 ** -7 * np.abs(ref).max())
    # the output allocated by the library is bfloat16 too
    assert sp.attention(q8, k8, v8, cu_q, cu_k, 300, 513, q_descale=ds[0]).dtype == torch.bfloat16


def test_fp8_within_twice_the_naive_fp8_error(rng):
    # FA3's self-calibrating check: against attention on the original values, the library's FP8 result is within
    # twice the error of the plain computation on the FP8-cast values.
    q, k, v, cu_q, cu_k = make_varlen(rng, [200, 33], [200, 400], 8, 2, 128)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    (q8, dq), (k8, dk), (v8, dv) = (sp.quantize_fp8(x, batch=2, num_kv_heads=2) for x in (tq, tk, tv))
    cu_q_t, cu_k_t = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    got = sp.attention(q8, k8, v8, cu_q_t, cu_k_t, 200, 400, q_descale=dq, k_descale=dk, v_descale=dv).double()
    ref, _ = sp_naive.attention(q, k, v, cu_q, cu_k)
    g = 4
    naive, _ = sp_naive.attention(q8.double().numpy() * dq[0].double().numpy()[np.repeat(np.arange(2), g), None],
                               k8.double().numpy() * dk[0].double().numpy()[:, None],
                               v8.double().numpy() * dv[0].double().numpy()[:, None], cu_q, cu_k)
    err, naive_err = np.abs(got.numpy() - ref).max(), np.abs(naive - ref).max()
    assert naive_err > 0 and err <= 2 * naive_err + 1e-3, (err, naive_err)


def test_fp8_descales_broadcast_and_gqa_columns(rng):
    (q8, k8, v8, cu_q, cu_k), _, _ = _fp8_call(rng, [50, 90], [50, 130], hq=6, hkv=3)
    one = torch.ones(2, 3)
    base = sp.attention(q8, k8, v8, cu_q, cu_k, 90, 130).double()
    # stride-0 descales equal the materialised ones, and None means 1
    per_tensor = torch.tensor([0.25]).view(1, 1).expand(2, 3)
    a = sp.attention(q8, k8, v8, cu_q, cu_k, 90, 130, v_descale=per_tensor)
    b = sp.attention(q8, k8, v8, cu_q, cu_k, 90, 130, v_descale=per_tensor.contiguous(), q_descale=one, k_descale=one)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.double(), base * 0.25, rtol=2 ** -7, atol=1e-3)
    # v_descale column c scales exactly the query heads of group c (heads 2c, 2c+1), in sequence b only
    vd = torch.ones(2, 3)
    vd[1, 2] = 2.0
    c = sp.attention(q8, k8, v8, cu_q, cu_k, 90, 130, v_descale=vd).double()
    rows1 = slice(50, 140)
    torch.testing.assert_close(c[rows1, 4:6], base[rows1, 4:6] * 2, rtol=2 ** -7, atol=1e-3)
    assert torch.equal(c[rows1, :4], base[rows1, :4].to(c.dtype)) and torch.equal(c[:50], base[:50])


def test_fp8_paged_equals_contiguous(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [40, 7], [300, 150], 4, 2, 64)
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, 16)
    tq = torch.from_numpy(q)
    (q8, dq) = sp.quantize_fp8(tq, batch=2, num_kv_heads=2)
    (k8, dk), (v8, dv) = (sp.quantize_fp8(torch.from_numpy(x), batch=2) for x in (k, v))
    # the cache quantised with the same scales as the contiguous keys
    kc8 = (torch.from_numpy(kc) / dk[0].view(1, 1, 2, 1)).clamp(-448, 448).to(F8)
    vc8 = (torch.from_numpy(vc) / dv[0].view(1, 1, 2, 1)).clamp(-448, 448).to(F8)
    cu_q_t = torch.from_numpy(cu_q)
    a = sp.attention(q8, k8, v8, cu_q_t, torch.from_numpy(cu_k), 40, 300, q_descale=dq, k_descale=dk, v_descale=dv)
    b = sp.attention(q8, kc8, vc8, cu_q_t, None, 40, 300, block_table=torch.from_numpy(bt),
                     seqused_k=torch.from_numpy(used), q_descale=dq, k_descale=dk, v_descale=dv)
    assert torch.equal(a, b)


def test_fp8_selection_equals_the_float32_dequantised_call(rng):
    # the reference dequantises in float32 on load, so the index of an FP8 call is the index of the float32 call on
    # the dequantised arrays, bit for bit; the sparse output agrees to bfloat16 rounding
    seqs = [sp.workload.structured(L, num_q_heads=4, num_kv_heads=2, head_dim=128, seed=int(rng.integers(1 << 30)))
            for L in (900, 1300)]
    q = np.concatenate([seqs[0][0][200:], seqs[1][0][1040:]])  # a chunk of 700, then 260 queries
    k, v = (np.concatenate([s[i] for s in seqs]) for i in (1, 2))
    cu_q, cu_k = np.array([0, 700, 960], np.int32), np.array([0, 900, 2200], np.int32)
    B = 2
    (q8, dq) = sp.quantize_fp8(torch.from_numpy(q), batch=B, num_kv_heads=2)
    (k8, dk), (v8, dv) = (sp.quantize_fp8(torch.from_numpy(x), batch=B) for x in (k, v))
    deq = lambda x8, d, rep: (x8.float() * d[0].repeat_interleave(rep).view(1, -1, 1))  # noqa: E731
    q32, k32, v32 = deq(q8, dq, 2), deq(k8, dk, 1), deq(v8, dv, 1)
    cu_q_t, cu_k_t = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    kw = dict(alpha=0.1, sink=128, window=256, block_size=128, dense_fraction=1.0)  # the raw selection
    fp8 = dict(q_descale=dq, k_descale=dk, v_descale=dv)
    i8 = sp.build_index(q8, k8, v8, cu_q_t, cu_k_t, 700, 1300, **kw, **fp8)
    i32 = sp.build_index(q32, k32, v32, cu_q_t, cu_k_t, 700, 1300, **kw)
    assert i8.kept_blocks == i32.kept_blocks and 0 < i8.density < 1
    for b in range(B):
        for t in range(int(i8.tiles[b])):
            for h in range(2):
                assert list(i8.segment(b, h, t)) == list(i32.segment(b, h, t))
    for corr in (False, True):
        o8 = sp.sparse_prefill(q8, k8, v8, cu_q_t, cu_k_t, 700, 1300, correction=corr, **kw, **fp8)
        o32 = sp.sparse_prefill(q32, k32, v32, cu_q_t, cu_k_t, 700, 1300, correction=corr, **kw)
        assert o8.dtype == torch.bfloat16
        torch.testing.assert_close(o8.float(), o32, rtol=2 ** -7, atol=1e-3)
        o8s = sp.sparse_attention(q8, k8, v8, i8, cu_q_t, cu_k_t, 700, 1300, **fp8)
        o32s = sp.sparse_attention(q32, k32, v32, i32, cu_q_t, cu_k_t, 700, 1300)
        torch.testing.assert_close(o8s.float(), o32s, rtol=2 ** -7, atol=1e-3)


def test_fp8_chunked_prefill_on_the_cpu(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [400], [400], 4, 2, 128)
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, 64)
    (q8, dq) = sp.quantize_fp8(torch.from_numpy(q), num_kv_heads=2)
    (kc8, dk), (vc8, dv) = (sp.quantize_fp8(torch.from_numpy(x)) for x in (kc, vc))
    full = sp.attention(q8, kc8, vc8, torch.from_numpy(cu_q), None, 400, 400, block_table=torch.from_numpy(bt),
                        seqused_k=torch.from_numpy(used), q_descale=dq, k_descale=dk, v_descale=dv)
    step = sp.chunked_prefill(q8[300:], kc8, vc8, torch.tensor([0, 100], dtype=torch.int32), torch.from_numpy(bt),
                              torch.from_numpy(used), 100, 400, final_chunk=True, alpha=0.0, q_descale=dq,
                              k_descale=dk, v_descale=dv)
    torch.testing.assert_close(step.float(), full[300:].float(), rtol=2 ** -7, atol=1e-3)


def test_quantize_fp8_round_trip_and_layout(rng):
    x = torch.from_numpy(rng.standard_normal((37, 6, 64)).astype(np.float32))
    x[:, 4:] *= 1e4  # one KV group much larger: per-head scales keep the small heads' precision
    x8, d = sp.quantize_fp8(x, batch=3, num_kv_heads=3)
    assert x8.dtype == F8 and x8.shape == x.shape and d.dtype == torch.float32 and d.shape == (3, 3)
    assert d.stride(0) == 0  # broadcast over the batch
    back = x8.float() * d[0].repeat_interleave(2).view(1, 6, 1)
    assert back.abs().max() <= 448 * d.max() * (1 + 1e-6)
    torch.testing.assert_close(back, x, rtol=2 ** -4, atol=float(d.max()) * 2 ** -9 * 2)
    small = (back[:, :4] - x[:, :4]).abs().mean()
    _, d1 = sp.quantize_fp8(x, per_head=False)
    assert d1.shape == (1, 6) and torch.all(d1 == d1[0, 0])
    x8t, _ = sp.quantize_fp8(x, per_head=False)
    # one scale for the tensor puts the small heads among e4m3's subnormals: twice the error
    assert (x8t.float()[:, :4] * d1[0, 0] - x[:, :4]).abs().mean() > 2 * small
    z8, dz = sp.quantize_fp8(torch.zeros(4, 2, 64))
    assert torch.all(z8.float() == 0) and torch.all(torch.isfinite(dz))


@pytest.mark.parametrize("bad, exc, name", [
    (dict(x="not a tensor"), TypeError, "x"),
    (dict(x=[[[0.0] * 64] * 2] * 4), TypeError, "x"),  # numpy arrays: test_fp8_uint8.py
    (dict(x=torch.zeros(4, 64)), ValueError, "x"),
    (dict(x=torch.zeros(4, 2, 64, dtype=torch.int32)), TypeError, "x"),
    (dict(batch=0), ValueError, "batch"),
    (dict(num_kv_heads=3), ValueError, "num_kv_heads"),
])
def test_quantize_fp8_errors(bad, exc, name):
    args = dict(x=torch.zeros(4, 2, 64), batch=1, num_kv_heads=None)
    args.update(bad)
    with pytest.raises(exc, match=f"^{name}:"):
        sp.quantize_fp8(args.pop("x"), **args)


def test_fp8_bad_arguments(rng):
    (q8, k8, v8, cu_q, cu_k), ds, _ = _fp8_call(rng, [20, 30], [20, 30])
    qb = q8.to(torch.bfloat16)
    call = lambda *a, **kw: sp.attention(*a, cu_q, cu_k, 30, 30, **kw)  # noqa: E731
    with pytest.raises(TypeError, match="^k: dtype bfloat16 does not match q's float8_e4m3fn .*mixed FP8"):
        call(q8, k8.to(torch.bfloat16), v8)
    with pytest.raises(TypeError, match="^q_descale: applies to float8_e4m3fn inputs only"):
        call(qb, k8.to(torch.bfloat16), v8.to(torch.bfloat16), q_descale=ds[0])
    with pytest.raises(ValueError, match=r"^k_descale: expected shape \[2, 2\]"):
        call(q8, k8, v8, k_descale=torch.ones(2, 3))
    with pytest.raises(ValueError, match="^v_descale: expected a 2-dimensional array"):
        call(q8, k8, v8, v_descale=torch.ones(2))
    with pytest.raises(TypeError, match="^q_descale: expected dtype float32, got float16"):
        call(q8, k8, v8, q_descale=torch.ones(2, 2, dtype=torch.float16))
    with pytest.raises(TypeError, match="^out: dtype float16 must be bfloat16 for float8_e4m3fn inputs"):
        call(q8, k8, v8, out=torch.empty(q8.shape, dtype=torch.float16))
    with pytest.raises(TypeError, match="^out: dtype float8_e4m3fn must be bfloat16"):
        call(q8, k8, v8, out=torch.empty(q8.shape, dtype=F8))
    # descales are >= 0 (the kernels' running max assumes a non-negative logit scale); 0 is allowed
    neg = ds[1].clone()
    neg[1, 0] = -0.5
    with pytest.raises(ValueError, match=r"^k_descale: k_descale\[1, 0\] is negative; descales must be >= 0"):
        call(q8, k8, v8, k_descale=neg)
    with pytest.raises(ValueError, match=r"^v_descale: v_descale\[0, 1\] is negative"):
        call(q8, k8, v8, v_descale=torch.tensor([[1.0, -1.0], [1.0, 1.0]]))
    zero = torch.zeros(2, 2)
    out = call(q8, k8, v8, q_descale=zero)  # a zero logit scale: uniform weights over the visible keys
    assert torch.isfinite(out.float()).all()


# ---------------------------------------------------------------------------------------------------------------------
# CUDA: the dense FP8 kernel (DenseFp8Fwd, head dim 128, contiguous KV or paged KV with page_size % 64 == 0). It
# quantises P to e4m3 (with FA3's 2^8 offset) and accumulates each key tile's P V in a fresh f32 accumulator, so it
# is compared with tolerances that allow P's rounding: against the CPU oracle (exact math on the dequantised values)
# on small odd shapes, FA3's self-calibrating rule on larger ones, and a 32K needle workload against bf16.
cuda_only = pytest.mark.skipif(not (sp.with_cuda and torch.cuda.is_available()), reason="needs the CUDA backend and a GPU")


def _cuda(*xs):
    return [None if x is None else x.cuda() for x in xs]


def _poisoned(shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")


def _p8_atol(ref, v_deq):
    # P in e4m3 (3 mantissa bits, relative rounding <= 2^-4 per weight, FA3's 2^8 offset keeps the largest weight of
    # a step at 256, exact): |sum_j dp_j v_j| / sum_j p_j <= 2^-4 max|v|; plus bf16's rounding of the output.
    return 2 ** -4 * float(np.abs(v_deq).max()) + 2 ** -8 * float(np.abs(ref).max()) + 1e-3


SMALL = [  # (q_lens, k_lens, hq, hkv, causal, window)
    ([1, 77, 300], [1, 77, 513], 4, 2, True, (-1, -1)),
    ([129, 5], [129, 260], 8, 2, True, (-1, -1)),      # GQA g = 4, a tail m-block of one row
    ([200, 63], [333, 63], 2, 2, False, (-1, -1)),     # non-causal, k_len % 128 != 0
    ([257], [700], 4, 1, True, (100, -1)),            # sliding window, MQA
    ([190], [190], 4, 2, False, (37, 53)),            # two-sided window
]


@cuda_only
@pytest.mark.parametrize("q_lens, k_lens, hq, hkv, causal, window", SMALL)
def test_fp8_cuda_matches_the_cpu_reference(rng, q_lens, k_lens, hq, hkv, causal, window):
    (q8, k8, v8, cu_q, cu_k), ds, (_, _, dv, _, _) = _fp8_call(rng, q_lens, k_lens, hq, hkv, d=128)
    mq, mk = max(q_lens), max(k_lens)
    kw = dict(causal=causal, window=window)
    ref = sp.attention(q8, k8, v8, cu_q, cu_k, mq, mk, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2], **kw)
    ref = ref.double().numpy()
    out = _poisoned(q8.shape)
    got = sp.attention(*_cuda(q8, k8, v8, cu_q, cu_k), mq, mk, out=out, q_descale=ds[0].cuda(),
                       k_descale=ds[1].cuda(), v_descale=ds[2].cuda(), **kw)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.bfloat16
    got = got.double().cpu().numpy()
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, ref, rtol=0, atol=_p8_atol(ref, dv))


@cuda_only
def test_fp8_cuda_every_key_position(rng):
    # Peaked attention: query row i attends (logit ~ +30) to one key t(i) only, so O(i) ~ v[t(i)]. The targets cover
    # every position inside the 32-key chunks of a 128-key tile (the V transpose permutes keys inside each chunk and P
    # is converted in that order: a wrong permutation gives the value of another key). Non-causal, 1 sequence.
    L, hq, hkv, d = 512, 2, 1, 128
    k = rng.standard_normal((L, hkv, d)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    targets = rng.permutation(L)
    q = np.repeat(k[targets] * 30 * np.sqrt(d), hq // hkv, axis=1).astype(np.float32)  # logit 30 on the target
    v = rng.uniform(-1, 1, (L, hkv, d)).astype(np.float32)
    (q8, dq), (k8, dk), (v8, dv) = (sp.quantize_fp8(torch.from_numpy(x), num_kv_heads=hkv) for x in (q, k, v))
    cu = torch.tensor([0, L], dtype=torch.int32)
    got = sp.attention(*_cuda(q8, k8, v8, cu, cu), L, L, causal=False, out=_poisoned(q8.shape),
                       q_descale=dq.cuda(), k_descale=dk.cuda(), v_descale=dv.cuda()).double().cpu().numpy()
    want = (v8.double() * dv[0].double().view(1, hkv, 1)).numpy()[targets]  # [L, hkv, d]
    want = np.repeat(want, hq // hkv, axis=1)
    ref = sp.attention(q8, k8, v8, cu, cu, L, L, causal=False, q_descale=dq, k_descale=dk, v_descale=dv).double()
    assert np.abs(ref.numpy() - want).max() < 0.05  # the workload is as peaked as meant
    assert np.abs(got - want).max() < 0.1, np.abs(got - want).max()


@cuda_only
@pytest.mark.parametrize("page_size", [64, 128, 192, 256])
def test_fp8_cuda_paged_equals_contiguous(rng, page_size):
    q, k, v, cu_q, cu_k = make_varlen(rng, [100, 1, 300], [700, 129, 300], 8, 2, 128)
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, page_size)
    (q8, dq) = sp.quantize_fp8(torch.from_numpy(q), batch=3, num_kv_heads=2)
    (k8, dk), (v8, dv) = (sp.quantize_fp8(torch.from_numpy(x), batch=3) for x in (k, v))
    kc8 = (torch.from_numpy(kc) / dk[0].view(1, 1, 2, 1)).clamp(-448, 448).to(F8)
    vc8 = (torch.from_numpy(vc) / dv[0].view(1, 1, 2, 1)).clamp(-448, 448).to(F8)
    # the cache rows past seqused_k hold NaN bit patterns (0x7f): the kernel must not let 0 x NaN into O
    kc8_np, vc8_np = kc8.view(torch.uint8).numpy().copy(), vc8.view(torch.uint8).numpy().copy()
    for b in range(3):
        n = int(used[b])
        for tok in range(n, ((n + page_size - 1) // page_size) * page_size):
            page, slot = int(bt[b, tok // page_size]), tok % page_size
            kc8_np[page, slot] = vc8_np[page, slot] = 0x7F
    kc8, vc8 = (torch.from_numpy(x).view(F8) for x in (kc8_np, vc8_np))
    ds = dict(q_descale=dq.cuda(), k_descale=dk.cuda(), v_descale=dv.cuda())
    a = sp.attention(*_cuda(q8, k8, v8, torch.from_numpy(cu_q), torch.from_numpy(cu_k)), 300, 700,
                     out=_poisoned(q8.shape), **ds)
    b = sp.attention(*_cuda(q8, kc8, vc8, torch.from_numpy(cu_q)), None, 300, 700, out=_poisoned(q8.shape),
                     block_table=torch.from_numpy(bt).cuda(), seqused_k=torch.from_numpy(used).cuda(), **ds)
    assert not torch.isnan(a).any() and torch.equal(a, b)


@cuda_only
def test_fp8_cuda_descales_broadcast_and_per_sequence_head(rng):
    (q8, k8, v8, cu_q, cu_k), ds, (_, _, dv, _, _) = _fp8_call(rng, [50, 190], [50, 260], hq=6, hkv=3, d=128)
    args = _cuda(q8, k8, v8, cu_q, cu_k) + [190, 260]
    # stride-0 broadcast equals the materialised descales, and absent means 1
    per_tensor = torch.tensor([0.25], device="cuda").view(1, 1).expand(2, 3)
    one = torch.ones(2, 3, device="cuda")
    a = sp.attention(*args, v_descale=per_tensor)
    b = sp.attention(*args, v_descale=per_tensor.contiguous(), q_descale=one, k_descale=one)
    assert torch.equal(a, b)
    # per-(sequence, KV head) values, transposed (non-contiguous) storage: the CPU oracle's numbers
    dsT = [torch.from_numpy(x.numpy().T.copy()).T for x in ds]  # same values, strides (1, 2)
    assert dsT[0].stride() == (1, 2)
    got = sp.attention(*args, out=_poisoned(q8.shape), q_descale=dsT[0].cuda(), k_descale=dsT[1].cuda(),
                       v_descale=dsT[2].cuda()).double().cpu().numpy()
    ref = sp.attention(q8, k8, v8, cu_q, cu_k, 190, 260, q_descale=ds[0], k_descale=ds[1],
                       v_descale=ds[2]).double().numpy()
    np.testing.assert_allclose(got, ref, rtol=0, atol=_p8_atol(ref, dv))
    # v_descale of (sequence 1, KV head 2) scales exactly query heads 4, 5 of sequence 1
    vd = torch.ones(2, 3, device="cuda")
    vd[1, 2] = 2.0
    c = sp.attention(*args, v_descale=vd).double()
    base = sp.attention(*args).double()
    torch.testing.assert_close(c[50:, 4:6], base[50:, 4:6] * 2, rtol=2 ** -7, atol=1e-3)
    assert torch.equal(c[50:, :4], base[50:, :4]) and torch.equal(c[:50], base[:50])


@cuda_only
@pytest.mark.parametrize("which", ["q_descale", "k_descale", "v_descale"])
def test_fp8_cuda_negative_descale_is_flagged_on_the_device(rng, which):
    """A negative descale on the device cannot be read without a host sync: the kernel makes the rows of that
    (sequence, KV head) NaN and check_errors() names the argument; every other row is the valid call's."""
    (q8, k8, v8, cu_q, cu_k), ds, _ = _fp8_call(rng, [50, 190], [50, 260], hq=6, hkv=3, d=128)
    args = _cuda(q8, k8, v8, cu_q, cu_k) + [190, 260]
    d = {n: x.cuda() for n, x in zip(("q_descale", "k_descale", "v_descale"), ds)}
    sp.check_errors()
    good = sp.attention(*args, **d)
    sp.check_errors()  # nothing flagged
    d[which] = d[which].clone()
    d[which][1, 2] = -d[which][1, 2]
    bad = sp.attention(*args, out=_poisoned(q8.shape), return_lse=True, **d)
    out, lse = bad
    torch.cuda.synchronize()
    with pytest.raises(ValueError) as e:
        sp.check_errors()
    assert getattr(e.value, "argument", None) == which, str(e.value)
    assert f"{which}[1, 2] is negative" in str(e.value)
    sp.check_errors()  # cleared
    assert torch.isnan(out[50:, 4:6].float()).all() and torch.isnan(lse[4:6, 50:]).all()
    assert torch.equal(out[50:, :4], good[50:, :4]) and torch.equal(out[:50], good[:50])


def _torch_attention(q, k, v, cu_q, cu_k, causal, dtype):
    """Plain torch attention per sequence (bottom-right causal), in `dtype` on q's device. q [Lq, Hq, D]."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qs = q[q0:q1].to(dtype).transpose(0, 1)
        ks = k[k0:k1].to(dtype).repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vs = v[k0:k1].to(dtype).repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])
        if causal:
            i = torch.arange(q1 - q0, device=q.device)[:, None]
            j = torch.arange(k1 - k0, device=q.device)[None, :]
            s = s.masked_fill(j > i + (k1 - k0) - (q1 - q0), float("-inf"))
        out[q0:q1] = (torch.softmax(s, dim=-1) @ vs).transpose(0, 1)
    return out


@cuda_only
@pytest.mark.parametrize("lens, causal", [(([2048, 1000], [2048, 3000]), True), (([1536], [1536]), False)])
def test_fp8_cuda_within_twice_the_naive_fp8_error(rng, lens, causal):
    # FA3's self-calibrating check: ref = float64 attention on the unquantised values, naive = plain float32 torch
    # attention on the FP8-cast-and-descaled values; max|out - ref| <= 2 max|naive - ref| + eps.
    q_lens, k_lens = lens
    q, k, v, cu_q, cu_k = make_varlen(rng, q_lens, k_lens, 8, 2, 128)
    B = len(q_lens)
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    (q8, dq), (k8, dk), (v8, dv) = (sp.quantize_fp8(x, batch=B, num_kv_heads=2) for x in (tq, tk, tv))
    cu_q_t, cu_k_t = torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda()
    got = sp.attention(q8, k8, v8, cu_q_t, cu_k_t, max(q_lens), max(k_lens), causal=causal,
                       out=_poisoned(q8.shape), q_descale=dq, k_descale=dk, v_descale=dv)
    assert not torch.isnan(got).any()
    ref = _torch_attention(tq, tk, tv, cu_q, cu_k, causal, torch.float64)
    deq = [x8.float() * d[0].repeat_interleave(x8.shape[1] // 2).view(1, -1, 1)
           for x8, d in ((q8, dq), (k8, dk), (v8, dv))]
    naive = _torch_attention(*deq, cu_q, cu_k, causal, torch.float32).double()
    err, naive_err = (got.double() - ref).abs().max().item(), (naive - ref).abs().max().item()
    assert err <= 2 * naive_err + 2e-3, (err, naive_err)


@cuda_only
@pytest.mark.parametrize("L", [32768, 131072])
def test_fp8_cuda_needles_within_the_bf16_band(L):
    # The structured workload (RoPE content, sinks, recall, retrieval needles), 32K and 128K causal: FP8 (per-head
    # quantised) must recover the needles' values (cosine of the needle queries' outputs with the needle value) about
    # as well as bf16. This is the long-context case that collapses without the two-level P V accumulation.
    hq, hkv, d = 8, 2, 128
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, seed=3, needles=6)
    q, k, v = (torch.from_numpy(x).cuda() for x in sp.workload.structured(L, **kw))
    needles = sp.workload.needle_positions(L, **kw)
    assert needles
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    o16 = sp.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, cu, L, L).float()
    (q8, dq), (k8, dk), (v8, dv) = (sp.quantize_fp8(x, num_kv_heads=hkv) for x in (q, k, v))
    o8 = sp.attention(q8, k8, v8, cu, cu, L, L, out=_poisoned(q.shape), q_descale=dq, k_descale=dk,
                      v_descale=dv).float()
    assert not torch.isnan(o8).any()
    g = hq // hkv
    for n in needles:
        heads = slice(n["kv_head"] * g, (n["kv_head"] + 1) * g)
        val = torch.from_numpy(n["value"]).cuda().view(1, 1, d)
        rows = slice(n["query_begin"], n["query_end"])
        cos16 = torch.nn.functional.cosine_similarity(o16[rows, heads], val, dim=-1).mean().item()
        cos8 = torch.nn.functional.cosine_similarity(o8[rows, heads], val, dim=-1).mean().item()
        assert cos8 >= cos16 - 0.02, (n, cos8, cos16)


@cuda_only
def test_fp8_cuda_unsupported_combinations(rng):
    # head dim 64 and paged KV with page_size % 64 != 0 (the cp.async gather), on every entry point
    (q8, k8, v8, cu_q, cu_k), ds, _ = _fp8_call(rng, [20, 30], [20, 30], d=64)
    fp8 = dict(q_descale=ds[0].cuda(), k_descale=ds[1].cuda(), v_descale=ds[2].cuda())
    for fn in (sp.attention, sp.sparse_prefill):
        with pytest.raises(NotImplementedError, match="attention is built for head dim 128 only"):
            fn(*_cuda(q8, k8, v8, cu_q, cu_k), 30, 30, **fp8)
    q, k, v, cu_q, cu_k = make_varlen(rng, [40, 7], [300, 150], 4, 2, 128)
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, 16)
    q8, kc8, vc8 = (torch.from_numpy(x).to(F8).cuda() for x in (q, kc, vc))
    for fn in (sp.attention, sp.sparse_prefill):
        with pytest.raises(NotImplementedError, match="page_size % 64 == 0"):
            fn(q8, kc8, vc8, torch.from_numpy(cu_q).cuda(), None, 40, 300, block_table=torch.from_numpy(bt).cuda(),
               seqused_k=torch.from_numpy(used).cuda())


def test_fp8_torch_ops_equal_the_public_functions(rng):
    import sparse_prefill.torch_ops as spt
    (q8, k8, v8, cu_q, cu_k), ds, _ = _fp8_call(rng, [70, 200], [130, 200], d=128)
    fp8 = dict(q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    args = (q8, k8, v8, cu_q, cu_k, 200, 200)
    for op, public in ((spt.attention, sp.attention), (spt.sparse_prefill, sp.sparse_prefill)):
        got = op(*args, **fp8)
        assert got.dtype == torch.bfloat16 and torch.equal(got, public(*args, **fp8))
    # opcheck without test_schema: its mutation check multiplies the inputs, which torch does not do for float8
    check = lambda op, a, kw: torch.library.opcheck(  # noqa: E731
        spt.OPS[op], a, kw, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    check("attention", args, dict(fp8, return_lse=True))
    check("sparse_prefill", args, fp8)
    check("attention_out", args + (torch.empty(q8.shape, dtype=torch.bfloat16),), fp8)
    kc, vc, bt, used = to_paged(rng, np.zeros((10, 2, 128), np.float32), np.zeros((10, 2, 128), np.float32),
                                np.array([0, 10], np.int32), 64)
    kc8, vc8 = (torch.from_numpy(x).clamp(-448, 448).to(F8) for x in (kc, vc))
    step = (q8[:10], kc8, vc8, torch.tensor([0, 10], dtype=torch.int32), torch.from_numpy(bt),
            torch.from_numpy(used), 10, 10)
    one = dict(q_descale=ds[0][:1], k_descale=ds[1][:1], v_descale=ds[2][:1])
    got = spt.chunked_prefill(*step, final_chunk=True, **one)
    assert torch.equal(got, sp.chunked_prefill(*step, final_chunk=True, **one))
    check("chunked_prefill", step, dict(one, final_chunk=True))

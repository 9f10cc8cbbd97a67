"""The dense CUDA kernels through the package (torch CUDA tensors) against a float32 torch reference, for every
path of sp.attention(): the dense kernel (contiguous, TMA pages, the cp.async gather for other page sizes, D 64 and
128, bf16/fp16, windows, varlen, rows that see no key) and PackGQA tiles with split-KV for short queries against
long keys (each case written for one path asserts that the library takes it: sp.attention_path).

Tolerance (the FlashAttention rule): max|ours - ref32| <= 2 * max|ref_lowp - ref32| + atol, where ref_lowp is the
same computation done by PyTorch in the input dtype (S and O matmuls rounded to bf16/fp16, softmax in fp32, P rounded
to the input dtype) and atol = 2 ulp of the input dtype at 0.3. LSE: the same rule against the fp32 LSE with atol
1e-3. Outputs are poisoned with NaN before each call; rows that see no key must give exactly 0 and lse = -inf; no NaN
anywhere. Skipped without a GPU or a CUDA build.
"""
import math

import pytest

import sparse_prefill as sp

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.cuda
if not (torch.cuda.is_available() and sp.with_cuda):
    pytest.skip("needs a CUDA GPU and a CUDA build", allow_module_level=True)


def visible_mask(lq, lk, causal, window, device, r0=0, r1=None):
    """Bottom-right aligned visibility of rows r0..r1 of a sequence with lq queries and lk keys."""
    i = torch.arange(r0, lq if r1 is None else r1, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    diag = lk - lq
    m = torch.ones(i.shape[0], lk, dtype=torch.bool, device=device)
    right = 0 if causal else window[1]
    if right >= 0:
        m &= j <= i + diag + right
    if window[0] >= 0:
        m &= j >= i + diag - window[0]
    return m


def ref_attention(q, k, v, lq_list, lk_list, causal, window, scale, lowp):
    """q [total_q, Hq, D], k/v [total_k, Hkv, D] (contiguous, cumulated). Returns out (fp32), lse [Hq, total_q]."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((hq, q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    qs = ks = 0
    chunk = 2048
    for lq, lk in zip(lq_list, lk_list):
        for h in range(hq):
            kh = k[ks:ks + lk, h // g]
            vh = v[ks:ks + lk, h // g]
            if not lowp:
                kh, vh = kh.float(), vh.float()
            for r0 in range(0, lq, chunk):
                r1 = min(lq, r0 + chunk)
                qh = q[qs + r0:qs + r1, h]
                if not lowp:
                    qh = qh.float()
                s = (qh @ kh.t()).float() * scale
                m = visible_mask(lq, lk, causal, window, q.device, r0, r1)
                s = s.masked_fill(~m, -math.inf)
                l = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - torch.where(torch.isinf(l), torch.zeros_like(l), l)[:, None])
                p = torch.nan_to_num(p, nan=0.0)
                if lowp:
                    o = (p.to(q.dtype) @ vh).float()
                else:
                    o = p @ vh
                out[qs + r0:qs + r1, h] = o
                lse[h, qs + r0:qs + r1] = l
        qs += lq
        ks += lk
    return out, lse


def make_paged(k, v, lk_list, ps, gen, nan_fill=False):
    """Scatter contiguous K/V [total_k, Hkv, D] into randomly permuted pages of ps tokens (+3 spare pages).
    nan_fill: every slot not holding a token (tail of the last page, spare pages) is NaN, as in an engine's
    uninitialised cache; masked keys must not inject NaN into O."""
    dev, dtype = k.device, k.dtype
    hkv, d = k.shape[1], k.shape[2]
    b = len(lk_list)
    max_pages = max((lk + ps - 1) // ps for lk in lk_list)
    num_pages = b * max_pages + 3
    perm = torch.randperm(num_pages, device=dev, generator=gen)[: b * max_pages].to(torch.int32)
    block_table = perm.view(b, max_pages).contiguous()
    if nan_fill:
        kc = torch.full((num_pages, ps, hkv, d), float("nan"), device=dev, dtype=dtype)
        vc = torch.full((num_pages, ps, hkv, d), float("nan"), device=dev, dtype=dtype)
    else:
        kc = torch.randn(num_pages, ps, hkv, d, device=dev, dtype=dtype, generator=gen)
        vc = torch.randn(num_pages, ps, hkv, d, device=dev, dtype=dtype, generator=gen)
    ks = 0
    for bi, lk in enumerate(lk_list):  # scatter the contiguous K/V into the pages
        for t0 in range(0, lk, ps):
            pg = int(block_table[bi, t0 // ps])
            n = min(ps, lk - t0)
            kc[pg, :n] = k[ks + t0:ks + t0 + n]
            vc[pg, :n] = v[ks + t0:ks + t0 + n]
        ks += lk
    seqused = torch.tensor(lk_list, dtype=torch.int32, device=dev)
    return kc, vc, block_table, seqused



_CASES = []
for L in [1, 11, 127, 129, 1763]:
    _CASES.append((f"causal L={L} g=4", [L], [L], 8, 2, dict()))
_CASES += [
    ("causal L=32767 g=4", [32767], [32767], 4, 1, dict()),
    ("causal Lq<Lk 100/1000 g=1", [100], [1000], 4, 4, dict()),
    ("causal Lq<Lk 129/4096 g=8", [129], [4096], 16, 2, dict()),
    ("causal Lq>Lk 1000/300 g=4 (empty rows)", [1000], [300], 8, 2, dict()),
    ("causal Lq>Lk 257/1 g=4 (empty rows)", [257], [1], 8, 2, dict()),
    ("noncausal 777/1500 g=8", [777], [1500], 16, 2, dict(causal=False)),
    ("varlen causal mixed g=4", [1, 300, 1763, 129, 64], [5, 300, 2000, 129, 1], 8, 2, dict()),
    ("varlen noncausal mixed g=4", [1, 300, 1763, 129], [5, 300, 2000, 129], 8, 2, dict(causal=False)),
    ("fp16 causal L=1763 g=4", [1763], [1763], 8, 2, dict(dtype=torch.float16)),
    ("fp16 varlen causal g=8", [77, 1000, 129], [200, 1000, 129], 16, 2, dict(dtype=torch.float16)),
    ("window (256,0) causal L=1500", [1500], [1500], 8, 2, dict(window=(256, -1))),
    ("window (300,40) noncausal 1000/1200", [1000], [1200], 8, 2, dict(causal=False, window=(300, 40))),
    ("paged ps=128 varlen causal", [300, 1763], [700, 1763], 8, 2, dict(paged=128)),
    ("paged ps=256 causal chunk 129/3000", [129], [3000], 8, 2, dict(paged=256)),
    # page_size % 128 == 64: two 64-row TMA boxes per key block. Unused page slots hold NaN; k_len % 128 covers
    # 0 < r < 64 (second half past seqused_k: zero-filled box), r = 64 and 64 < r < 128.
    ("paged ps=64 varlen causal NaN-filled", [300, 1763, 1, 320], [700, 1763, 1, 320], 8, 2,
     dict(paged=64, nan_fill=True)),
    ("paged ps=64 causal chunk 129/3000 NaN-filled", [129], [3000], 8, 2, dict(paged=64, nan_fill=True)),
    ("paged ps=64 noncausal 777/1500 NaN-filled", [777], [1500], 16, 2, dict(paged=64, nan_fill=True,
                                                                            causal=False)),
    ("paged ps=192 window (300,0) varlen NaN-filled", [500, 1000], [900, 1000], 8, 2,
     dict(paged=192, nan_fill=True, window=(300, -1))),
    ("paged ps=128 varlen causal NaN-filled", [300, 1763], [700, 1763], 8, 2, dict(paged=128, nan_fill=True)),
    ("paged ps=64 == contiguous (varlen causal)", [300, 1763, 129], [700, 1763, 4000], 8, 2,
     dict(paged=64, vs_contiguous=True)),
    ("paged ps=64 == contiguous (L=4096 Llama)", [4096], [4096], 32, 8, dict(paged=64, vs_contiguous=True)),
    ("llama shape causal L=4096 g=4", [4096], [4096], 32, 8, dict()),
    # page_size % 64 != 0: the cp.async gather producer (kGatherKV). Odd lengths put seqused_k inside a page
    # and inside a key block (its predicated, zero-filling copies); unused slots hold NaN.
    ("paged ps=16 varlen causal NaN-filled", [300, 1763, 1, 320, 77], [700, 1763, 1, 320, 4001], 8, 2,
     dict(paged=16, nan_fill=True)),
    ("paged ps=1 varlen causal NaN-filled", [129, 1000], [1500, 1000], 8, 2, dict(paged=1, nan_fill=True)),
    ("paged ps=16 == contiguous (L=4096 Llama)", [4096], [4096], 32, 8, dict(paged=16, vs_contiguous=True)),
    ("paged ps=1 == contiguous (varlen causal)", [300, 129], [701, 4000], 8, 2, dict(paged=1, vs_contiguous=True)),
    ("paged ps=48 window (300,40) noncausal NaN-filled", [1000], [1200], 8, 2,
     dict(paged=48, nan_fill=True, causal=False, window=(300, 40))),
    ("paged ps=32 fp16 Lq>Lk 1000/300 (empty rows) NaN-filled", [1000], [300], 8, 2,
     dict(paged=32, nan_fill=True, dtype=torch.float16)),
    ("paged ps=16 decode varlen 1/3 vs 20000/77 Llama NaN-filled", [1, 3], [20000, 77], 32, 8,
     dict(paged=16, nan_fill=True, expect_path="dense")),
    # Short queries against long keys: PackGQA tiles with split-KV (cuda::dense_uses_full_list).
    ("split decode Lq=1 vs 20000 Llama", [1], [20000], 32, 8, dict(expect_path="split")),
    ("split decode varlen 1/3/17 vs 9000/300/33001 g=8", [1, 3, 17], [9000, 300, 33001], 16, 2,
     dict(expect_path="split")),
    ("split chunk noncausal 77/32767 g=1", [77], [32767], 4, 4, dict(causal=False, expect_path="split")),
    ("split chunk 1000/50000 g=4 (64 dense tiles)", [1000], [50000], 8, 2, dict(expect_path="split")),
    ("split Lq>Lk in batch 50/20, 3/9000 (empty rows)", [50, 3], [20, 9000], 8, 2, dict(expect_path="split")),
    ("split fp16 decode 5/12345 g=8", [5], [12345], 16, 2, dict(dtype=torch.float16, expect_path="split")),
    ("split paged ps=64 decode varlen NaN-filled", [1, 5, 2], [5000, 1, 20001], 8, 2,
     dict(paged=64, nan_fill=True, expect_path="split")),
    ("split paged ps=128 == contiguous 9/7000", [9], [7000], 32, 8,
     dict(paged=128, vs_contiguous=True, expect_path="split")),
    ("dense path window decode 1/20000", [1], [20000], 32, 8, dict(window=(1000, -1), expect_path="dense")),
    # Head dim 64 (its own instantiation, dense only).
    ("D=64 causal L=1763 g=4", [1763], [1763], 8, 2, dict(d=64)),
    ("D=64 varlen causal mixed g=8", [1, 300, 1763, 129], [5, 300, 2000, 129], 16, 2, dict(d=64)),
    ("D=64 fp16 noncausal window (300,40) 1000/1200", [1000], [1200], 8, 2,
     dict(d=64, dtype=torch.float16, causal=False, window=(300, 40))),
    ("D=64 paged ps=64 causal chunk 129/3000 NaN-filled", [129], [3000], 8, 2, dict(d=64, paged=64,
                                                                                   nan_fill=True)),
    ("D=64 paged ps=128 == contiguous (varlen causal)", [300, 1763], [700, 1763], 8, 2,
     dict(d=64, paged=128, vs_contiguous=True)),
    ("D=64 paged ps=16 varlen causal NaN-filled", [300, 1763, 1], [700, 1763, 129], 8, 2,
     dict(d=64, paged=16, nan_fill=True)),
    ("D=64 paged ps=1 == contiguous (causal chunk 129/3001)", [129], [3001], 8, 2,
     dict(d=64, paged=1, vs_contiguous=True)),
]


@pytest.mark.parametrize("name,lq_list,lk_list,hq,hkv,kw", _CASES, ids=[c[0] for c in _CASES])
def test_dense_cuda(name, lq_list, lk_list, hq, hkv, kw):
    causal = kw.get("causal", True)
    window = kw.get("window", (-1, -1))
    dtype = kw.get("dtype", torch.bfloat16)
    paged, d, nan_fill = kw.get("paged", 0), kw.get("d", 128), kw.get("nan_fill", False)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(hash(name) % 2**31)
    tq, tk = sum(lq_list), sum(lk_list)
    q = torch.randn(tq, hq, d, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(tk, hkv, d, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(tk, hkv, d, device=dev, dtype=dtype, generator=gen)
    cu_q = torch.tensor([0] + torch.tensor(lq_list).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + torch.tensor(lk_list).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    mq, mk = max(lq_list), max(lk_list)
    out = torch.full_like(q, float("nan"))   # poisoned: every element must be written
    if paged:
        kc, vc, block_table, seqused = make_paged(k, v, lk_list, paged, gen, nan_fill)
        kv = dict(block_table=block_table, seqused_k=seqused)
        args = (q, kc, vc, cu_q, None, mq, mk)
    else:
        kv = {}
        args = (q, k, v, cu_q, cu_k, mq, mk)
    path = sp.attention_path(*args, causal=causal, window=window, **kv)
    got, got_lse = sp.attention(*args, causal=causal, window=window, out=out, return_lse=True, **kv)
    assert got is out
    if kw.get("vs_contiguous"):  # same blocks in the same order: paged must equal contiguous bit for bit
        out_c, lse_c = sp.attention(q, k, v, cu_q, cu_k, mq, mk, causal=causal, window=window, return_lse=True)
        assert torch.equal(got, out_c)
        assert torch.equal(got_lse, lse_c)
    torch.cuda.synchronize()
    ref, ref_lse = ref_attention(q, k, v, lq_list, lk_list, causal, window, 1.0 / math.sqrt(d), lowp=False)
    low, low_lse = ref_attention(q, k, v, lq_list, lk_list, causal, window, 1.0 / math.sqrt(d), lowp=True)
    atol = 2 * torch.finfo(dtype).eps * 0.25  # ~ 2 ulp at 0.3
    assert not torch.isnan(got).any() and not torch.isnan(got_lse).any()
    err, err_low = (got.float() - ref).abs().max().item(), (low - ref).abs().max().item()
    assert err <= 2 * err_low + atol, (err, err_low)
    fin = torch.isfinite(ref_lse)
    if fin.any():
        lse_err = (got_lse[fin] - ref_lse[fin]).abs().max().item()
        assert lse_err <= 2 * (low_lse[fin] - ref_lse[fin]).abs().max().item() + 1e-3
    if (~fin).any():  # rows that see no key: O = 0 exactly, lse = -inf
        rows = (~fin).nonzero()
        assert bool((got_lse[~fin] == -math.inf).all())
        assert bool((got[rows[:, 1], rows[:, 0]] == 0).all())
    if "expect_path" in kw:  # the cases written for one path must take it
        assert path == {"dense": "dense", "split": "split_kv"}[kw["expect_path"]]


@pytest.mark.parametrize("path", ["dense", "split_kv"])
def test_dense_cuda_forced_paths_agree(path):
    """LaunchOptions pins the kernel: both paths on one decode-like shape agree with the reference and each other."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(9, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(7001, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(7001, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu_q = torch.tensor([0, 9], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 7001], dtype=torch.int32, device="cuda")
    opts = sp.LaunchOptions(dense_path=path)
    assert sp.attention_path(q, k, v, cu_q, cu_k, 9, 7001, options=opts) == path
    got = sp.attention(q, k, v, cu_q, cu_k, 9, 7001, options=opts)
    ref, _ = ref_attention(q, k, v, [9], [7001], True, (-1, -1), 1 / math.sqrt(128), lowp=False)
    low, _ = ref_attention(q, k, v, [9], [7001], True, (-1, -1), 1 / math.sqrt(128), lowp=True)
    assert (got.float() - ref).abs().max().item() <= 2 * (low - ref).abs().max().item() + 2 * 2**-8 * 0.25


def test_dense_cuda_unsupported_head_dim_raises():
    q = torch.randn(64, 8, 96, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(64, 2, 96, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^q: unsupported head dim 96"):   # validated before any kernel runs
        sp.attention(q, kv, kv, cu, cu, 64, 64)

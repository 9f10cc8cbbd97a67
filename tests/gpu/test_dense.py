"""GPU tests of the dense sm90 forward kernel against a float32 torch reference.

Tolerance (the FlashAttention rule): max|ours - ref32| <= 2 * max|ref_lowp - ref32| + atol, where ref_lowp is the
same computation done by PyTorch in the input dtype (S and O matmuls rounded to bf16/fp16, softmax in fp32, P rounded
to the input dtype) and atol = 2 ulp of the input dtype at 0.3 (FA's `out_ref + 0.3 - 0.3` term). LSE: the same
rule against the fp32 LSE with atol 1e-3. Outputs are poisoned with NaN before each call; rows that see no key must
give exactly 0 and lse = -inf; no NaN anywhere.
Usage: python3 tests/gpu/test_dense.py [--out results.json] [--quick]"""
import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sp_cuda  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


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


def run_case(name, lq_list, lk_list, hq, hkv, causal=True, window=(-1, -1), dtype=torch.bfloat16, paged=0,
             d=128, seed=0, nan_fill=False, vs_contiguous=False, expect_path=None):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    tq, tk = sum(lq_list), sum(lk_list)
    q = torch.randn(tq, hq, d, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(tk, hkv, d, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(tk, hkv, d, device=dev, dtype=dtype, generator=gen)
    cu_q = torch.tensor([0] + list(torch.tensor(lq_list).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + list(torch.tensor(lk_list).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    scale = 1.0 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, tq), float("nan"), device=dev, dtype=torch.float32)
    kw = dict(causal=causal, window=window, out=out, lse=lse)
    contiguous_diff = None
    path = sp_cuda.dense_path(q, k, v, cu_q, cu_k, max(lq_list), max(lk_list), causal=causal, window=window)
    if paged:
        kc, vc, block_table, seqused = make_paged(k, v, lk_list, paged, gen, nan_fill)
        path = sp_cuda.dense_path(q, kc, vc, cu_q, None, max(lq_list), max(lk_list), causal=causal, window=window,
                                  block_table=block_table, seqused_k=seqused)
        sp_cuda.attention(q, kc, vc, cu_q, None, max(lq_list), max(lk_list), block_table=block_table,
                          seqused_k=seqused, **kw)
        if vs_contiguous:  # same blocks in the same order: paged must equal contiguous bit for bit
            out_c = torch.full_like(q, float("nan"))
            lse_c = torch.full((hq, tq), float("nan"), device=dev, dtype=torch.float32)
            sp_cuda.attention(q, k, v, cu_q, cu_k, max(lq_list), max(lk_list), causal=causal, window=window,
                              out=out_c, lse=lse_c)
            torch.cuda.synchronize()
            contiguous_diff = max((out.float() - out_c.float()).abs().max().item(),
                                  (lse - lse_c).nan_to_num(0.0).abs().max().item())
            if bool(torch.isnan(out_c).any()) or not torch.equal(torch.isinf(lse), torch.isinf(lse_c)):
                contiguous_diff = float("nan")
    else:
        sp_cuda.attention(q, k, v, cu_q, cu_k, max(lq_list), max(lk_list), **kw)
    torch.cuda.synchronize()
    ref, ref_lse = ref_attention(q, k, v, lq_list, lk_list, causal, window, scale, lowp=False)
    low, low_lse = ref_attention(q, k, v, lq_list, lk_list, causal, window, scale, lowp=True)
    atol = 2 * torch.finfo(dtype).eps * 0.25  # ~ 2 ulp at 0.3
    err = (out.float() - ref).abs().max().item()
    err_low = (low - ref).abs().max().item()
    fin = torch.isfinite(ref_lse)
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    lse_err_low = (low_lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    nan_out = bool(torch.isnan(out).any())
    nan_lse = bool(torch.isnan(lse).any())
    empty_ok = True
    if (~fin).any():  # rows that see no key: O = 0 exactly, lse = -inf
        rows = (~fin).nonzero()
        empty_ok = bool((lse[~fin] == -math.inf).all()) and bool((out[rows[:, 1], rows[:, 0]] == 0).all())
    ok = (not nan_out and not nan_lse and empty_ok and err <= 2 * err_low + atol
          and lse_err <= 2 * lse_err_low + 1e-3)
    extra = {"path": path}
    if expect_path is not None:  # the cases written for one path must take it
        ok = ok and path == expect_path
    if contiguous_diff is not None:
        ok = ok and contiguous_diff == 0.0
        extra["diff_vs_contiguous"] = contiguous_diff
    return dict(**extra, name=name, ok=ok, err=err, err_lowp=err_low, atol=atol, lse_err=lse_err, lse_err_lowp=lse_err_low,
                nan_out=nan_out, nan_lse=nan_lse, empty_rows_ok=empty_ok, empty_rows=int((~fin).sum()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="two small cases only (first check of a new build)")
    args = ap.parse_args()
    cases = []
    for L in [1, 11, 127, 129, 1763]:
        cases.append((f"causal L={L} g=4", [L], [L], 8, 2, dict()))
    cases += [
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
    if args.smoke:
        cases = [c for c in cases if c[0] in ("causal L=129 g=4", "varlen causal mixed g=4",
                                              "paged ps=64 causal chunk 129/3000 NaN-filled",
                                              "paged ps=16 varlen causal NaN-filled")]
    if args.quick:
        cases = [c for c in cases if "32767" not in c[0]]
    results = []
    t0 = time.time()
    for name, lq, lk, hq, hkv, kw in cases:
        try:
            r = run_case(name, lq, lk, hq, hkv, **kw)
        except Exception as e:  # noqa: BLE001
            r = dict(name=name, ok=False, error=repr(e))
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.smoke:
        print(json.dumps(dict(passed=sum(r["ok"] for r in results), total=len(results))))
        return 0 if all(r["ok"] for r in results) else 1
    # Unsupported combinations must raise NotImplementedError, not crash.
    try:
        q = torch.randn(64, 8, 96, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(64, 2, 96, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
        sp_cuda.attention(q, kv, kv, cu, cu, 64, 64)
        results.append(dict(name="head dim 96 -> NotImplementedError", ok=False, error="no exception"))
    except sp_cuda.NotImplementedByKernel as e:
        results.append(dict(name="head dim 96 -> NotImplementedError", ok=True, message=str(e)))
    print(json.dumps(results[-1]))
    n_ok = sum(r["ok"] for r in results)
    summary = dict(passed=n_ok, total=len(results), seconds=time.time() - t0, device=torch.cuda.get_device_name())
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(summary=summary, cases=results), f, indent=1)
    return 0 if n_ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The FP8 quantisation floor on the structured workload, emulated in float32 torch on the CPU (issue 17's error target:
sparse FP8 vs dense bf16 <= 1.5x sparse bf16 vs dense bf16). Dense causal attention only: the floor is what dense FP8
loses against dense bf16 before any selection.

Reference: float32 attention on the bf16 q, k, v of sp.workload.structured (seed 1, as bench_fp8's --structured rows;
our dense bf16 kernel is within ~2e-3 of it). Each variant rounds some of q, k, v to e4m3 with a scale granularity
  tensor      one scale (sp.quantize_fp8(per_head=False))
  head        one per KV head, a group's query heads sharing it (sp.quantize_fp8's default, FA3's [B, Hkv] descale)
  block128    one per (128-token block, KV head): not expressible as the API's [B, Hkv] descales; emulated here
  token       one per (token, head): same (the finest scale; what an outlier-robust scheme could reach at best)
and optionally P rounded to e4m3 as the kernel does (P = exp(s - m) * 2^8, FA3's offset, rounded; row sums from the
unrounded P; m is the row's final max here, the kernel's running max differs only where P underflows), and reports
the output's relative L2 error against the reference. 'package' rows run sp.attention on the CPU backend (the exact
oracle on the dequantised values) for the head scheme, as a check of the emulation.
Also: per head, outlier statistics of q, k, v (channel RMS max / median; token norm max / median; amax / RMS).
Usage: python3 bench/lab/fp8_floor_cpu.py [--lengths 2048,4096] [--hq 32 --hkv 8] [--out bench/results/fp8_floor_cpu.json]"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common, the benchmarks

from _common import D, HKV, HQ, RESULTS, emit, ints, rel_err, write_results

FP8_MAX = 448.0


def quantize(x, scheme, g):
    """x [L, H, D] float32 rounded to e4m3 with the scheme's scales (amax -> 448), returned dequantised (float32).
    g: query heads per scale group (q: Hq / Hkv, k and v: 1)."""
    L, H, d = x.shape
    a = x.abs()
    if scheme == "tensor":
        amax = a.amax().expand(L, H)
    elif scheme == "head":
        amax = a.amax(dim=(0, 2)).view(H // g, g).amax(1).repeat_interleave(g)[None].expand(L, H)
    elif scheme == "block128":
        nb = (L + 127) // 128
        pad = torch.nn.functional.pad(a.amax(2), (0, 0, 0, nb * 128 - L))      # [nb*128, H]
        amax = pad.view(nb, 128, H // g, g).amax(dim=(1, 3)).repeat_interleave(g, 1).repeat_interleave(128, 0)[:L]
    elif scheme == "token":
        amax = a.amax(2).view(L, H // g, g).amax(2).repeat_interleave(g, 1)
    else:
        raise ValueError(f"scheme: {scheme!r}")
    scale = FP8_MAX / amax.clamp_min(1e-30)[..., None]
    return (x * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() / scale


def attention(q, k, v, p_e4m3=False, chunk=512):
    """Causal softmax(q k^T / sqrt(D)) v in float32, [L, Hq, D]; k, v [L, Hkv, D] (GQA). p_e4m3: P rounded as the
    FP8 kernel's (see the docstring)."""
    L, hq, d = q.shape
    g = hq // k.shape[1]
    kt = k.repeat_interleave(g, 1).transpose(0, 1)                            # [H, L, D]
    vt = v.repeat_interleave(g, 1).transpose(0, 1)
    out = torch.empty(hq, L, d)
    for a in range(0, L, chunk):
        e = min(L, a + chunk)
        s = torch.einsum("qhd,hkd->hqk", q[a:e], kt[:, :e]) / d ** 0.5
        s.masked_fill_(torch.arange(e)[None, :] > torch.arange(a, e)[:, None], float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))
        rowsum = p.sum(-1, keepdim=True)
        if p_e4m3:
            p = (p * 256.0).to(torch.float8_e4m3fn).float() / 256.0
        out[:, a:e] = torch.einsum("hqk,hkd->hqd", p, vt[:, :e]) / rowsum
    return out.transpose(0, 1)


def hadamard(n):
    """n x n orthonormal Hadamard matrix (Sylvester; n a power of 2)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def outliers(x, g):
    """Per head (of the scale group), the max over heads of: channel RMS max / median, token norm max / median,
    amax / RMS; and the share of |x| under e4m3's normal range (2^-6 of 448 / amax) with per-head scales."""
    L, H, d = x.shape
    ch = x.pow(2).mean(0).sqrt()                                              # [H, D]
    tok = x.norm(dim=2)                                                       # [L, H]
    rms = x.pow(2).mean(dim=(0, 2)).sqrt()
    amax_g = x.abs().amax(dim=(0, 2)).view(H // g, g).amax(1).repeat_interleave(g)
    sub = (x.abs() < (2.0 ** -6 / FP8_MAX) * amax_g[None, :, None]).float().mean().item()
    return dict(channel_rms_max_over_median=(ch.amax(1) / ch.median(1).values).max().item(),
                token_norm_max_over_median=(tok.amax(0) / tok.median(0).values).max().item(),
                amax_over_rms=(x.abs().amax(dim=(0, 2)) / rms).max().item(), share_subnormal_head_scale=sub)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--hq", type=int, default=HQ)
    ap.add_argument("--hkv", type=int, default=HKV)
    ap.add_argument("--package-max-len", type=int, default=2048, help="sp.attention (CPU oracle) rows up to this L")
    ap.add_argument("--out", default=os.path.join(RESULTS, "fp8_floor_cpu.json"))
    args = ap.parse_args(argv)
    import sparse_prefill as sp
    hq, hkv, g = args.hq, args.hkv, args.hq // args.hkv
    rows = []
    meta = dict(workload=f"structured seed 1, Hq={hq} Hkv={hkv} D={D}", reference="float32 on the bf16 inputs")
    for L in ints(args.lengths):
        q, k, v = (torch.from_numpy(x).to(torch.bfloat16).float()
                   for x in sp.workload.structured(L, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, seed=1))
        ref = attention(q, k, v)
        row = dict(L=L, outliers={n: outliers(x, gx) for n, x, gx in (("q", q, g), ("k", k, 1), ("v", v, 1))})
        row["input_rel_rounding"] = {n: rel_err(quantize(x, "head", gx), x) for n, x, gx in
                                     (("q", q, g), ("k", k, 1), ("v", v, 1))}
        errs = {}
        for scheme in ("tensor", "head", "block128", "token"):
            errs[f"qkv_{scheme}"] = rel_err(attention(quantize(q, scheme, g), quantize(k, scheme, 1),
                                                      quantize(v, scheme, 1)), ref)
        qh, kh, vh = quantize(q, "head", g), quantize(k, "head", 1), quantize(v, "head", 1)
        errs["qkv_head_p_e4m3"] = rel_err(attention(qh, kh, vh, p_e4m3=True), ref)  # what the FP8 kernel computes
        errs["q_only_head"] = rel_err(attention(qh, k, v), ref)
        errs["k_only_head"] = rel_err(attention(q, kh, v), ref)
        errs["v_only_head"] = rel_err(attention(q, k, vh), ref)
        errs["p_e4m3_only"] = rel_err(attention(q, k, v, p_e4m3=True), ref)
        errs["qv_head_p_e4m3_k_bf16"] = rel_err(attention(qh, k, vh, p_e4m3=True), ref)  # everything but k
        ks = kh.clone()
        ks[:sp.workload.structured_defaults()["sink_tokens"]] = k[:sp.workload.structured_defaults()["sink_tokens"]]
        errs["k_only_head_sinks_bf16"] = rel_err(attention(q, ks, v), ref)  # is it the sink keys?
        # incoherent processing (FA3): q and k times one orthonormal Hadamard matrix (q.k unchanged), then per head
        rot = hadamard(D)
        qr, kr = quantize(q @ rot, "head", g) @ rot.T, quantize(k @ rot, "head", 1) @ rot.T
        errs["qkv_head_hadamard_qk"] = rel_err(attention(qr, kr, vh), ref)
        errs["k_only_head_hadamard"] = rel_err(attention(q, kr, v), ref)
        if L <= args.package_max_len:  # the package's CPU oracle on sp.quantize_fp8's arrays: must match qkv_head
            cu = torch.tensor([0, L], dtype=torch.int32)
            qb, kb, vb = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
            (q8, qd), (k8, kd), (v8, vd) = (sp.quantize_fp8(x, num_kv_heads=hkv) for x in (qb, kb, vb))
            out8 = sp.attention(q8, k8, v8, cu, cu, L, L, q_descale=qd, k_descale=kd, v_descale=vd)
            errs["package_fp8_dense_head"] = rel_err(out8, ref)
            errs["package_bf16_dense"] = rel_err(sp.attention(qb, kb, vb, cu, cu, L, L), ref)
        row["rel_err_vs_fp32_bf16_inputs"] = errs
        emit(row)
        rows.append(row)
        write_results(args.out, rows, **meta)


if __name__ == "__main__":
    main()

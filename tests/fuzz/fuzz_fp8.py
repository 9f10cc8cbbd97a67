"""FP8 helpers of the fuzzer (tests/fuzz/test_fuzz.py): e4m3 values and bit patterns, the dequantised float32 twin of
an FP8 problem (what the CPU reference computes on), the correction's e4m3 means, the error bounds, and the CPU check
of block-sparse FP8 results (it runs the case through test_fuzz's own call / prepare_index, passed in as `fz`). CUDA
block-sparse FP8 results go through test_fuzz.check_sparse with the rest (e4m3_means, cuda_bound, lse_bound)."""

import copy

import numpy as np

try:
    import torch
    F8 = torch.float8_e4m3fn
except ImportError:  # FP8 cases need torch; the generator draws none without it
    torch = F8 = None

DESCALES = ("q_descale", "k_descale", "v_descale")
VALID_DESCALES = {n: n + "_valid" for n in DESCALES}  # the unmutated descales (the index kind builds with them)


def fp8_round(x):
    """float32 values rounded to float8_e4m3fn (torch's cast) and back."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(F8).float().numpy()


def e4m3_codes(x):
    """The float8_e4m3fn bit patterns (uint8) of float32 values that e4m3 holds exactly."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(F8).view(torch.uint8).numpy()


def decode(codes):
    """float32 values of uint8 e4m3 bit patterns (NaN codes decode to NaN)."""
    return torch.from_numpy(np.ascontiguousarray(codes)).view(F8).float().numpy()


def dequantised(c, a, name, rows, heads_per_column):
    """a[name] (q, or contiguous k / v) times its descale per (sequence, head), float64."""
    x = a[name].astype(np.float64)
    d = a[{"q": "q_descale", "k_contig": "k_descale", "v_contig": "v_descale"}[name]].astype(np.float64)
    seq = np.repeat(np.arange(c.B), rows)
    cols = np.arange(x.shape[1]) // heads_per_column
    return x * d[seq][:, cols, None]


def twin_arrays(c, a):
    """The arrays of a valid FP8 case dequantised to float32 as the CPU backend does on load (value * descale, one
    float32 product), without descales: the float32 call on them is what the FP8 call computes."""
    t = {n: x for n, x in a.items() if n not in DESCALES and n not in VALID_DESCALES.values()}
    g = c.hq // c.hkv
    qd = a["q_descale"][np.repeat(np.arange(c.B), c.q_lens)][:, np.arange(c.hq) // g, None]
    t["q"] = a["q"] * qd
    for n in ("k", "v"):
        d = a[n + "_descale"]
        if not c.paged:
            t[n] = a[n] * d[np.repeat(np.arange(c.B), c.k_lens)][:, :, None]
            continue
        x = decode(a[n])  # the cache's bit patterns; pages no sequence owns keep their (never read) garbage
        pages = [int(-(-int(k) // c.page_size)) for k in c.k_lens]
        for b in range(c.B):
            for p in a["block_table"][b, :pages[b]]:
                x[p] = x[p] * d[b][None, :, None]
        t[n] = x
    return t


def e4m3_means(index, k_descale, v_descale):
    """A host index's float32 real-unit means replaced, in place, by those the CUDA correction uses: e4m3 in the raw
    units of the call's descales (nearest even, saturated to ±448) times the descale (docs/semantics.md, FP8)."""
    cu = np.asarray(index.host["cu_blocks"])
    seq = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    S = index.num_subgroups
    for name, ds in (("k_mean", k_descale), ("v_mean", v_descale)):
        m = index.host[name]
        if m is None:  # no V means without the correction
            continue
        d = ds[seq][:, np.repeat(np.arange(ds.shape[1]), S), None].astype(np.float32)
        raw = np.divide(m, d, out=np.zeros_like(m), where=d != 0)
        m[...] = torch.from_numpy(raw).clamp(-448, 448).to(F8).float().numpy() * d
    return index


def cuda_bound(ref, vmax):
    """CUDA FP8 output error bound (test_fp8_sparse.py's _p8_atol): P rounded to e4m3 (2^-4 relative per weight, at
    most 2^-4 max|v| in all), plus bfloat16's rounding of the output."""
    return 2 ** -4 * vmax + 2 ** -8 * float(np.abs(ref).max(initial=0.0)) + 1e-3


def lse_bound(ref_lse):
    """CUDA FP8 LSE bound: FP8 wgmma accumulates S with a reduced-precision adder (~1e-3 relative, test_fp8_sparse)."""
    return 3e-2 + 2e-3 * np.abs(ref_lse)


def check_cpu_twin(c, a, got, lse, index_state, fz):
    """A CPU block-sparse FP8 result is the float32 call on the dequantised arrays (the reference dequantises each
    value on load, in float32), rounded to bfloat16; the index kind's index is that call's, bit for bit."""
    tc = copy.copy(c)
    tc.fp8 = False
    t, ts = twin_arrays(c, a), {}
    if c.kind == "index":
        ts["index"] = fz.prepare_index(tc, t, t, ts)
        for n in ("segment_start", "segment_end", "block_ids", "cu_blocks", "k_mean", "v_mean"):
            assert np.array_equal(index_state["index"].host[n], ts["index"].host[n]), (n, c)
    want, want_lse = (fz.to_np(r) for r in fz.call(tc, t, None, index_state=ts))
    fz.assert_matches(c, got, lse, want, want_lse, 2 ** -8 * np.abs(want) + 1e-6, 1e-5 * (1 + np.abs(want_lse)))

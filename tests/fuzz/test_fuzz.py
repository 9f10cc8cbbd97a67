"""Fuzzer of the public entry points (issue 19): seeded random valid and invalid calls on CPU and CUDA.

Each case draws a problem (dense contiguous, dense paged, sparse_prefill, chunked_prefill over a paged cache, or
build_index + sparse_attention over a host index) with random batch, lengths (empty sequences, Lq > Lk, chunks),
head geometry, head dim, page size, mask, and then either leaves it valid or applies one mutation:
  host-detectable (every backend raises, naming the argument): head dim, head counts, array lengths, dtypes, out
    shape, scalars (max_seqlen, window, softmax_scale, alpha, block_size), workspaces too small, an index applied
    to another problem, a mean cache of another block size;
  device values (CPU raises; CUDA never reads them on the host): cu_seqlens_q / cu_seqlens_k past the rows, non-
    monotone, not starting at 0, not ending at the rows; lengths above max_seqlen_q / max_seqlen_k; seqused_k
    negative or beyond the pages of its block_table row; block_table ids outside the cache; index segments outside
    the block id array; listed block ids outside the sequence.
FP8 (about 30 % of the cases of every kind, needs torch; helpers in fuzz_fp8.py): float8_e4m3fn q, k, v with random
  [B, Hkv] descales (the index kind builds its index with them too); paged caches are uint8 bit patterns viewed as
  float8, random bytes (NaN codes included) past seqused_k; mutations of the descales' shape and dtype and mixed
  FP8 / bf16 operands (host) and a negative descale (a device value on CUDA: NaN rows and sp.check_errors() naming
  it; checked mode checks a host copy before the launch). Valid FP8 results: dense, or alpha 0, against the exact
  math on the dequantised values; the CPU's block-sparse FP8 results (and index) equal the float32 call on the
  dequantised arrays (the reference dequantises on load), and their index passes the selection check below; a
  CUDA block-sparse FP8 result (any kind) against the CPU backend over the device's index (correction means rounded
  to e4m3 as the kernel does), that index against the contract's selection on the dequantised values.
Array layouts (any case, valid or not): contiguous, or q (and k, v when contiguous KV) as strided views — rows and
heads padded by 16 bytes (8 elements, FP8 16: valid on every backend), heads interleaved (head stride 2·D: valid),
or rows padded by 8 bytes (4 elements, FP8 8: valid on the CPU; CUDA needs 16-byte strides and raises
NotImplementedError naming the array);
the host mutation last_stride gives q a last-dimension stride of 2 (an error naming q everywhere).
Selective cases (about half of the sparse / chunked / index cases, valid or not; fuzz_select.py): Gaussian q, k keep
every block at alpha > 0, so these draw keys with a few high-energy blocks per query span, lengths of several blocks
(CPU: block size 64, head dim 64, up to 896 keys; CUDA: block 128, up to 1536), alpha 0.05-0.6, every rule
(row_max, tile_energy, probe_row_max), sink / window / last_n of 0 or small, head sub-groups, union mode (15 %),
with the kinds' odd lengths, varlen, GQA, paged caches, mean caches and FP8.
Checks: every invalid call raises on the CPU with the argument's name; on CUDA a host-detectable one raises the
same way, and a device value is reported by sp.check_errors() (default mode: the call itself returns, writes
nothing outside `out`, and the report names the argument) and raises before the launch in checked mode
(LaunchOptions(checked=True)); no valid call is rejected; valid results match the reference: dense and alpha 0
against the exact math (CPU: the numpy sp_naive; CUDA: the CPU backend on the same bf16 inputs); block-sparse at
alpha > 0 (check_sparse): the index the call ran over (the index kind's own; else build_index with the call's
arguments on its device, deterministic) against fuzz_select's float64 selection of the contract, every block
outside a tie band in the log domain decided as the contract decides (CPU: 1e-4; CUDA: twice the bf16 scorer's
rounding bound, FP8 twice that), its pooled means to 1e-5, then the result against attention over that very index
(CPU: fuzz_select's float64 block-sparse reference; CUDA: the CPU backend over the device's index, the
correction's means rounded as the kernel's). A CUDA chunk with a mean cache runs over a cache that a whole-prompt
build_index step filled first (the contract: every step of the prompt passes the same cache). The report holds
the density of every valid sparse-kind case per kind (min, median, max, how many below 0.6, a histogram) and, for
the selective ones, their rules, sub-groups, union / correction / mean-cache counts and near-threshold flips.
The whole run is seeded (--fuzz-seed) and bounded (--fuzz-cases per device, --fuzz-time seconds); --fuzz-report
writes the summary (scripts/gpu.sh fuzz).
"""

import copy
import sys
import time

import numpy as np
import pytest

import sp_naive
import sparse_prefill as sp
import fuzz_fp8
import fuzz_select
from fuzz_fp8 import DESCALES, VALID_DESCALES, F8, cuda_bound, dequantised, e4m3_codes, fp8_round, lse_bound
from fuzz_summary import SUMMARY

try:
    import torch
except ImportError:  # the CPU cases need numpy only
    torch = None

FUZZ = sys.modules[__name__]  # this module's call / prepare_index / to_device, for fuzz_fp8's checks
HAVE_CUDA = bool(sp.with_cuda) and torch is not None and torch.cuda.is_available()
KINDS = ("dense", "paged", "sparse", "chunked", "index")
SPARSE_KINDS = ("sparse", "chunked", "index")
PAD = 3          # canary rows around `out`
CANARY = 7.0

HOST_MUTATIONS = ("head_dim", "heads", "cu_len", "cu_dtype", "out_shape", "max_neg", "window_bad", "scale_bad",
                  "v_dtype", "alpha_bad", "block_size_bad", "workspace_small", "scale_mismatch", "mean_cache_block",
                  "last_stride", "descale_shape", "descale_dtype", "qkv_mixed")
LAYOUTS = ("contiguous", "padded", "heads_strided", "padded4")
DEVICE_MUTATIONS = ("cu_q_over", "cu_q_nonmono", "cu_q_start", "cu_q_under", "max_q_small", "cu_k_over",
                    "cu_k_nonmono", "cu_k_start", "cu_k_under", "max_k_small", "used_over", "used_neg", "bt_bad",
                    "seg_bad", "id_bad", "descale_neg")
FP8_MUTATIONS = ("descale_shape", "descale_dtype", "descale_neg", "qkv_mixed")  # only for FP8 cases


def pytest_generate_tests(metafunc):
    if "case_id" not in metafunc.fixturenames:
        return
    opt = metafunc.config.getoption
    dev = opt("--fuzz-device")
    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "both": ["cpu", "cuda"],
               "auto": ["cpu"] + (["cuda"] if HAVE_CUDA else [])}[dev]
    n = opt("--fuzz-cases")
    ids = [(d, i) for d in devices for i in range(n)]
    metafunc.parametrize("case_id", ids, ids=[f"{d}-{i}" for d, i in ids])


# ------------------------------------------------------------------------------------------------------------------
# Case generation
# ------------------------------------------------------------------------------------------------------------------

class Case:
    """One generated call: the problem, the mutation, and what must happen."""

    def __init__(self, rng, device):
        self.device = device
        cuda = device == "cuda"
        self.kind = str(rng.choice(KINDS))
        sparse_kind = self.kind in SPARSE_KINDS
        self.B = int(rng.integers(1, 4))
        self.hq, self.hkv = [(2, 1), (4, 2), (8, 2), (4, 4), (8, 1)][int(rng.integers(5))]
        self.D = 128 if (cuda and sparse_kind) else int(rng.choice([64, 128]))
        # FP8 (float8_e4m3fn q, k, v with [B, Hkv] descales), any kind: CUDA runs head dim 128 and pages of a
        # multiple of 64 (the sparse kinds draw only those there), the rest raises NotImplementedError (counted as
        # unsupported); the CPU computes all.
        self.fp8 = torch is not None and rng.random() < 0.3
        # Selective cases (about half of the sparse kinds): keys with a few high-energy blocks per query span
        # (fuzz_select.selective_qkv), lengths of several blocks, the selection's other knobs drawn (the defaults'
        # sink 256, window 512 and last_n 2 keep every block of the short sequences here).
        self.selective = sparse_kind and rng.random() < 0.5
        self.block_size = 64 if self.selective and not cuda else 128  # CUDA: multiples of 128 only
        if self.selective and not cuda:  # long enough for the prefill triangle to have prunable blocks, yet cheap
            self.B, self.D = min(self.B, 2), 64
        top = (1536 if cuda else 896) if self.selective else (600 if cuda else 160)
        B = self.B
        if self.kind == "chunked":
            q = rng.integers(1, 140, B)
            k = q + 8 + rng.integers(0, 2 * top, B)  # room: a mutated chunk stays within its cache
        elif sparse_kind:
            k = rng.integers(top // 3 if self.selective else 1, top, B)
            q = k.copy() if rng.random() < 0.6 else np.minimum(k, rng.integers(1, top, B))
        else:
            q = rng.integers(0, top, B)
            k = q.copy() if rng.random() < 0.5 else rng.integers(0, top, B)
            if rng.random() < 0.3:  # a short query chunk against long keys (the split-KV dense path on CUDA)
                q = rng.integers(1, 20, B)
                k = rng.integers(200, 3 * top, B)
        self.q_lens, self.k_lens = q.astype(np.int64), k.astype(np.int64)
        self.paged = self.kind in ("paged", "chunked") or (sparse_kind and rng.random() < 0.4)
        self.page_size = int(rng.choice([64, 128] if sparse_kind else [1, 16, 64, 128, 48]))
        self.causal = True if sparse_kind else bool(rng.random() < 0.7)
        self.window = (-1, -1)
        if self.kind in ("dense", "paged") and rng.random() < 0.25:
            self.window = (int(rng.integers(0, 200)), int(rng.integers(-1, 50)) if not self.causal else -1)
        self.alpha = float(rng.choice([0.0, 0.1])) if sparse_kind else 0.0
        self.correction = bool(rng.random() < 0.7)
        self.sel = dict(sp.SELECTION_DEFAULTS, alpha=self.alpha, block_size=self.block_size, correction=self.correction)
        if self.selective:
            g = self.hq // self.hkv
            self.alpha = float(rng.choice([0.05, 0.1, 0.3, 0.6]))
            self.sel.update(alpha=self.alpha, rule=str(rng.choice(["row_max", "tile_energy", "probe_row_max",
                                                                 "probe_row_mass"])),
                            sink=int(rng.choice([0, 0, 64])), window=int(rng.choice([0, 0, 0, 64, 200])),
                            last_n=int(rng.choice([0, 0, 0, 1])),
                            head_subgroups=int(rng.choice([s for s in (0, 1, 2, 4, 8) if s == 0 or g % s == 0])),
                            dense_fraction=float(rng.choice([1.0, 1.0, 0.85, 0.6])))
            if self.sel["rule"].startswith("probe_"):  # their pooled-means term: the default or a sparser one
                self.sel.update(mean_alpha=float(rng.choice([0.5, 0.8, 0.95])))
        self.union = self.selective and rng.random() < 0.15
        self.final_chunk = bool(rng.random() < 0.5) if self.kind == "chunked" else True
        self.use_mean_cache = self.kind == "chunked" and rng.random() < 0.5
        self.use_workspace = cuda and rng.random() < 0.4
        self.seed = int(rng.integers(2**31))

        # The mutation: valid (about 1/3), host-detectable or a device value, among those that apply.
        applicable_device = [m for m in DEVICE_MUTATIONS if self._device_mutation_applies(m)]
        applicable_host = [m for m in HOST_MUTATIONS if self._host_mutation_applies(m)]
        r = rng.random()
        if r < 0.34 or not (applicable_device or applicable_host):
            self.mutation = None
        elif r < 0.55 and applicable_host:
            self.mutation = str(rng.choice(applicable_host))
        else:
            self.mutation = str(rng.choice(applicable_device or applicable_host))
        self.device_value = self.mutation in DEVICE_MUTATIONS
        # strided views (relayout): half the cases stay contiguous; misaligned rows only where they are the one thing
        # that is wrong (valid on the CPU, unsupported on CUDA)
        self.layout = str(rng.choice(LAYOUTS, p=[0.5, 0.2, 0.2, 0.1]))
        if self.layout == "padded4" and (self.mutation is not None or self.kind == "index"):
            self.layout = "padded"
        self.mrng = np.random.default_rng(self.seed + 1)
        # qkv_mixed: the operand turned bfloat16 (q: k then mismatches q's dtype, the error names k)
        self.mixed = str(self.mrng.choice(["q", "k", "v"])) if self.mutation == "qkv_mixed" else None
        if self.mutation == "bt_bad":
            self.window = (-1, -1)  # every page of the diagonal block is loaded by every path

    def _device_mutation_applies(self, m):
        contiguous = not self.paged
        if m in FP8_MUTATIONS:  # descale_neg: a (sequence, KV head) whose tiles run (CUDA checks it there)
            return self.fp8 and any(self.q_lens[b] >= 1 and self.k_lens[b] >= 1 for b in range(self.B))
        if self.kind == "index":  # the index is bound to the valid arrays: only its own arrays are mutated
            return m in ("seg_bad", "id_bad")
        if self.q_lens.sum() == 0:  # no query row: no tile runs, nothing is read (and nothing checked) on CUDA
            return False
        if self.kind == "chunked" and m in ("cu_q_nonmono", "cu_q_over", "cu_q_start"):
            return False  # on the CPU the chunk-within-its-cache rule (naming seqused_k) comes first
        if m in ("cu_q_nonmono", "cu_k_nonmono"):
            return self.B >= 2 and (m == "cu_q_nonmono" or contiguous)
        if m in ("cu_q_under", "max_q_small"):
            return self.q_lens[-1] >= 1 if m == "cu_q_under" else self.q_lens.max() >= 1
        if m in ("cu_k_over", "cu_k_start"):
            return contiguous
        if m == "cu_k_under":
            return contiguous and self.k_lens[-1] >= 1
        if m == "max_k_small":
            return self.k_lens.max() >= 1
        if m in ("used_over", "used_neg"):
            return self.paged
        if m == "bt_bad":
            return self.paged and any(self.k_lens[b] >= 1 and self.q_lens[b] >= 1 for b in range(self.B))
        if m in ("seg_bad", "id_bad"):
            return self.kind == "index"
        return True

    def _host_mutation_applies(self, m):
        if m in FP8_MUTATIONS:
            return self.fp8
        if self.kind == "index":
            return m == "scale_mismatch"
        if m == "last_stride":
            return self.D >= 2
        if m == "window_bad":
            return self.kind in ("dense", "paged")
        if m in ("alpha_bad", "block_size_bad"):
            return self.kind in ("sparse", "chunked") and not (m == "block_size_bad" and self.use_mean_cache)
        if m == "workspace_small":
            return self.device == "cuda" and self.kind in ("sparse", "chunked")
        if m == "scale_mismatch":
            return self.kind == "index"
        if m == "mean_cache_block":
            return self.kind == "chunked" and self.use_mean_cache
        return True

    def __repr__(self):
        return (f"Case({self.device} {self.kind} B={self.B} hq={self.hq} hkv={self.hkv} D={self.D} q={list(self.q_lens)} "
                f"k={list(self.k_lens)} paged={self.paged} page={self.page_size} causal={self.causal} "
                f"window={self.window} alpha={self.alpha} layout={self.layout} fp8={self.fp8} mutation={self.mutation} "
                f"selective={self.selective} sel={self.sel} union={self.union} final_chunk={self.final_chunk} "
                f"mean_cache={self.use_mean_cache} seed={self.seed})")


def expected_argument(m):
    return {"head_dim": "q", "heads": "k", "cu_len": None, "cu_dtype": "cu_seqlens_q", "out_shape": "out",
            "max_neg": "max_seqlen_q", "window_bad": "window", "scale_bad": "softmax_scale", "v_dtype": "v",
            "alpha_bad": "alpha", "block_size_bad": "block_size", "workspace_small": "workspace",
            "scale_mismatch": "softmax_scale", "mean_cache_block": "mean_cache", "last_stride": "q",
            "cu_q_over": "cu_seqlens_q", "cu_q_nonmono": "cu_seqlens_q", "cu_q_start": "cu_seqlens_q",
            "cu_q_under": "cu_seqlens_q", "max_q_small": "max_seqlen_q", "cu_k_over": "cu_seqlens_k",
            "cu_k_nonmono": "cu_seqlens_k", "cu_k_start": "cu_seqlens_k", "cu_k_under": "cu_seqlens_k",
            "max_k_small": "max_seqlen_k", "used_over": "seqused_k", "used_neg": "seqused_k",
            "bt_bad": "block_table", "seg_bad": "index.segment_start", "id_bad": "index.block_ids",
            "descale_shape": "k_descale", "descale_dtype": "q_descale", "descale_neg": "v_descale"}[m]


# ------------------------------------------------------------------------------------------------------------------
# Arrays of a case
# ------------------------------------------------------------------------------------------------------------------

def cu_of(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def build_arrays(c):
    """numpy float32 data and int32 index arrays of the valid problem, then the mutation (returns a dict)."""
    rng = np.random.default_rng(c.seed)
    hq, hkv, D = c.hq, c.hkv, c.D
    cu_q, cu_k = cu_of(c.q_lens), cu_of(c.k_lens)
    if c.selective:
        q, k, v = fuzz_select.selective_qkv(rng, c.q_lens, c.k_lens, hq, hkv, D, c.block_size)
    else:
        q = rng.standard_normal((int(cu_q[-1]), hq, D)).astype(np.float32)
        k = rng.standard_normal((int(cu_k[-1]), hkv, D)).astype(np.float32)
        v = rng.standard_normal((int(cu_k[-1]), hkv, D)).astype(np.float32)
    if c.fp8:  # values that float8_e4m3fn holds exactly (to_device casts them without rounding)
        q, k, v = (fp8_round(x) for x in (q, k, v))
    a = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "block_table": None, "seqused_k": None,
         "max_seqlen_q": int(c.q_lens.max(initial=0)), "max_seqlen_k": int(c.k_lens.max(initial=0)),
         "k_contig": k, "v_contig": v, "cu_k_contig": cu_k}
    if c.paged:
        ps = c.page_size
        pages = [int(-(-int(n) // ps)) for n in c.k_lens]
        num_pages = sum(pages) + 2
        perm = rng.permutation(num_pages)
        kc = (rng.standard_normal((num_pages, ps, hkv, D)) * 50).astype(np.float32)  # garbage past seqused_k
        vc = (rng.standard_normal((num_pages, ps, hkv, D)) * 50).astype(np.float32)
        if c.fp8:  # a uint8 cache of e4m3 codes (viewed as float8); garbage: any byte, NaN codes too (never read)
            kc, vc = (rng.integers(0, 256, kc.shape, dtype=np.uint8) for _ in range(2))
            k, v = e4m3_codes(k), e4m3_codes(v)
        bt = np.full((c.B, max(pages) + 1), -1, np.int32)
        nxt = 0
        for b in range(c.B):
            for p in range(pages[b]):
                page = int(perm[nxt]); nxt += 1
                bt[b, p] = page
                lo = int(cu_k[b]) + p * ps
                hi = min(lo + ps, int(cu_k[b + 1]))
                kc[page, :hi - lo] = k[lo:hi]
                vc[page, :hi - lo] = v[lo:hi]
        bt[bt < 0] = perm[-1]  # spare slots of the table: a valid page (never read past seqused_k)
        a.update(k=kc, v=vc, cu_seqlens_k=None, block_table=bt, seqused_k=c.k_lens.astype(np.int32))
    if c.fp8:
        for n in DESCALES:
            a[n] = a[VALID_DESCALES[n]] = rng.uniform(0.05, 0.5, (c.B, hkv)).astype(np.float32)
    mutate(c, a)
    return a


def mutate(c, a):
    m, r = c.mutation, c.mrng
    if m is None:
        return
    if m in DEVICE_MUTATIONS:  # max_seqlen bounds with room, so that the mutation is the only violation
        a["max_seqlen_q"] = int(a["q"].shape[0]) + 8
        a["max_seqlen_k"] = (int(a["k"].shape[0]) if not c.paged else a["block_table"].shape[1] * c.page_size) + 8
    cu_q = a["cu_seqlens_q"] = a["cu_seqlens_q"].copy()
    B = c.B
    if m == "cu_q_over":
        cu_q[-1] += int(r.integers(1, 5))
    elif m == "cu_q_nonmono":
        j = int(r.integers(1, B))
        cu_q[j] = cu_q[j - 1] - int(r.integers(1, 4))
    elif m == "cu_q_start":
        cu_q[0] = int(r.integers(1, 3))
    elif m == "cu_q_under":
        cu_q[-1] -= 1
    elif m == "max_q_small":
        a["max_seqlen_q"] = int(c.q_lens.max()) - 1
    elif m in ("cu_k_over", "cu_k_nonmono", "cu_k_start", "cu_k_under"):
        cu_k = a["cu_seqlens_k"] = a["cu_seqlens_k"].copy()
        if m == "cu_k_over":
            cu_k[-1] += int(r.integers(1, 5))
        elif m == "cu_k_nonmono":
            j = int(r.integers(1, B))
            cu_k[j] = cu_k[j - 1] - int(r.integers(1, 4))
        elif m == "cu_k_start":
            cu_k[0] = int(r.integers(1, 3))
        else:
            cu_k[-1] -= 1
    elif m == "max_k_small":
        a["max_seqlen_k"] = int(c.k_lens.max()) - 1
    elif m == "used_over":
        used = a["seqused_k"] = a["seqused_k"].copy()
        used[int(r.integers(B))] = a["block_table"].shape[1] * c.page_size + int(r.integers(1, 8))  # <= max_seqlen_k
    elif m == "used_neg":
        used = a["seqused_k"] = a["seqused_k"].copy()
        used[int(r.integers(B))] = -int(r.integers(1, 5))
    elif m == "bt_bad":
        bt = a["block_table"] = a["block_table"].copy()
        b = [b for b in range(B) if c.k_lens[b] >= 1 and c.q_lens[b] >= 1][int(r.integers(1000)) % sum(
            1 for b in range(B) if c.k_lens[b] >= 1 and c.q_lens[b] >= 1)]
        num_pages = a["k"].shape[0]
        bt[b, (int(c.k_lens[b]) - 1) // c.page_size] = int(r.choice([num_pages + int(r.integers(0, 9)), -1, -77]))
    elif m == "head_dim":  # 96: neither 64 nor 128
        for n in ("q", "k", "v"):
            x = a[n]
            a[n] = np.ascontiguousarray(x[..., :96] if x.shape[-1] == 128 else np.concatenate([x, x[..., :32]], -1))
    elif m == "heads":
        a["k"] = np.concatenate([a["k"], a["k"][..., :1, :]], axis=-2)  # Hkv + 1 heads (not dividing Hq)
        a["v"] = np.concatenate([a["v"], a["v"][..., :1, :]], axis=-2)
        if c.hq % (c.hkv + 1) == 0:  # still divides: a head dim other than q's instead (k and v alike)
            for n in ("k", "v"):
                a[n] = np.ascontiguousarray(a[n][..., :64] if c.D == 128 else np.concatenate([a[n]] * 2, -1))
    elif m == "cu_len":
        if c.paged:
            a["block_table"] = np.concatenate([a["block_table"], a["block_table"][:1]])
        else:
            a["cu_seqlens_k"] = np.concatenate([a["cu_seqlens_k"], a["cu_seqlens_k"][-1:]]).astype(np.int32)
    elif m == "cu_dtype":
        a["cu_seqlens_q"] = a["cu_seqlens_q"].astype(np.float32)
    elif m == "max_neg":
        a["max_seqlen_q"] = -1
    elif m == "v_dtype":
        a["v"] = a["v"].astype(np.float16)
    elif m == "descale_shape":
        a["k_descale"] = np.ones((c.B, c.hkv + 1), np.float32)
    elif m == "descale_dtype":
        a["q_descale"] = a["q_descale"].astype(np.float16)
    elif m == "descale_neg":
        d = a["v_descale"] = a["v_descale"].copy()
        live = [b for b in range(c.B) if c.q_lens[b] >= 1 and c.k_lens[b] >= 1]
        d[live[int(r.integers(len(live)))], int(r.integers(c.hkv))] *= -1.0


def expected_cu_len_argument(c):
    return "block_table" if c.paged else "cu_seqlens_k"


# ------------------------------------------------------------------------------------------------------------------
# Running a case
# ------------------------------------------------------------------------------------------------------------------

def to_device(a, c):
    """The arrays in the case's library: numpy float32 on the CPU, torch bf16 / int32 on CUDA; FP8 cases: torch on
    both, q / k / v float8_e4m3fn and the descales float32 (or the mutation's float16)."""
    if c.device == "cpu" and not c.fp8:
        return dict(a)
    out = {}
    for n, x in a.items():
        if isinstance(x, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(x))
            if n in DESCALES or n in VALID_DESCALES.values():
                pass
            elif c.fp8 and n in ("k", "v") and x.dtype == np.uint8:  # a paged cache of e4m3 bit patterns
                t = t.view(F8)
            elif c.fp8 and n in ("q", "k", "v", "k_contig", "v_contig") and x.dtype == np.float32:
                t = t.to(torch.float8_e4m3fn)
            elif x.dtype == np.float32 and n not in ("cu_seqlens_q",):
                t = t.to(torch.bfloat16)
            out[n] = t.cuda() if c.device == "cuda" else t
        else:
            out[n] = x
    return out


def strided_view(t, layout):
    """The values of t [rows, heads, D] (numpy or torch) as a non-contiguous view of a larger buffer."""
    rows, heads, D = t.shape
    if layout == "heads_strided":
        shape, view = (rows, 2 * heads, D), (slice(None), slice(0, None, 2), slice(None))
    elif layout == "last_stride":
        shape, view = (rows, heads, 2 * D), (slice(None), slice(None), slice(0, None, 2))
    else:  # padded (16-byte strides) or padded4 (8-byte strides): 8 or 4 elements, 16 or 8 for 1-byte FP8
        pad = (8 if layout == "padded" else 4) * (2 if not isinstance(t, np.ndarray) and t.dtype == F8 else 1)
        shape, view = (rows, heads, D + pad), (slice(None), slice(None), slice(0, D))
    if isinstance(t, np.ndarray):
        buf = np.full(shape, np.nan, t.dtype)
    elif t.dtype == torch.float8_e4m3fn:  # NaN bit patterns (0x7F)
        buf = torch.full(shape, 0x7F, dtype=torch.uint8, device=t.device).view(torch.float8_e4m3fn)
    else:
        buf = torch.full(shape, float("nan"), dtype=t.dtype, device=t.device)
    out = buf[view]
    out[...] = t
    return out


def relayout(x, c):
    """The case's array layout: q (and contiguous k, v) as strided views holding the same values; padding is NaN, so
    a kernel that reads it shows."""
    layout = "last_stride" if c.mutation == "last_stride" else c.layout
    if layout == "contiguous":
        return x
    x = dict(x)
    names = ("q",) if c.paged or layout == "last_stride" else ("q", "k", "v")
    for n in names:
        if x[n] is not None and x[n].ndim == 3:
            x[n] = strided_view(x[n], layout)
    return x


def canary_out(x, c):
    """`out` inside a buffer with PAD canary rows on each side (an out-of-bounds write shows there)."""
    total, hq, D = x["q"].shape
    if c.mutation == "out_shape":
        hq += 1
    if c.fp8:  # FP8 inputs write bfloat16
        buf = torch.full((total + 2 * PAD, hq, D), CANARY, dtype=torch.bfloat16, device=c.device)
    elif c.device == "cpu":
        buf = np.full((total + 2 * PAD, hq, D), CANARY, np.float32)
    else:
        buf = torch.full((total + 2 * PAD, hq, D), CANARY, dtype=x["q"].dtype, device="cuda")
    return buf, buf[PAD:PAD + total]


def canaries_intact(buf, c):
    if c.device == "cpu" and not c.fp8:
        return bool((buf[:PAD] == CANARY).all() and (buf[-PAD:] == CANARY).all())
    return bool((buf[:PAD] == CANARY).all().item() and (buf[-PAD:] == CANARY).all().item())


def call(c, x, out, options=None, index_state=None, reuse_index=False):
    """Runs the case's entry point; returns (out, lse)."""
    if c.mutation == "qkv_mixed":
        x = dict(x, **{c.mixed: x[c.mixed].to(torch.bfloat16)})
    kv = dict(block_table=x["block_table"], seqused_k=x["seqused_k"])
    scale = -1.0 if c.mutation == "scale_bad" else None
    sel = dict(selection(c), union=c.union)
    if c.mutation == "alpha_bad":
        sel["alpha"] = 1.5
    if c.mutation == "block_size_bad":
        sel["block_size"] = 96
    ws = None
    if c.device == "cuda" and (c.use_workspace or c.mutation == "workspace_small"):
        ws = torch.empty(256 if c.mutation == "workspace_small" else index_state.get("ws_bytes", 1 << 20), dtype=torch.uint8,
                         device="cuda")
    common = dict(causal=c.causal, softmax_scale=scale, out=out, return_lse=True, options=options, **kv)
    if c.fp8:
        common.update({n: x[n] for n in DESCALES})
    mq, mk = x["max_seqlen_q"], x["max_seqlen_k"]
    if c.kind in ("dense", "paged"):
        return sp.attention(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], mq, mk,
                            window=(-2, 0) if c.mutation == "window_bad" else c.window, **common)
    if c.kind == "sparse":
        return sp.sparse_prefill(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], mq, mk, workspace=ws,
                                 **sel, **common)
    if c.kind == "chunked":
        mc = index_state.get("mean_cache") if index_state else None
        if c.use_mean_cache and mc is None:
            mc = make_mean_cache(c, x)
        del common["causal"]
        for n in ("block_table", "seqused_k"):
            del common[n]
        return sp.chunked_prefill(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["block_table"], x["seqused_k"], mq,
                                  mk, final_chunk=c.final_chunk, mean_cache=mc, workspace=ws, **sel, **common)
    # index: the index of the valid problem (built beforehand), possibly corrupted, over this call's arrays
    index = index_state["index"]
    if c.mutation == "scale_mismatch":
        common["softmax_scale"] = 0.05
    return sp.sparse_attention(x["q"], x["k"], x["v"], index, x["cu_seqlens_q"], x["cu_seqlens_k"], mq, mk,
                               reuse_index=reuse_index, **common)


def selection(c):
    """The selection keywords of the case's calls (build_index, sparse_prefill, chunked_prefill)."""
    return dict(c.sel)


def make_mean_cache(c, x):
    """A zeroed pooled-means cache of the case's paged K (mutation mean_cache_block: of another block size)."""
    bs = c.block_size if c.mutation != "mean_cache_block" else (64 if c.block_size == 128 else 128)
    return sp.mean_cache(x["k"], block_size=bs)


def prime_mean_cache(c, a, x, mc):
    """Writes every complete block's means into the CUDA cache `mc` (a step over the whole of each cache: the
    contract's earlier steps), so that a chunk reading the blocks before it selects as a re-pooling step does."""
    kw = {n: x[VALID_DESCALES[n]] for n in DESCALES} if c.fp8 else {}
    rows = int(c.k_lens.sum())
    q0 = torch.zeros((rows, c.hq, c.D), dtype=torch.float32, device="cuda").to(x["k"].dtype)
    cu = torch.from_numpy(cu_of(c.k_lens)).cuda()
    sp.build_index(q0, x["k"], x["v"], cu, None, int(c.k_lens.max()), a["max_seqlen_k"], alpha=0.0,
                   block_size=c.block_size, block_table=x["block_table"], seqused_k=x["seqused_k"], mean_cache=mc, **kw)


def prepare_index(c, a, x, index_state):
    """A host index of the case's (valid) arrays, built on the case's device and copied to the host, with the index
    mutation applied to its arrays. FP8: built with the valid descales (the mutated ones go to sparse_attention);
    on CUDA a second host copy of a valid one is kept for the checks (index_state["device_built"])."""
    kv = dict(block_table=x["block_table"], seqused_k=x["seqused_k"])
    if c.fp8:
        kv.update({n: x[VALID_DESCALES[n]] for n in DESCALES})
    index = sp.build_index(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], a["max_seqlen_q"],
                           a["max_seqlen_k"], union=c.union, **selection(c), **kv)
    if index.on_device:
        if c.mutation is None:  # the oracle's own host copy (it rounds the means in place)
            index_state["device_built"] = index.to_host()
        index = index.to_host()
    h = index.host
    if c.mutation == "seg_bad":
        s = int(c.mrng.integers(len(h["segment_start"])))
        h["segment_start"][s] = -int(c.mrng.integers(1, 9))
    elif c.mutation == "id_bad":
        nonempty = np.nonzero(h["segment_end"] > h["segment_start"])[0]
        s = int(nonempty[int(c.mrng.integers(len(nonempty)))])
        cu_blocks = h["cu_blocks"]  # the sequence of segment s: its block count bounds the ids
        S = c.sel["head_subgroups"] or c.hq // c.hkv  # segments over Hkv * S virtual heads of g / S query heads
        tiles = [-(-int(n) * (c.hq // c.hkv // S) // 128) for n in c.q_lens]
        off = np.cumsum([0] + [c.hkv * S * t for t in tiles])
        b = int(np.searchsorted(off, s, side="right") - 1)
        nb = int(cu_blocks[b + 1] - cu_blocks[b])
        h["block_ids"][int(h["segment_end"][s]) - 1] = nb + int(c.mrng.integers(0, 5))
    return index


def reference(c, a):
    """The reference result of a valid case: (out, lse) as float64 numpy."""
    if c.fp8:  # the exact math on the dequantised values
        g = c.hq // c.hkv
        return sp_naive.attention(dequantised(c, a, "q", c.q_lens, g), dequantised(c, a, "k_contig", c.k_lens, 1),
                                  dequantised(c, a, "v_contig", c.k_lens, 1), a["cu_seqlens_q"], a["cu_k_contig"],
                                  causal=c.causal, window=c.window)
    if c.device == "cpu":
        return sp_naive.attention(a["q"], a["k_contig"], a["v_contig"], a["cu_seqlens_q"], a["cu_k_contig"],
                                  causal=c.causal, window=c.window)
    # CUDA: the CPU backend on the same bf16 values (dense attention = the alpha 0 sparse result)
    t = {n: torch.from_numpy(np.ascontiguousarray(a[n])).to(torch.bfloat16) for n in ("q", "k_contig", "v_contig")}
    out, lse = sp.attention(t["q"], t["k_contig"], t["v_contig"], torch.from_numpy(a["cu_seqlens_q"]),
                            torch.from_numpy(a["cu_k_contig"]), a["max_seqlen_q"], a["max_seqlen_k"],
                            causal=c.causal, window=c.window, return_lse=True)
    return out.float().numpy(), lse.numpy()


def to_np(x):
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return x.float().cpu().numpy().astype(np.float64)


def record(key, value=1):
    SUMMARY[key] = SUMMARY.get(key, 0) + value


def arg_of(e):
    return getattr(e, "argument", None) or str(e).split(":")[0]


def test_fuzz(case_id, request):
    device, i = case_id
    if device == "cuda" and not HAVE_CUDA:
        pytest.skip("needs a CUDA GPU and a CUDA build")
    cfg = request.config
    if time.time() - cfg._fuzz_start > cfg.getoption("--fuzz-time"):
        record("skipped_for_time")
        pytest.skip("past --fuzz-time")
    rng = np.random.default_rng([cfg.getoption("--fuzz-seed"), 0 if device == "cpu" else 1, i])
    c = Case(rng, device)
    record("cases")
    if c.fp8:
        record("fp8_cases")
        fp8 = SUMMARY.setdefault("fp8_kinds", {})
        fp8[c.kind] = fp8.get(c.kind, 0) + 1
        if c.mutation is None:
            fp8 = SUMMARY.setdefault("fp8_valid_kinds", {})
            fp8[c.kind] = fp8.get(c.kind, 0) + 1
    SUMMARY["kinds"][c.kind] = SUMMARY["kinds"].get(c.kind, 0) + 1
    SUMMARY["mutations"][str(c.mutation)] = SUMMARY["mutations"].get(str(c.mutation), 0) + 1
    SUMMARY["layouts"][c.layout] = SUMMARY["layouts"].get(c.layout, 0) + 1
    try:
        run_case(c)
    except BaseException:
        record("failures")
        SUMMARY["failed_cases"].append(f"{case_id}: {c!r}")
        raise


def run_case(c):
    a = build_arrays(c)  # the index kind mutates only its index (prepare_index), never the arrays
    x = relayout(to_device(a, c), c)
    index_state = {"x": x}
    if c.kind == "index":
        index_state["index"] = prepare_index(c, a, x, index_state)
    if c.use_mean_cache:
        index_state["mean_cache"] = mc = make_mean_cache(c, x)
        if c.device == "cuda" and c.mutation is None:  # the CPU pools every block itself
            prime_mean_cache(c, a, x, mc)
    if c.device == "cuda" and c.use_workspace and c.kind in ("sparse", "chunked"):
        try:  # the size function of the call's own shapes (computed from shapes only: device values never read)
            index_state["ws_bytes"] = sp.sparse_prefill_workspace_bytes(
                x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"],
                block_table=x["block_table"], seqused_k=x["seqused_k"], union=c.union, **selection(c))
        except (ValueError, TypeError):
            index_state["ws_bytes"] = 1 << 20  # a host-detectable mutation: the call raises before using it
    record(f"{c.device}_calls")
    if c.device == "cpu":
        return run_cpu(c, a, x, index_state)
    return run_cuda(c, a, x, index_state)


def expected(c):
    if c.mutation == "qkv_mixed":
        return "v" if c.mixed == "v" else "k"
    if c.mutation == "cu_len":
        return expected_cu_len_argument(c)
    return expected_argument(c.mutation)


def run_cpu(c, a, x, index_state):
    buf, out = canary_out(x, c)
    if c.mutation is not None:
        record("invalid_device" if c.device_value else "invalid_host")
        with pytest.raises((ValueError, TypeError)) as e:
            call(c, x, out, index_state=index_state)
        assert arg_of(e.value) == expected(c), (str(e.value), c)
        assert canaries_intact(buf, c)
        return
    record("valid")
    got, lse = call(c, x, out, index_state=index_state)
    assert canaries_intact(buf, c), c
    check_valid_result(c, a, got, lse, index_state)


def check_valid_result(c, a, got, lse, index_state):
    got, lse = to_np(got), to_np(lse)
    if c.fp8 and c.kind in SPARSE_KINDS and c.device == "cpu":
        fuzz_fp8.check_cpu_twin(c, a, got, lse, index_state, FUZZ)  # any alpha; alpha 0 also the exact math below
    if c.kind in SPARSE_KINDS and c.alpha > 0:
        return check_sparse(c, a, got, lse, index_state)
    if c.kind in SPARSE_KINDS:
        record_selection(c, 1.0, 0)  # alpha 0 keeps every visible block
    ref, ref_lse = reference(c, a)
    tol, ltol = (1e-4, 1e-4) if c.device == "cpu" else (3e-2, 3e-3)
    if c.fp8:  # bfloat16 output; CUDA also rounds P to e4m3 (2^-4 relative per weight, test_fp8.py's bound)
        vmax = float(np.abs(dequantised(c, a, "v_contig", c.k_lens, 1)).max(initial=0.0))
        tol = 2 ** -8 * float(np.abs(ref).max(initial=0.0)) + 1e-3 if c.device == "cpu" else cuda_bound(ref, vmax)
        ltol = 1e-3 if c.device == "cpu" else lse_bound(ref_lse)
    assert_matches(c, got, lse, ref, ref_lse, tol, ltol)


def oracle_values(c, a):
    """float64 q and contiguous k, v as the case's backend reads them: the float32 values on the CPU, rounded to
    bfloat16 on CUDA, dequantised for FP8."""
    if c.fp8:
        g = c.hq // c.hkv
        return (dequantised(c, a, "q", c.q_lens, g), dequantised(c, a, "k_contig", c.k_lens, 1),
                dequantised(c, a, "v_contig", c.k_lens, 1))
    vals = [np.ascontiguousarray(a[n]) for n in ("q", "k_contig", "v_contig")]
    if c.device == "cuda":
        vals = [torch.from_numpy(x).to(torch.bfloat16).double().numpy() for x in vals]
    return [x.astype(np.float64) for x in vals]


def case_index(c, a, index_state):
    """A host copy of the index the case's call ran over: the index kind's own; for sparse_prefill and
    chunked_prefill, build_index with the same arguments on the same device (the index stage is deterministic: its
    only atomics are integer counters), the mean cache included."""
    if c.kind == "index":
        built = index_state.get("device_built")
        return built if built is not None else index_state["index"]
    x = index_state["x"]
    kw = dict(block_table=x["block_table"], seqused_k=x["seqused_k"], union=c.union, **selection(c))
    if c.fp8:
        kw.update({n: x[n] for n in DESCALES})
    if c.kind == "chunked":
        kw["final_chunk"] = c.final_chunk
        if c.device == "cuda":
            kw["mean_cache"] = index_state.get("mean_cache")
    index = sp.build_index(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], a["max_seqlen_q"],
                           a["max_seqlen_k"], **kw)
    return index.to_host() if index.on_device else index


def check_sparse(c, a, got, lse, index_state):
    """A block-sparse result at alpha > 0. The selection: the index against the contract's (fuzz_select, float64)
    with a tie band in the log domain: 1e-4 on the CPU (float32 means), on CUDA the bound of the bf16 scorer
    (pooled keys rounded to bf16: |ds| <= 2^-9 |s|max for a score, a criterion takes two; FP8 also rounds q to bf16),
    doubled. The attention over that very index: on the CPU the float64 block-sparse reference; on CUDA the CPU
    backend over the device's index on the same inputs (the correction's means rounded as the kernel's)."""
    index = case_index(c, a, index_state)
    q, k, v = oracle_values(c, a)
    if c.device == "cpu":
        delta = lambda s: 1e-4 + 1e-6 * s  # noqa: E731
    else:
        delta = lambda s: (2 ** -5 if c.fp8 else 2 ** -6) * s + 1e-3  # noqa: E731
    sel = dict(selection(c), union=c.union, final_chunk=c.final_chunk)
    bands = fuzz_select.select_bands(q, k, c.q_lens, c.k_lens, c.hq, c.hkv, sel, delta)
    flips = fuzz_select.check_index(index, bands, c, c.sel["dense_fraction"])
    fuzz_select.check_means(index, k, v, c.k_lens, 1e-5)
    record_selection(c, index.density, flips)
    if c.device == "cpu":
        if c.fp8:  # check_cpu_twin compared it with the float32 call on the dequantised arrays
            return
        ref, ref_lse = fuzz_select.sparse_reference(q, k, v, c.q_lens, c.k_lens, c.hq, c.hkv, index, c.correction)
        return assert_matches(c, got, lse, ref, ref_lse, 1e-4, 1e-4)
    cc = copy.copy(c)
    cc.device, cc.use_workspace = "cpu", False
    if c.fp8:
        xc = to_device(a, cc)  # torch CPU tensors: FP8 q / k / v and the descales
        kw = {n: xc[n] for n in DESCALES}
        if c.correction:
            fuzz_fp8.e4m3_means(index, a["k_descale"], a["v_descale"])
    else:
        xc = {n: torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t for n, t in a.items()}
        for n in ("q", "k", "v"):
            xc[n] = xc[n].to(torch.bfloat16)
        kw = {}
        if c.correction:  # the kernel's correction keys and values are the means rounded to bf16
            for n in ("k_mean", "v_mean"):
                m = index.host[n]
                m[...] = torch.from_numpy(m).to(torch.bfloat16).float().numpy()
    want, want_lse = sp.sparse_attention(xc["q"], xc["k"], xc["v"], index, xc["cu_seqlens_q"], xc["cu_seqlens_k"],
                                         a["max_seqlen_q"], a["max_seqlen_k"], block_table=xc["block_table"],
                                         seqused_k=xc["seqused_k"], return_lse=True, reuse_index=True, **kw)
    want, want_lse = to_np(want), to_np(want_lse)
    if c.fp8:
        vmax = float(np.abs(v).max(initial=0.0))
        return assert_matches(c, got, lse, want, want_lse, cuda_bound(want, vmax), lse_bound(want_lse))
    assert_matches(c, got, lse, want, want_lse, 3e-2, 3e-3)


def record_selection(c, density, flips):
    """The density each valid sparse-kind case ran at (conftest summarises it per kind) and what it selected with."""
    SUMMARY.setdefault("densities", {}).setdefault(c.kind, []).append(round(float(density), 4))
    if not c.selective:
        return
    SUMMARY.setdefault("densities_selective", {}).setdefault(c.kind, []).append(round(float(density), 4))
    s = SUMMARY.setdefault("selection", {"cases": 0, "flips": 0, "union": 0, "correction": 0, "mean_cache": 0,
                                         "rules": {}, "head_subgroups": {}})
    s["cases"] += 1
    s["flips"] += int(flips)
    s["union"] += int(c.union)
    s["correction"] += int(c.correction)
    s["mean_cache"] += int(c.use_mean_cache)
    for key, val in (("rules", c.sel["rule"]), ("head_subgroups", str(c.sel["head_subgroups"]))):
        s[key][val] = s[key].get(val, 0) + 1


def assert_matches(c, got, lse, ref, ref_lse, tol, ltol):
    """|got - ref| <= tol and |lse - ref_lse| <= ltol (scalars or arrays of ref's shapes), the same -inf rows."""
    assert got.shape == ref.shape, c
    excess = np.abs(got - ref) - tol
    assert not (excess > 0).any() and not np.isnan(excess).any(), (float(np.nanmax(excess, initial=0.0)), c)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(fin, np.isfinite(lse)), c
    ltol = np.broadcast_to(ltol, ref_lse.shape)
    if fin.any():
        assert (np.abs(lse[fin] - ref_lse[fin]) <= ltol[fin]).all(), (np.abs(lse[fin] - ref_lse[fin]).max(), c)


def cuda_fp8_unbuilt(c):
    """An FP8 case the CUDA FP8 kernels are not built for (head dim != 128, pages of other than a multiple of 64
    rows); the generator draws none in the sparse kinds (head dim 128, pages of 64 / 128 there)."""
    return c.fp8 and (c.D != 128 or (c.paged and c.page_size % 64 != 0))


def run_cuda(c, a, x, index_state):
    sp.check_errors()  # nothing left over from an earlier case
    buf, out = canary_out(x, c)
    if c.mutation is not None and not c.device_value:
        record("invalid_host")
        with pytest.raises((ValueError, TypeError)) as e:
            call(c, x, out, index_state=index_state)
        assert arg_of(e.value) == expected(c), (str(e.value), c)
        torch.cuda.synchronize()
        assert canaries_intact(buf, c)
        sp.check_errors()
        return
    if c.device_value:
        record("invalid_device")
        try:
            call(c, x, out, index_state=index_state)  # default mode: no host read, the kernels bound every access
        except NotImplementedError:
            record("unsupported")
            return
        try:
            torch.cuda.synchronize()
        except RuntimeError:
            record("crashes")
            raise
        assert canaries_intact(buf, c), c
        with pytest.raises(ValueError) as e:
            sp.check_errors()
        assert arg_of(e.value) == expected(c), (str(e.value), c)
        record("flagged_by_check_errors")
        sp.check_errors()  # cleared
        with pytest.raises((ValueError, TypeError)) as e:
            call(c, x, out, options=sp.LaunchOptions(checked=True), index_state=index_state)
        assert arg_of(e.value) == expected(c), (str(e.value), c)
        record("raised_in_checked_mode")
        sp.check_errors()
        return
    record("valid")
    if c.layout == "padded4":  # 8-byte strides: TMA and the 16-byte stores need 16-byte strides
        # An FP8 case the FP8 kernel is not built for (head dim != 128, pages of other than a multiple of 64 rows) is
        # refused first for that (H200 at 64a9743: 4 of 3600 cases)
        unsupported = r"\bq\b|CUDA FP8 attention" if cuda_fp8_unbuilt(c) else r"\bq\b"
        with pytest.raises(NotImplementedError, match=unsupported):
            call(c, x, out, index_state=index_state)
        record("unsupported")
        return
    try:
        got, lse = call(c, x, out, index_state=index_state)
    except NotImplementedError as e:
        # FP8 where the FP8 kernels are built (16-byte strides here) is never refused: not counted as unsupported
        assert not c.fp8 or cuda_fp8_unbuilt(c), (str(e), c)
        record("unsupported")
        return
    torch.cuda.synchronize()
    sp.check_errors()  # a valid call is never flagged
    assert canaries_intact(buf, c), c
    check_valid_result(c, a, got, lse, index_state)
    if hash((c.seed, 1)) % 4 == 0:  # checked mode accepts valid calls
        call(c, x, out, options=sp.LaunchOptions(checked=True), index_state=index_state)


@pytest.mark.parametrize("rule", ["row_max", "tile_energy", "probe_row_max", "probe_row_mass"])
def test_selection_oracle_can_fail(rule):
    """The oracle of check_sparse rejects another alpha's selection (a block dropped, or one kept, outside the tie
    band), and its block-sparse reference tells the index's result from the dense one."""
    rng = np.random.default_rng(7)
    lens = np.array([700, 333])
    q, k, v = fuzz_select.selective_qkv(rng, lens, lens, 4, 2, 64, 64)
    cu = cu_of(lens)
    sel = dict(block_size=64, sink=0, window=0, last_n=0, head_subgroups=2, rule=rule, correction=True,
               mean_alpha=sp.SELECTION_DEFAULTS["mean_alpha"])
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    band = lambda alpha: fuzz_select.select_bands(  # noqa: E731
        q64, k64, lens, lens, 4, 2, dict(sel, alpha=alpha, union=False, final_chunk=True), lambda s: 1e-4)
    index = sp.build_index(q, k, v, cu, cu, 700, 700, alpha=0.3, **sel)
    assert index.density < 0.8
    assert fuzz_select.check_index(index, band(0.3), rule) == 0
    dense = sp.build_index(q, k, v, cu, cu, 700, 700, alpha=0.0, **sel)
    with pytest.raises(AssertionError, match="must"):  # alpha 0.05 keeps blocks that this index dropped
        fuzz_select.check_index(index, band(0.05), rule)
    with pytest.raises(AssertionError, match="may"):  # alpha 0 keeps blocks that alpha 0.3 drops
        fuzz_select.check_index(dense, band(0.3), rule)
    got, lse = sp.sparse_attention(q, k, v, index, cu, cu, 700, 700, return_lse=True)
    ref, ref_lse = fuzz_select.sparse_reference(q64, k64, v64, lens, lens, 4, 2, index, True)
    assert np.abs(got - ref).max() < 1e-4 and np.abs(lse - ref_lse).max() < 1e-4
    assert np.abs(got - fuzz_select.sparse_reference(q64, k64, v64, lens, lens, 4, 2, dense, True)[0]).max() > 1e-2

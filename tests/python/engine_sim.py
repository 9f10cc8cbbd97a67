"""A tiny paged-KV serving engine for the adapters' contract tests: requests, a page pool with a prefix cache over
full pages, chunked prefill, decode, page reuse. K/V/Q of a token depend on (layer, token id, position) only, so two
requests with the same prefix hold the same K/V there (what a real model gives) and the reference attention of any
row can be computed from the token list alone.

Engines differ in one place, what a full prefix hit leaves to compute (`full_hit`):
- 'vllm': all matched pages stay; the prompt's last token is recomputed and rewritten into its shared page;
- 'sglang': the match is cut to the pages before the last token (the last token lands in a fresh page).

FP8 KV caches (kv_cache_dtype fp8_e4m3): `Tables.fp8_scales(layer)` gives each layer its own q/k/v scales (what a
checkpoint's per-layer k_scale / v_scale / q_scale hold), `fp8_quant` is the tests' model of the engines'
quantisation (x / scale, saturated to +-448, cast to e4m3, as vLLM's QuantFP8 does),
`cache_rows` reads a request's rows back from a paged cache and `reference_attention` computes the expected output
of any rows (dense, or the library's selection) on the CPU reference.

Devices: `Geometry` is what a replay runs with on a device. The tables, caches, metadata and outputs live on the
replay's device; the references always run on the CPU (the library's exact reference) from `.cpu()` copies, and
`tolerance` says how far a device's output may be from them.
"""

import dataclasses
import functools

import numpy as np
import pytest
import torch

import sparse_prefill as sp
from sparse_prefill.integrations.core import SELECTION_FIELDS


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A replay's device and shapes. CUDA: the sparse and FP8 kernels take head dim 128, block_size % 128 == 0 and
    pages of a multiple of 64 (the mean-cache tracker needs pages of whole blocks: 128), and 16-bit models are
    bfloat16 (no float32 kernels); the CPU replays keep the float32 model, head dim 64 and pages of 64."""
    device: str
    page: int
    d: int
    dtype: torch.dtype


GEOMETRY = {"cpu": Geometry("cpu", 64, 64, torch.float32), "cuda": Geometry("cuda", 128, 128, torch.bfloat16)}

# the device parameter of the replays that also run on a GPU: the CUDA one needs a CUDA build and a GPU
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not (sp.with_cuda and torch.cuda.is_available()),
                                                   reason="needs the CUDA backend and a GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]


def on_cuda(*values):
    """A parameter set of a replay on the GPU (skipped where there is none)."""
    return pytest.param(*values, marks=CUDA_MARKS)


BF16_ROUNDING = 2 ** -8 + 1e-4   # relative: bfloat16's unit roundoff, + float32 summation-order noise


def cuda_sparse_support(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table=None,
                        seqused_k=None, causal=True, softmax_scale=None, q_descale=None, k_descale=None,
                        v_descale=None, qkv_dtype=None, selection=None, **keywords):
    """What a CUDA build's sp.sparse_support answers, for replays of the adapters' CUDA decisions on the CPU (where
    the library answers None: the reference runs everything): src/cuda/support.cpp's refusals of a sparse call, in
    its order, with its messages. test_sparse_support.py checks it against the real answers on the GPU."""
    sel = selection if selection is not None else sp.Selection(**keywords)
    d, lim = q.shape[-1], sp.CUDA_LIMITS
    if d not in lim.sparse_head_dims:
        return f"CUDA sparse attention is built for head dim {', '.join(map(str, lim.sparse_head_dims))} only, got {d}"
    if block_table is not None and k.shape[1] % lim.page_multiple:
        return (f"CUDA sparse attention: paged KV needs page_size % {lim.page_multiple} == 0 (TMA loads); got "
                f"page_size {k.shape[1]}")
    if not causal:
        return "CUDA sparse attention supports causal attention without an attention window only"
    if sel.block_size % 128:
        return ("CUDA sparse attention needs block_size % 128 == 0 (one listed block = whole 128-key kernel steps); "
                f"got block_size {sel.block_size}")
    if str(q.dtype).replace("torch.", "") not in lim.dtypes:
        return (f"q: CUDA attention supports {', '.join(lim.dtypes[:-1])} and {lim.dtypes[-1]} inputs only, got "
                f"{str(q.dtype).replace('torch.', '')}")
    return None


def cuda_fp8_attention_support(head_dim, page_size=None):
    """What a CUDA build's sp.fp8_attention_support answers (src/cuda/support.cpp), for the replays; checked against
    the real one on the GPU (test_sparse_support.py)."""
    lim = sp.CUDA_LIMITS
    if head_dim not in lim.sparse_head_dims:
        return (f"CUDA FP8 attention is built for head dim {', '.join(map(str, lim.sparse_head_dims))} only, got head "
                f"dim {head_dim} (FP8 runs on the CPU reference for any head dim)")
    if page_size is not None and page_size % lim.page_multiple:
        return (f"CUDA FP8 attention: paged KV needs page_size % {lim.page_multiple} == 0 (TMA loads; the cp.async "
                f"gather of other page sizes is not built for FP8); got page_size {page_size}")
    return None


def replay_cuda(monkeypatch):
    """The adapters decide as on CUDA while the arrays stay on the CPU: core._on_cuda says True, and sp.sparse_support
    and sp.fp8_attention_support answer as a CUDA build does (the stand-ins above)."""
    from sparse_prefill.integrations import core
    monkeypatch.setattr(core, "_on_cuda", lambda t: True)
    monkeypatch.setattr(sp, "sparse_support", cuda_sparse_support)
    monkeypatch.setattr(sp, "fp8_attention_support", cuda_fp8_attention_support)


def tolerance(device, ref, v_max, fp8):
    """How far an output may be from the CPU reference `ref` computed on the very values the kernel read (the cache's
    contents, dequantised for FP8). CPU: float32 accumulation noise (a float32 model) or the bfloat16 output rounding
    (FP8, relative). CUDA: as the kernels' own GPU tests (test_cuda.py, test_fp8_sparse.py): P rounded to the PV
    matmul's operand type (bf16 2^-8, e4m3 2^-4, relative per weight: times max|v|), plus bf16's rounding of the
    output, plus accumulation order."""
    if torch.device(device).type == "cpu":
        return BF16_ROUNDING * ref.abs().clamp_min(1e-3) if fp8 else torch.full_like(ref, 2e-4)
    p_rounding = 2 ** -4 if fp8 else 2 ** -8
    return torch.full_like(ref, p_rounding * v_max + 2 ** -8 * ref.abs().max().item() + 1e-3)


def compare_rows(checks, got, ref, v_max, fp8):
    """One (request, chunk) entry of a layer: got (any device) against the CPU reference; records the worst
    error / tolerance ratio and counts the entries beyond their tolerance (checks['over_tol'])."""
    got = got.float().cpu()
    assert torch.isfinite(got).all()
    ratio = ((got - ref.float()).abs() / tolerance(checks["device"], ref.float(), v_max, fp8)).max().item()
    checks["worst_ratio"] = max(checks.get("worst_ratio", 0.0), ratio)
    checks["over_tol"] = checks.get("over_tol", 0) + (ratio > 1)
    checks["rows"] += 1


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def flips_allowed(rows):
    """Entries a CUDA sparse replay may have beyond tolerance: bf16 scoring on the GPU against double on the CPU
    flips near-threshold blocks (test_cuda.py allows max(2, kept // 200) blocks, test_fp8_sparse.py max(4, kept //
    50)); a flipped block changes the rows of one 128-query tile, one entry. A wrong table, length or mean breaks
    most entries."""
    return max(3, rows // 50)


def check_selection_rows(checks, device, sparse):
    """Every entry within its device's tolerance, except (CUDA, sparse selection) a few whose tile's selection
    flipped a near-threshold block (flips_allowed)."""
    if device == "cuda" and sparse:
        assert checks["over_tol"] <= flips_allowed(checks["rows"]), checks
        assert checks["worst_orig_mean"] < 0.05, checks
    else:
        assert checks["worst_ratio"] <= 1, checks


class Tables:
    def __init__(self, layers=2, hq=4, hkv=2, d=64, vocab=61, max_pos=4096, seed=0, device="cpu"):
        g = np.random.default_rng(seed)
        self.layers, self.hq, self.hkv, self.d = layers, hq, hkv, d
        self.device = torch.device(device)
        # a few "topics" so that selection has something to select
        f = lambda x: torch.from_numpy(x.astype(np.float32)).to(self.device)  # noqa: E731
        self.k = f(g.standard_normal((layers, vocab, hkv, d)))
        self.v = f(g.standard_normal((layers, vocab, hkv, d)))
        self.q = f(g.standard_normal((layers, vocab, hq, d)))
        self.pos = f(0.3 * g.standard_normal((max_pos, 1, d)))

    def kv(self, layer, tokens, start=0):
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        p = self.pos[start:start + len(t)]
        return self.k[layer, t] + p, self.v[layer, t] - p

    def qs(self, layer, tokens, start=0):
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        return self.q[layer, t] + self.pos[start:start + len(t)]

    def fp8_scales(self, layer):
        """(q_scale, k_scale, v_scale) of a layer: float32 0-d tensors, different in every layer and for q, k, v
        (|k| / k_scale and |v| / v_scale stay within e4m3's +-448, below ~380: SGLang's pool casts without saturating,
        and torch 2.11 turns |x| >= 464 into NaN where 2.15 saturates; q's largest values saturate in fp8_quant)."""
        base = 1.0 + 0.37 * layer
        return tuple(torch.tensor(x, device=self.device)
                     for x in (0.0107 * base, 0.0181 / base, 0.0137 * (1.0 + 0.61 * layer)))


F8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def fp8_quant(x, scale):
    """x / scale, saturated, as float8_e4m3fn (scale: a number or a float32 tensor; None = 1)."""
    x = x.float() if scale is None else x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(F8)


def cache_rows(cache, pages, n, page_size):
    """Rows [0, n) of a request whose pages are `pages`, read from a paged cache [num_pages, page_size, Hkv, D] on
    any device: a CPU copy."""
    idx = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)], dtype=torch.long)
    return cache.reshape(-1, *cache.shape[2:])[idx.to(cache.device)].cpu()


def reference_attention(q, k, v, config=None):
    """Causal (bottom-right) attention of q [n, Hq, D] over k, v [m, Hkv, D] (one sequence) on the CPU reference
    (CPU copies of inputs on any device): dense when config is None or alpha 0, else the library's selection with
    config's parameters."""
    import sparse_prefill as sp
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    n, m = q.shape[0], k.shape[0]
    cu_q = torch.tensor([0, n], dtype=torch.int32)
    cu_k = torch.tensor([0, m], dtype=torch.int32)
    if config is None:
        return sp.attention(q, k, v, cu_q, cu_k, n, m)
    return sp.sparse_prefill(q, k, v, cu_q, cu_k, n, m, final_chunk=config.final_chunk == "always",
                             **config.selection())


class Request:
    def __init__(self, rid, prompt, max_new):
        self.rid, self.tokens, self.prompt_len, self.max_new = rid, list(prompt), len(prompt), max_new
        self.pages = []
        self.computed = 0           # tokens whose K/V are in the cache
        self.done = False

    @property
    def generated(self):
        return len(self.tokens) - self.prompt_len


class Engine:
    def __init__(self, num_pages, page_size, full_hit="vllm", chunk=96):
        self.page_size, self.full_hit, self.chunk = page_size, full_hit, chunk
        self.free = list(range(num_pages - 1, -1, -1))
        self.cache = {}           # tuple(tokens of full pages) -> page id
        self.ref = {}
        self.running = []
        self.stats = {"prefix_hit_tokens": 0, "decode_completed_pages": set(), "reused_pages": 0}
        self.used_once = set()

    def _alloc(self):
        page = self.free.pop()
        if page in self.used_once:
            self.stats["reused_pages"] += 1
        self.used_once.add(page)
        self.ref[page] = 1
        return page

    def add(self, req):
        P = self.page_size
        n_full = len(req.tokens) // P
        matched = 0
        for i in range(n_full):
            page = self.cache.get(tuple(req.tokens[: (i + 1) * P]))
            if page is None:
                break
            req.pages.append(page)
            self.ref[page] = self.ref.get(page, 0) + 1
            matched = (i + 1) * P
        if matched >= len(req.tokens):            # a full hit: something must still be computed
            if self.full_hit == "vllm":
                matched = len(req.tokens) - 1
            else:
                keep = (len(req.tokens) - 1) // P
                for page in req.pages[keep:]:
                    self.ref[page] -= 1
                req.pages = req.pages[:keep]
                matched = keep * P
        req.computed = matched
        self.stats["prefix_hit_tokens"] += matched
        self.running.append(req)

    def _ensure_pages(self, req, upto):
        while len(req.pages) * self.page_size < upto:
            req.pages.append(self._alloc())

    def schedule(self, budget=10**9):
        """One step: [(req, start, num_tokens, is_decode)], decodes first (vLLM's order), then prefill chunks."""
        rows = []
        for req in self.running:
            if req.done or req.computed < len(req.tokens) - 1 or req.computed == 0:
                continue
            if req.computed == len(req.tokens) - 1 and req.generated > 0:
                rows.append((req, req.computed, 1, True))
        for req in self.running:
            if req.done or any(r[0] is req for r in rows):
                continue
            left = len(req.tokens) - req.computed
            if left <= 0:
                continue
            n = min(left, self.chunk, budget)
            rows.append((req, req.computed, n, n == 1))
        for req, start, n, _ in rows:
            self._ensure_pages(req, start + n)
        return rows

    def slots(self, req, start, n):
        P = self.page_size
        return [req.pages[p // P] * P + p % P for p in range(start, start + n)]

    def commit(self, rows, next_token):
        """After a step: advance, register full pages in the prefix cache, append a token to requests that finished
        their prompt or decoded (next_token(req) -> id)."""
        P = self.page_size
        for req, start, n, is_decode in rows:
            req.computed = start + n
            for i in range(start // P, req.computed // P):
                key = tuple(req.tokens[: (i + 1) * P])
                if key not in self.cache:
                    self.cache[key] = req.pages[i]
                    if is_decode or start >= req.prompt_len:
                        self.stats["decode_completed_pages"].add(req.pages[i])
            if req.computed == len(req.tokens):
                if req.generated < req.max_new:
                    req.tokens.append(next_token(req))
                else:
                    self.finish(req)

    def finish(self, req):
        req.done = True
        self.running.remove(req)
        cached = set(self.cache.values())
        for page in req.pages:
            self.ref[page] -= 1
            if self.ref[page] == 0 and page not in cached:
                self.free.append(page)


def next_token(req):
    return (sum(req.tokens[-7:]) * 31 + len(req.tokens)) % 61


def layer_config(config, layer):
    """The configuration one layer runs: its selection (config.selection(layer)) at the top level, no per-layer
    entries; what the replays' references and direct calls use for that layer."""
    return dataclasses.replace(config, layers=None, **config.selection(layer))


class LibrarySpy:
    """Stands in for sparse_prefill.torch_ops inside integrations.core (monkeypatch core.spt with it: the adapters'
    one path into the library's compute): records which operator wrapper each adapter call reached and with which
    selection keywords, then makes the call."""

    SPIED = ("attention", "sparse_prefill", "chunked_prefill")
    SELECTION = SELECTION_FIELDS  # the adapters' selection keywords (the library's table less two)

    def __init__(self, module=None):
        if module is None:
            import sparse_prefill.torch_ops as module
        self._module = module
        self.calls = []

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if name not in self.SPIED:
            return fn

        @functools.wraps(fn)          # the signature stays the library's (core reads its defaults from it)
        def spy(*args, **kwargs):
            self.calls.append((name, {k: kwargs[k] for k in self.SELECTION if k in kwargs}))
            return fn(*args, **kwargs)
        return spy


def reference_rows(tables, layer, req, start, n, config=None):
    """The expected output of rows [start, start + n) of req: dense (config None or alpha 0) or the library's sparse
    selection on the contiguous sequence (same parameters), on the CPU reference."""
    k, v = tables.kv(layer, req.tokens[: start + n])
    q = tables.qs(layer, req.tokens[start:start + n], start)
    return reference_attention(q, k, v, config)

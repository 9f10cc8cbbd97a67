"""SGLang adapter: contract tests against faithful fakes of SGLang's ForwardBatch (forward_mode, req_pool_indices,
seq_lens/_cpu, extend_seq_lens/_cpu, extend_prefix_lens_cpu, out_cache_loc), ReqToTokenPool (req_to_token token
slots), MHATokenToKVPool ([size + page_size, Hkv, D] per layer, set_kv_buffer/get_kv_buffer) and RadixAttention,
with HybridAttnBackend's routing (extend -> our backend, decode -> FA3, which writes through the same pool). Replays
metadata once per step, then per layer the write and the attention, over chunked steps with radix prefix hits (on
pages decode completed), mixed decode rows in extend batches and page reuse; checked against the CPU reference.
Conformance tests run where sglang imports."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
import sparse_prefill as sp  # noqa: E402
from engine_sim import (DEVICES, F8, GEOMETRY, Engine, Request, Tables, cache_rows, compare_rows,  # noqa: E402
                        LibrarySpy, check_selection_rows, layer_config, next_token, on_cuda, reference_attention,
                        reference_rows, replay_cuda, same_bits)
from sparse_prefill.integrations import SparsePrefillConfig  # noqa: E402
from sparse_prefill.integrations import core  # noqa: E402
from sparse_prefill.integrations import sglang as sps

PAGE = 64


class ForwardMode:
    def __init__(self, name):
        self.name = name

    def is_decode(self):
        return self.name == "decode"

    def is_idle(self):
        return self.name == "idle"

    def is_extend(self):
        return self.name in ("extend", "mixed")


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_seq_lens: torch.Tensor = None
    extend_prefix_lens: torch.Tensor = None
    extend_seq_lens_cpu: list = None
    extend_prefix_lens_cpu: list = None
    positions: torch.Tensor = None


class ReqToTokenPool:
    def __init__(self, size, max_context_len, device="cpu"):
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=device)


class MHATokenToKVPool:
    """SGLang's pool: per layer [size + page_size, Hkv, D]; an FP8 pool (dtype float8_e4m3fn) stores uint8 and hands
    out float8 views; its write divides the caller's k/v in place by k_scale/v_scale (when given), then casts."""

    def __init__(self, size, page_size, head_num, head_dim, layer_num, dtype=torch.float32, device="cpu"):
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.store_dtype = torch.uint8 if dtype == F8 else dtype
        z = dict(dtype=self.store_dtype, device=device)
        self.k_buffer = [torch.zeros(size + page_size, head_num, head_dim, **z) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(size + page_size, head_num, head_dim, **z) for _ in range(layer_num)]

    def get_kv_buffer(self, layer_id):
        k, v = self.k_buffer[layer_id], self.v_buffer[layer_id]
        if self.store_dtype != self.dtype:
            k, v = k.view(self.dtype), v.view(self.dtype)
        return k, v

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None, layer_id_override=None):
        lid = layer.layer_id if layer_id_override is None else layer_id_override
        if cache_k.dtype != self.dtype:
            if k_scale is not None:
                cache_k.div_(k_scale)
            if v_scale is not None:
                cache_v.div_(v_scale)
            cache_k, cache_v = cache_k.to(self.dtype), cache_v.to(self.dtype)
        if self.store_dtype != self.dtype:
            cache_k, cache_v = cache_k.view(self.store_dtype), cache_v.view(self.store_dtype)
        self.k_buffer[lid][loc.long()] = cache_k
        self.v_buffer[lid][loc.long()] = cache_v


@dataclasses.dataclass
class RadixAttention:
    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    head_dim: int
    scaling: float
    v_head_dim: int = None
    logit_cap: float = 0.0
    sliding_window_size: int = -1
    is_cross_attention: bool = False
    k_scale: object = None
    v_scale: object = None

    def __post_init__(self):
        self.v_head_dim = self.v_head_dim or self.head_dim


class FakeFA3Backend:
    """FA3's role: decode (writes K/V via the pool, then paged attention with a token-level page table), and extend
    for the layers our backend hands over. FP8 (kv_cache_dtype_str != 'auto') as SGLang's FA3: q = q.to(e4m3) with
    no q scale, k/v descales = layer.k_scale / v_scale expanded to [B, Hkv] when the layer has scales."""

    calls = []

    def __init__(self, runner):
        self.runner = runner
        self.kv_cache_dtype_str = runner.kv_cache_dtype_str

    def init_forward_metadata(self, fb):
        self.fb = fb

    def _attend(self, q, layer, fb, cu_q, max_q):
        pool = self.runner.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        B, ps = fb.batch_size, self.runner.page_size
        max_k = int(fb.seq_lens_cpu.max())
        # FA3's page table for page_size > 1: every page_size-th token slot // page_size (the CUDA kernels read
        # pages of a multiple of 64, FP8 ones no other)
        table = self.runner.req_to_token_pool.req_to_token[fb.req_pool_indices, : -(-max_k // ps) * ps][:, ::ps] // ps
        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        descales = {}
        if self.kv_cache_dtype_str != "auto":
            if layer.k_scale is not None:
                descales = dict(k_descale=layer.k_scale.expand(B, hkv), v_descale=layer.v_scale.expand(B, hkv))
            q = q.to(F8)
        out = sp.attention(q.reshape(-1, hq, d), k_buf.view(-1, ps, hkv, d), v_buf.view(-1, ps, hkv, d), cu_q, None,
                           max_q, max_k, softmax_scale=layer.scaling, block_table=table.contiguous(),
                           seqused_k=fb.seq_lens.to(torch.int32), **descales)
        return out.reshape(-1, hq * d)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        FakeFA3Backend.calls.append(("decode", q.shape[0]))
        if save_kv_cache:
            self.runner.token_to_kv_pool.set_kv_buffer(layer, fb.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        cu_q = torch.arange(fb.batch_size + 1, dtype=torch.int32, device=q.device)
        return self._attend(q, layer, fb, cu_q, 1)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        FakeFA3Backend.calls.append(("extend", q.shape[0]))
        if save_kv_cache:
            self.runner.token_to_kv_pool.set_kv_buffer(layer, fb.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        cu_q = torch.zeros(fb.batch_size + 1, dtype=torch.int32, device=q.device)
        cu_q[1:] = torch.cumsum(fb.extend_seq_lens, 0)
        return self._attend(q, layer, fb, cu_q, max(fb.extend_seq_lens_cpu))

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        FakeFA3Backend.calls.append(("graph", max_bs))


class FakeBase:
    """SGLang's AttentionBackend.forward routing (decode -> forward_decode, else forward_extend)."""

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)


class Runner:
    def __init__(self, num_pages, tables, dtype="auto", geom=GEOMETRY["cpu"]):
        self.page_size = page = geom.page
        self.kv_cache_dtype_str = dtype
        self.kv_cache_dtype = {"fp8_e4m3": F8, "fp8_e5m2": torch.float8_e5m2}.get(dtype, geom.dtype)
        self.req_to_token_pool = ReqToTokenPool(16, 2048, geom.device)
        self.token_to_kv_pool = MHATokenToKVPool(num_pages * page, page, tables.hkv, tables.d, tables.layers,
                                                 dtype=self.kv_cache_dtype, device=geom.device)


Backend = sps.make_backend_class(FakeBase, FakeFA3Backend)


def _config(geom=GEOMETRY["cpu"], **kw):
    base = dict(block_size=geom.page, min_sparse_q_len=1, min_sparse_kv_len=0, sink=64, window=64)
    base.update(kw)
    return SparsePrefillConfig.load(environ={}, **base)


@dataclasses.dataclass
class Fp8Run:
    """An FP8 (--kv-cache-dtype fp8_e4m3) replay and what it checks."""
    scales: bool = True        # the checkpoint has k/v scales (layer.k_scale / v_scale); else None (scale 1)
    path: str = "sparse"       # what serves extend batches: 'sparse' / 'dense' / 'by_length' (the dispatch) or 'fa3'
    bf16_reference: bool = False


class DispatchRecorder:
    """Wraps the backend's dispatch: keeps the mean cache it was given as it was at the call (the direct call of the
    test reads the same means)."""

    def __init__(self, dispatch):
        self.inner, self.means, self.seen = dispatch, None, []

    def __call__(self, *args, mean_cache=None, **kwargs):
        self.means = None if mean_cache is None else (mean_cache[0].clone(), mean_cache[1].clone())
        self.seen.append((args, kwargs))
        return self.inner(*args, mean_cache=mean_cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run(config, mixed=True, check_means=True, steps=70, fp8=None, seed=3, d=None, geom=GEOMETRY["cpu"], exact=False):
    """Replays on geom.device; returns (worst error / tolerance, engine, backend, checks). Every row is compared with
    attention on what the kernels read (the pool's contents; FP8: dequantised) on the CPU reference, within
    `engine_sim.tolerance` of the device (checks['worst_ratio'], checks['over_tol']), and with the original values
    (checks['worst_orig']); exact (always with fp8): every extend call must equal the library's direct call bit for
    bit. fp8 (an Fp8Run): the pool is an FP8 pool (uint8 storage, float8 views), the model dtype bfloat16, each layer
    has its own k/v scales (loaded into the layers after the backend was built, as SGLang's
    process_weights_after_loading copies them in place) or none."""
    dev, page = geom.device, geom.page
    tables = Tables(seed=seed, d=d or geom.d, device=dev)
    num_pages = 40
    runner = Runner(num_pages, tables, dtype="fp8_e4m3" if fp8 else "auto", geom=geom)
    hq, hkv, d, L = tables.hq, tables.hkv, tables.d, tables.layers
    layers = [RadixAttention(i, hq, hkv, d, d ** -0.5) for i in range(L)]
    if fp8 and fp8.scales:
        for lay in layers:            # SGLang's BaseKVCacheMethod: -1.0 until the checkpoint's are loaded
            lay.k_scale, lay.v_scale = torch.tensor(-1.0, device=dev), torch.tensor(-1.0, device=dev)
    backend = Backend(runner, config=config)
    backend.dispatch = recorder = DispatchRecorder(backend.dispatch)
    if fp8 and fp8.scales:
        for lay in layers:
            _, ks, vs = tables.fp8_scales(lay.layer_id)
            lay.k_scale.copy_(ks)
            lay.v_scale.copy_(vs)
    decode_backend = FakeFA3Backend(runner)          # HybridAttnBackend: decode goes to FA3, not to us
    eng = Engine(num_pages, page, full_hit="sglang", chunk=100)
    slot_of_req = {}
    g = torch.Generator().manual_seed(seed + 2)
    # B's prefix ends with a page that A's decode completes (320 with pages of 64, 256 with pages of 128)
    prompt = 260 if page == 64 else 200
    prefix = (prompt // page + 1) * page
    a = Request("A", torch.randint(0, 61, (prompt,), generator=g).tolist(), max_new=80)
    checks = {"extend_steps": 0, "decode_steps": 0, "mixed_rows": 0, "mean_blocks": 0, "exact_calls": 0,
              "worst_ratio": 0.0, "over_tol": 0, "worst_orig": 0.0, "worst_orig_mean": 0.0, "worst_bf16": 0.0,
              "rows": 0, "device": dev, "prefix": prefix}
    sent = set()
    for step in range(steps):
        if step == 0:
            eng.add(a)
        if "B" not in sent and a.computed >= prefix:
            eng.add(Request("B", a.tokens[:prefix] + torch.randint(0, 61, (130,), generator=g).tolist(), max_new=3))
            sent.add("B")
        if step == 4:
            eng.add(Request("D", torch.randint(0, 61, (150,), generator=g).tolist(), max_new=30))
        rows = eng.schedule()
        if not rows:
            break
        for r, *_ in rows:
            slot_of_req.setdefault(r.rid, len(slot_of_req))
        # SGLang runs extend batches and decode batches separately; mixed chunks put decode rows into extend
        dec = [x for x in rows if x[3] and x[0].generated > 0]
        ext = [x for x in rows if x not in dec]
        batches = []
        if ext:
            batches.append(("mixed" if mixed and dec else "extend", ext + (dec if mixed else [])))
            if not mixed and dec:
                batches.append(("decode", dec))
        elif dec:
            batches.append(("decode", dec))
        for mode, brows in batches:
            fb = make_batch(mode, brows, eng, runner, slot_of_req)
            be = backend if mode != "decode" else decode_backend
            if mode == "decode":
                checks["decode_steps"] += 1
            else:
                checks["extend_steps"] += 1
                checks["mixed_rows"] += sum(1 for x in brows if x[2] == 1)
            be.init_forward_metadata(fb)                  # once per step
            for layer in layers:
                toks = [(r, s, n) for r, s, n, _ in brows]
                q = torch.cat([tables.qs(layer.layer_id, r.tokens[s:s + n], s) for r, s, n in toks])
                k, v = map(torch.cat, zip(*[tables.kv(layer.layer_id, r.tokens[s:s + n], s) for r, s, n in toks]))
                if fp8 or geom.dtype != torch.float32:
                    q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
                if mode == "decode":
                    out = be.forward_decode(q.reshape(-1, hq * d), k, v, layer, fb)
                else:
                    out = backend.forward(q.reshape(-1, hq * d), k, v, layer, fb)
                o = out.view(-1, hq, d)
                if check_means:
                    checks["mean_blocks"] += check_means_fn(backend, runner, tables, layer, eng, brows, fp8)
                _check_layer(fp8, exact, config, backend, recorder, runner, layer, mode, q, o, toks, tables, checks)
        eng.commit(rows, next_token)
    return checks["worst_ratio"], eng, backend, checks


def _fp8_pool(runner, layer):
    """The layer's pool as paged caches (FP8: float8 views)."""
    k_buf, v_buf = runner.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    hkv, d, ps = layer.tp_k_head_num, layer.head_dim, runner.page_size
    return k_buf.view(-1, ps, hkv, d), v_buf.view(-1, ps, hkv, d)


def _scale(x):
    return 1.0 if x is None else x.cpu()


def _check_layer(fp8, exact, config, backend, recorder, runner, layer, mode, q, o, toks, tables, checks):
    """The checks of one layer of one batch (run's docstring)."""
    kc, vc = _fp8_pool(runner, layer)
    hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
    qk = q.reshape(-1, hq, d)
    path = "sparse"
    if fp8:
        assert kc.dtype == F8
        qk = qk.clamp(-448, 448).to(F8)                           # FA3's q.to(e4m3), saturated; no q scale
        path = fp8.path
    if mode != "decode" and path != "fa3":
        m = backend.meta
        if path == "by_length":   # the thresholds: short extends dense, the others sparse
            path = "sparse" if m.max_seqlen_q >= config.min_sparse_q_len else "dense"
        if path == "sparse" and config.layer_dense(layer.layer_id):
            path = "dense"
        assert backend.dispatch.last_path == path, backend.dispatch.last_reason
    config = layer_config(config, layer.layer_id)     # per-layer settings: what this layer runs
    if mode != "decode" and path != "fa3" and (fp8 or exact):
        b = m.cu_seqlens_q.shape[0] - 1
        ds = {}
        if fp8 and layer.k_scale is not None:
            ds = {n: torch.full((b, hkv), float(x), device=kc.device)
                  for n, x in (("k_descale", layer.k_scale), ("v_descale", layer.v_scale))}
        if path == "sparse":
            direct = sp.chunked_prefill(qk, kc, vc, m.cu_seqlens_q, m.page_table, m.seqused_k, m.max_seqlen_q,
                                        m.max_seqlen_k, final_chunk=config.final_chunk == "always",
                                        softmax_scale=layer.scaling, mean_cache=recorder.means, **config.selection(),
                                        **ds)
        else:
            direct = sp.attention(qk, kc, vc, m.cu_seqlens_q, None, m.max_seqlen_q, m.max_seqlen_k,
                                  softmax_scale=layer.scaling, block_table=m.page_table, seqused_k=m.seqused_k, **ds)
        assert same_bits(o.view(direct.shape), direct), (layer.layer_id, mode)
        checks["exact_calls"] += 1
    ks, vs = (_scale(layer.k_scale), _scale(layer.v_scale)) if fp8 else (1.0, 1.0)
    row = 0
    for r, s, n in toks:
        dense = mode == "decode" or config.alpha == 0 or path != "sparse"
        cfg = None if dense else config
        kd = cache_rows(kc, r.pages, s + n, runner.page_size).float() * ks
        vd = cache_rows(vc, r.pages, s + n, runner.page_size).float() * vs
        qd = qk[row:row + n].cpu().float()
        got = o[row:row + n].float().cpu()
        compare_rows(checks, got, reference_attention(qd, kd, vd, cfg), vd.abs().max().item(), fp8)
        orig = (got - reference_rows(tables, layer.layer_id, r, s, n, cfg)).abs()
        checks["worst_orig"] = max(checks["worst_orig"], orig.max().item())
        checks["worst_orig_mean"] = max(checks["worst_orig_mean"], orig.mean().item())
        if fp8 and fp8.bf16_reference:
            bf = reference_attention(qd.bfloat16(), kd.bfloat16(), vd.bfloat16(), None).float()
            checks["worst_bf16"] = max(checks["worst_bf16"], (got - bf).abs().max().item())
        row += n


def make_batch(mode, rows, eng, runner, slot_of_req):
    """SGLang's ForwardBatch: device tensors on the pool's device, the *_cpu fields on the host."""
    r2t = runner.req_to_token_pool.req_to_token
    dev = r2t.device
    for r, s, n, _ in rows:
        sl = eng.slots(r, 0, s + n)
        r2t[slot_of_req[r.rid], : s + n] = torch.tensor(sl, dtype=torch.int32, device=dev)
    seq = torch.tensor([s + n for _, s, n, _ in rows], dtype=torch.int64)
    ext = [n for _, _, n, _ in rows]
    pre = [s for _, s, _, _ in rows]
    t = lambda x: torch.tensor(x, device=dev)  # noqa: E731
    return ForwardBatch(forward_mode=ForwardMode(mode), batch_size=len(rows),
                        req_pool_indices=t([slot_of_req[r.rid] for r, *_ in rows]),
                        seq_lens=seq.to(dev), seq_lens_cpu=seq,
                        out_cache_loc=t(sum((eng.slots(r, s, n) for r, s, n, _ in rows), [])),
                        extend_seq_lens=t(ext), extend_prefix_lens=t(pre),
                        extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=pre,
                        positions=torch.cat([torch.arange(s, s + n) for _, s, n, _ in rows]).to(dev))


def check_means_fn(backend, runner, tables, layer, eng, rows, fp8=None):
    """The tracker's means of every complete block of every live request: the block's true means (FP8: the means of
    the pool's dequantised contents, stored x the layer's scale)."""
    layer_id = layer.layer_id
    k_buf, v_buf = runner.token_to_kv_pool.get_kv_buffer(layer_id)
    ps = runner.page_size
    means = backend.tracker.get(layer_id, k_buf.view(-1, ps, tables.hkv, tables.d))
    if means is None:
        return 0
    written = {r.rid: s + n for r, s, n, _ in rows}
    n = 0
    kc, vc = _fp8_pool(runner, layer)
    for req in eng.running:
        for i in range(written.get(req.rid, req.computed) // ps):
            if fp8:
                km = kc[req.pages[i]].float() * _scale(layer.k_scale)
                vm = vc[req.pages[i]].float() * _scale(layer.v_scale)
            elif kc.dtype == torch.float32:
                km, vm = tables.kv(layer_id, req.tokens[i * ps:(i + 1) * ps], i * ps)
            else:                     # a bfloat16 pool holds the rounded values: their means
                km, vm = kc[req.pages[i]].float(), vc[req.pages[i]].float()
            torch.testing.assert_close(means[0][req.pages[i]], km.mean(0), atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(means[1][req.pages[i]], vm.mean(0), atol=2e-5, rtol=1e-5)
            n += 1
    return n


@pytest.mark.parametrize("device", DEVICES)
def test_alpha0_equals_dense_mixed_chunks_prefix_hits(device):
    geom = GEOMETRY[device]
    worst, eng, backend, checks = run(_config(geom, alpha=0.0), geom=geom, exact=True)
    assert worst <= 1, checks
    assert checks["exact_calls"] == 2 * checks["extend_steps"] > 6
    assert eng.stats["prefix_hit_tokens"] >= checks["prefix"]
    assert eng.stats["decode_completed_pages"]
    assert checks["extend_steps"] > 3 and checks["mixed_rows"] > 0 and checks["mean_blocks"] > 50
    assert backend.dispatch.calls["sparse"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_selection_and_separate_decode_batches(device):
    # the library's selection with the tracked mean cache == the contiguous sparse reference (CUDA: up to
    # near-threshold flips) and == the direct call bit for bit
    FakeFA3Backend.calls.clear()
    geom = GEOMETRY[device]
    worst, eng, backend, checks = run(_config(geom), mixed=False, check_means=True, geom=geom, exact=True)
    check_selection_rows(checks, device, sparse=True)
    assert checks["exact_calls"] == 2 * checks["extend_steps"] > 6 and checks["mean_blocks"] > 50
    assert checks["decode_steps"] > 10       # decode writes went through FA3 -> the pool -> the tracker
    assert not any(c[0] == "extend" for c in FakeFA3Backend.calls)


def test_per_layer_settings_reach_each_layer(monkeypatch):
    """Per-layer settings (`layers`; the layer index is layer.layer_id): layer 0's extend calls reach
    the chunked_prefill operator with layer 0's own selection, layer 1's (dense in `layers`) dense attention; every call
    equals the direct library call with that layer's settings bit for bit."""
    spy = LibrarySpy()
    monkeypatch.setattr(core, "spt", spy)
    cfg = _config(layers={0: {"alpha": 0.5, "head_subgroups": 1, "dense_fraction": 1.0}, 1: {"dense": True}})
    worst, eng, backend, checks = run(cfg, mixed=False, check_means=False, steps=30, exact=True)
    check_selection_rows(checks, "cpu", sparse=True)
    n = checks["extend_steps"]
    assert n > 2 and [c[0] for c in spy.calls] == ["chunked_prefill", "attention"] * n
    assert all(kw["alpha"] == 0.5 and kw["head_subgroups"] == 1 and kw["dense_fraction"] == 1.0
               for name, kw in spy.calls if name == "chunked_prefill")
    assert checks["exact_calls"] == 2 * n and backend.dispatch.calls == {"sparse": n, "dense": n}


def test_page_table_from_req_to_token():
    r2t = torch.zeros(4, 512, dtype=torch.int32)
    r2t[2, :300] = torch.arange(5 * 64, 5 * 64 + 300)            # pages 5.. of 64 slots
    r2t[0, :130] = torch.cat([torch.arange(64) + 64 * 9, torch.arange(64) + 64 * 3, torch.arange(2) + 64 * 7])
    fb = ForwardBatch(forward_mode=ForwardMode("extend"), batch_size=2, req_pool_indices=torch.tensor([2, 0]),
                      seq_lens=torch.tensor([300, 130]), seq_lens_cpu=torch.tensor([300, 130]),
                      out_cache_loc=torch.zeros(0), extend_seq_lens=torch.tensor([100, 2]),
                      extend_seq_lens_cpu=[100, 2], extend_prefix_lens_cpu=[200, 128])
    m = sps.extend_metadata(fb, r2t, 64)
    assert m.page_table.tolist() == [[5, 6, 7, 8, 9], [9, 3, 7, 0, 0]]
    assert m.cu_seqlens_q.tolist() == [0, 100, 102] and m.seqused_k.tolist() == [300, 130]
    assert (m.max_seqlen_q, m.max_seqlen_k) == (100, 300)


# ---------------------------------------------------------------------------------------------------------------------
# FP8 KV caches (--kv-cache-dtype fp8_e4m3)
# ---------------------------------------------------------------------------------------------------------------------

@pytest.fixture
def poisoned_outputs(monkeypatch):
    """The backend's output buffers (q.new_empty) start as NaN: every value must be written."""
    real = torch.Tensor.new_empty

    def new_empty(self, *size, **kwargs):
        return real(self, *size, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)


@pytest.mark.parametrize("scales,seed,device", [(True, 61, "cpu"), (False, 62, "cpu"), on_cuda(True, 67, "cuda")])
def test_fp8_pool_equals_the_library_call_and_the_dequantised_computation(poisoned_outputs, scales, seed, device):
    """alpha 0: every extend call (mixed chunks, radix prefix hits on decode-completed pages) == the library's direct
    FP8 call bit for bit; every row == attention on the pool's dequantised contents up to the bf16 output rounding
    (CUDA: + P in e4m3), (CPU) == dense bf16 attention on bf16 dequantised values and == the original values within
    FP8 tolerance. Each layer's own k/v scales (loaded after the backend was built), or none (SGLang without
    checkpoint scales: scale 1)."""
    geom = GEOMETRY[device]
    worst, eng, backend, checks = run(_config(geom, alpha=0.0), geom=geom, seed=seed,
                                      fp8=Fp8Run(scales=scales, bf16_reference=device == "cpu"))
    assert checks["exact_calls"] == 2 * checks["extend_steps"] > 6
    assert worst <= 1, checks
    if device == "cpu":
        assert checks["worst_bf16"] < 3e-2, checks["worst_bf16"]
    assert 1e-3 < checks["worst_orig"] < 0.35 and checks["worst_orig_mean"] < 0.02, checks
    assert eng.stats["prefix_hit_tokens"] >= checks["prefix"] and eng.stats["decode_completed_pages"]
    assert checks["mixed_rows"] > 0 and checks["mean_blocks"] > 50
    assert backend.dispatch.calls == {"sparse": 2 * checks["extend_steps"], "dense": 0}


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_pool_sparse_selection_separate_decode_batches(poisoned_outputs, device):
    FakeFA3Backend.calls.clear()
    geom = GEOMETRY[device]
    worst, eng, backend, checks = run(_config(geom), mixed=False, fp8=Fp8Run(), seed=63, geom=geom)
    assert checks["exact_calls"] == 2 * checks["extend_steps"] > 6
    check_selection_rows(checks, device, sparse=True)
    assert checks["decode_steps"] > 10 and checks["mean_blocks"] > 50     # FA3's FP8 decode writes tracked too
    assert checks["worst_orig_mean"] < 0.02
    assert not any(c[0] == "extend" for c in FakeFA3Backend.calls)


def test_fp8_scales_are_read_per_layer():
    """The descales the backend passes are stride-0 [B, Hkv] views of each layer's own k_scale / v_scale tensors
    (holding the values loaded after the backend was built), q is e4m3 and has no descale (SGLang's FA3)."""
    tables = Tables(seed=64)
    _, _, backend, _ = run(_config(), fp8=Fp8Run(), steps=3, check_means=False, seed=64)
    seen = backend.dispatch.seen
    assert len(seen) >= 4
    ptrs = set()
    for args, kw in seen:
        _, ks, vs = tables.fp8_scales(kw["layer_idx"])
        b = args[3].shape[0] - 1
        for name, want in (("k_descale", ks), ("v_descale", vs)):
            d = kw[name]
            assert d.shape == (b, tables.hkv) and d.stride() == (0, 0) and (d == want).all(), name
            ptrs.add(d.data_ptr())
        assert args[0].dtype == F8 and kw.get("q_descale") is None
    assert len(ptrs) == 4                                   # 2 layers x (k, v): each its own tensor, never a copy


def test_fp8_on_cuda_runs_sparse_and_short_extends_dense(monkeypatch, poisoned_outputs):
    """The dispatch's CUDA decisions replayed on the CPU: FP8 extends run block-sparse (head dim 128, block_size 128,
    pages of 64), without a warning; what runs dense is what runs dense for a 16-bit pool (here extends whose
    chunks are all below min_sparse_q_len=90), dense FP8 attention; every call == its direct call bit for bit."""
    replay_cuda(monkeypatch)
    monkeypatch.setattr(core, "_warned", set())
    seen = []
    real = core.VarlenDispatch.sparse_reason
    monkeypatch.setattr(core.VarlenDispatch, "sparse_reason",
                        lambda self, q, k, mq, mk, **kw: seen.append(mq) or real(self, q, k, mq, mk, **kw))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        worst, eng, backend, checks = run(_config(block_size=128, min_sparse_q_len=90), fp8=Fp8Run(path="by_length"),
                                          seed=65, d=128, steps=30)
    calls = backend.dispatch.calls
    assert calls == {"sparse": sum(m >= 90 for m in seen), "dense": sum(m < 90 for m in seen)}
    assert calls["sparse"] > 4 and calls["dense"] > 0
    assert checks["exact_calls"] == 2 * checks["extend_steps"] > 4 and worst <= 1, checks


def test_fp8_head_dim_64_on_cuda_goes_to_fa3(monkeypatch):
    """No CUDA FP8 kernel for head dim 64: the FA3 delegate serves those extend calls (it writes through the wrapped
    pool, so the mean cache stays valid), announced once naming kv_cache_dtype."""
    replay_cuda(monkeypatch)
    monkeypatch.setattr(core, "_warned", set())
    FakeFA3Backend.calls.clear()
    with pytest.warns(RuntimeWarning, match="kv_cache_dtype='fp8_e4m3': .*head dim 64.*FA3"):
        worst, eng, backend, checks = run(_config(alpha=0.0), fp8=Fp8Run(path="fa3"), seed=66, steps=30)
    assert backend.dispatch.calls == {"sparse": 0, "dense": 0}
    assert any(c[0] == "extend" for c in FakeFA3Backend.calls)
    assert worst <= 1 and checks["mean_blocks"] > 10


@pytest.mark.parametrize("dtype", ["fp8_e5m2", "fp4_e2m1", "int8"])
def test_unsupported_kv_cache_dtypes_raise_naming_the_argument(dtype):
    tables = Tables()
    with pytest.raises(NotImplementedError, match=f"kv_cache_dtype='{dtype}'.*'fp8_e4m3'"):
        Backend(Runner(4, tables, dtype=dtype), config=_config())


def test_fp8_e4m3fnuz_pool_rejected():
    runner = Runner(4, Tables(), dtype="fp8_e4m3")
    runner.kv_cache_dtype = torch.float8_e4m3fnuz              # ROCm resolves fp8_e4m3 to e4m3fnuz
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8_e4m3'.*float8_e4m3fnuz"):
        Backend(runner, config=_config())


def test_page_size_64_with_block_128_disables_the_mean_cache():
    tables = Tables()
    backend = Backend(Runner(8, tables), config=_config(block_size=128))
    assert backend.tracker.get(0, torch.zeros(8, PAGE, tables.hkv, tables.d)) is None
    assert not hasattr(backend.token_to_kv_pool, "_sparse_prefill_tracker")


def test_sglang_conformance():
    sglang = pytest.importorskip("sglang.srt.layers.attention.attention_registry")
    import inspect
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
    sps.register()
    sps.register()
    assert ATTENTION_BACKEND_CHOICES.count("sparse_prefill") == 1
    assert "sparse_prefill" in ATTENTION_BACKENDS
    cls = sps.SparsePrefillAttnBackend
    assert issubclass(cls, AttentionBackend)
    ours = list(inspect.signature(cls.forward_extend).parameters)
    theirs = list(inspect.signature(AttentionBackend.forward_extend).parameters)
    assert ours[:6] == theirs[:6], (ours, theirs, sglang)

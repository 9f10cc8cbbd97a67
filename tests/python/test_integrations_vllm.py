"""vLLM adapter: contract tests against faithful fakes of vLLM V1's FlashAttention backend, metadata builder and
common metadata (field names and layouts of vllm/v1/attention/backend.py and backends/flash_attn.py), replaying the
engine's call sequence: metadata built once per step, then per layer do_kv_cache_update and forward; chunked prefill,
prefix hits (on pages decode completed, and vLLM's full-hit recompute of the last token), decode rows mixed with
prefill rows, page reuse. Checked against the CPU reference. Conformance tests run where vLLM imports."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
import sparse_prefill as sp  # noqa: E402
from engine_sim import (DEVICES, F8, GEOMETRY, Engine, Request, Tables, cache_rows, compare_rows,  # noqa: E402
                        LibrarySpy, check_selection_rows, fp8_quant, layer_config, next_token, on_cuda,
                        reference_attention, reference_rows, replay_cuda, same_bits)
from sparse_prefill.integrations import SparsePrefillConfig  # noqa: E402
from sparse_prefill.integrations import core  # noqa: E402
from sparse_prefill.integrations import vllm as spv

PAGE = 64


# ---------------------------------------------------------------------------------------------------------------------
# Fakes of vLLM's classes (interfaces as in vLLM V1; bodies are references)
# ---------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True


@dataclasses.dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    use_cascade: bool = False
    common_prefix_len: int = 0
    scheduler_metadata: object = None
    max_num_splits: int = 0
    causal: bool = True


class FakeFlashAttentionBackend:
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class FakeFlashAttentionMetadataBuilder:
    def __init__(self, kv_cache_spec=None, layer_names=None, vllm_config=None, device=None):
        self.builds = []

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        self.builds.append(common_prefix_len)
        return FlashAttentionMetadata(num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
                                      query_start_loc=cm.query_start_loc, max_seq_len=cm.max_seq_len,
                                      seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
                                      slot_mapping=cm.slot_mapping, use_cascade=common_prefix_len > 0,
                                      common_prefix_len=common_prefix_len)


class FakeFlashAttentionImpl:
    """FA's impl: reshape_and_cache_flash for the write, flash_attn_varlen_func (here: the reference) for forward.
    FP8 caches (uint8 storage) as vLLM's FA: the write stores fp8_quant(key, layer._k_scale), forward views the cache
    as float8_e4m3fn, takes q e4m3 (quantised by the Attention layer when supports_quant_query_input(), else here
    with layer._q_scale, as older FA did) and passes the layer's scales expanded to [B, Hkv] as descales."""

    calls = []
    quant_query_input = True

    def supports_quant_query_input(self):
        return type(self).quant_query_input

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes, self.logits_soft_cap = alibi_slopes, logits_soft_cap
        self.sliding_window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        self.kv_cache_dtype = kv_cache_dtype

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        k_cache, v_cache = kv_cache.unbind(0)
        n = slot_mapping.shape[0]
        ok = slot_mapping >= 0
        k, v = key[:n][ok], value[:n][ok]
        if self.kv_cache_dtype.startswith("fp8"):
            k = fp8_quant(k, layer._k_scale).view(torch.uint8)
            v = fp8_quant(v, layer._v_scale).view(torch.uint8)
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[ok].long()] = k.to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[ok].long()] = v.to(v_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        md = attn_metadata
        FakeFlashAttentionImpl.calls.append(("fa", md.num_actual_tokens))
        k_cache, v_cache = kv_cache.unbind(0)
        n = md.num_actual_tokens
        descales = {}
        if self.kv_cache_dtype.startswith("fp8"):
            k_cache, v_cache = k_cache.view(F8), v_cache.view(F8)
            if query.dtype != F8:
                query = fp8_quant(query, layer._q_scale)
            shape = (md.query_start_loc.shape[0] - 1, self.num_kv_heads)
            descales = dict(q_descale=layer._q_scale.expand(shape), k_descale=layer._k_scale.expand(shape),
                            v_descale=layer._v_scale.expand(shape))
        sp.attention(query[:n], k_cache, v_cache, md.query_start_loc, None, md.max_query_len, md.max_seq_len,
                     softmax_scale=self.scale, block_table=md.block_table, seqused_k=md.seq_lens,
                     out=output[:n].view(n, self.num_heads, self.head_size), **descales)
        return output


class Layer:
    """vLLM's Attention layer as the impl sees it: the name and the FP8 scales (0-d float32 tensors, 1.0 until the
    checkpoint's are loaded in place, as process_weights_after_loading does)."""

    def __init__(self, i, device="cpu"):
        self.layer_name = f"model.layers.{i}.self_attn.attn"
        self._q_scale, self._k_scale, self._v_scale = (torch.tensor(1.0, device=device) for _ in range(3))

    def load_scales(self, q_scale, k_scale, v_scale):
        for mine, x in ((self._q_scale, q_scale), (self._k_scale, k_scale), (self._v_scale, v_scale)):
            mine.copy_(x)

    def query_quant(self, query):
        """QuantFP8(static=True, per-tensor) with _q_scale, which the layer applies before the impl when the cache is
        FP8 and the impl supports_quant_query_input()."""
        return fp8_quant(query, self._q_scale)


Backend, Impl, Builder = spv.make_classes(FakeFlashAttentionBackend, FakeFlashAttentionImpl,
                                          FakeFlashAttentionMetadataBuilder)


# ---------------------------------------------------------------------------------------------------------------------
# Replaying vLLM's call sequence
# ---------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Fp8Run:
    """An FP8 (fp8_e4m3) KV cache replay and what it checks at every step and layer."""
    kv_cache_dtype: str = "fp8_e4m3"
    layer_quantises_q: bool = True   # vLLM's Attention layer quantises q (impl.supports_quant_query_input())
    path: str = "sparse"             # what serves the prefill rows: 'sparse' / 'dense' (the dispatch) or 'fa'
    bf16_reference: bool = False     # also compare with a dense computation on bf16-rounded dequantised values
    other_layer_differs: bool = False  # the direct call with another layer's scales must differ (scales matter)


def run_engine(config, scenario, tables, num_pages=48, check_means=True, fp8=None, geom=GEOMETRY["cpu"],
               exact=False):
    """Runs the scenario through the backend on geom.device; returns (worst error / tolerance, engine, state,
    checks).

    Every row is compared with attention on what the kernels read (the cache's contents: float32 or bfloat16 for a
    16-bit model, dequantised for FP8) on the CPU reference, within `engine_sim.tolerance` of the device
    (checks['worst_ratio'] <= 1, checks['over_tol'] entries beyond it). exact (always with fp8): at every step and
    layer the prefill rows must equal, bit for bit, the library's direct call on the same cache (FP8: with descales
    built here) and the mean cache as it was before the call.

    fp8 (an Fp8Run): the caches are uint8 FP8 caches written by FA's write with each layer's own k/v scales (loaded
    into the layers after the impls were built), the model dtype is bfloat16 and outputs start as NaN; every row is
    also compared with the original values (checks['worst_orig']) and, with bf16_reference, with dense attention on
    bf16 dequantised values (checks['worst_bf16'])."""
    state = spv.engine_state(reset=True, config=config)
    L, hq, hkv, d = tables.layers, tables.hq, tables.hkv, tables.d
    dev, page = geom.device, geom.page
    kv_dtype = fp8.kv_cache_dtype if fp8 else "auto"
    impls = [Impl(hq, d, d ** -0.5, hkv, kv_cache_dtype=kv_dtype) for _ in range(L)]
    layers = [Layer(i, dev) for i in range(L)]
    if fp8:
        for i, lay in enumerate(layers):        # after the impls exist: the scales are read at call time
            lay.load_scales(*tables.fp8_scales(i))
    builder = Builder()
    cache_dtype = torch.uint8 if fp8 else geom.dtype
    kv = [torch.zeros(Backend.get_kv_cache_shape(num_pages, page, hkv, d), dtype=cache_dtype, device=dev)
          for _ in range(L)]
    eng = Engine(num_pages, page, full_hit="vllm", chunk=96)
    checks = {"rows": 0, "decode_rows": 0, "prefill_rows": 0, "mixed_steps": 0, "mean_blocks": 0,
              "prefill_steps": 0, "exact_calls": 0, "worst_ratio": 0.0, "over_tol": 0, "worst_orig": 0.0,
              "worst_orig_mean": 0.0, "worst_bf16": 0.0, "other_layer_differs": 0, "device": dev}
    for step, arrivals in scenario:
        for req in arrivals:
            eng.add(req)
        rows = eng.schedule()
        if not rows:
            break
        q_lens = [n for _, _, n, _ in rows]
        qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0).tolist()), dtype=torch.int32)
        seq_lens = torch.tensor([s + n for _, s, n, _ in rows], dtype=torch.int32)
        max_pages = max(len(r.pages) for r, *_ in rows)
        bt = torch.full((len(rows), max_pages + 2), 0, dtype=torch.int32)
        for i, (r, *_rest) in enumerate(rows):
            bt[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        slots = torch.tensor(sum((eng.slots(r, s, n) for r, s, n, _ in rows), []), dtype=torch.int64)
        cm = CommonAttentionMetadata(query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(dev),
                                     num_reqs=len(rows), num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens),
                                     max_seq_len=int(seq_lens.max()), block_table_tensor=bt.to(dev),
                                     slot_mapping=slots.to(dev))
        md = builder.build(7, cm)                     # once per step (a common prefix is offered: no cascade)
        assert builder.builds[-1] == 0
        nd = md.sparse_plan.num_decodes
        checks["decode_rows"] += nd
        checks["prefill_rows"] += md.sparse_plan.num_prefills
        checks["mixed_steps"] += bool(nd and md.sparse_plan.num_prefills)
        checks["prefill_steps"] += bool(md.sparse_plan.num_prefills)
        for layer in range(L):
            toks = [(r, s, n) for r, s, n, _ in rows]
            q = torch.cat([tables.qs(layer, r.tokens[s:s + n], s) for r, s, n in toks])
            k, v = map(torch.cat, zip(*[tables.kv(layer, r.tokens[s:s + n], s) for r, s, n in toks]))
            if fp8 or geom.dtype != torch.float32:
                q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
            out = torch.full((q.shape[0], hq * d), float("nan"), dtype=q.dtype, device=dev)
            impls[layer].do_kv_cache_update(layers[layer], k, v, kv[layer], slots.to(dev))
            if check_means:   # before forward: the library rewrites the means of the blocks it pools
                written = {r.rid: s + n for r, s, n, _ in rows}
                checks["mean_blocks"] += check_mean_cache(state, kv[layer], tables, layer, eng, written,
                                                          layers[layer] if fp8 else None)
            snap = _means_snapshot(state, kv[layer]) if fp8 or exact else None
            q_in = layers[layer].query_quant(q) if fp8 and fp8.layer_quantises_q else q
            impls[layer].forward(layers[layer], q_in, k, v, kv[layer], md, out)
            _check_layer(fp8, exact, config, state, md.sparse_plan, layers, layer, q, kv[layer], snap,
                         out.view(-1, hq, d), toks, tables, checks, page)
        eng.commit(rows, next_token)
    return checks["worst_ratio"], eng, state, checks


def _means_snapshot(state, kv_layer):
    means = state.tracker.get(kv_layer.data_ptr(), kv_layer[0])
    return None if means is None else (means[0].clone(), means[1].clone())


def expected_path(config, plan, layer, path="sparse"):
    """What the dispatch must run for a step's prefill rows of `layer` (the thresholds these tests vary)."""
    if path != "sparse" or config.layer_dense(layer) or plan.max_seqlen_q < config.min_sparse_q_len:
        return "dense" if path == "sparse" else path
    return path


def direct_call(path, config, q, kc, vc, plan, lay, mean_cache, d, scales=None):
    """The library's call for the prefill rows, built from scratch; FP8 (lay given): contiguous [B, Hkv] descales
    holding the layer's scales (or `scales`)."""
    b, hkv = plan.num_prefills, kc.shape[2]
    ds = {}
    if lay is not None:
        qs, ks, vs = scales if scales is not None else (lay._q_scale, lay._k_scale, lay._v_scale)
        ds = {n: torch.full((b, hkv), float(x), device=kc.device)
              for n, x in (("q_descale", qs), ("k_descale", ks), ("v_descale", vs))}
    if path == "sparse":
        return sp.chunked_prefill(q, kc, vc, plan.cu_seqlens_q, plan.block_table, plan.seqused_k,
                                  plan.max_seqlen_q, plan.max_seqlen_k, final_chunk=config.final_chunk == "always",
                                  softmax_scale=d ** -0.5, mean_cache=mean_cache, **config.selection(), **ds)
    return sp.attention(q, kc, vc, plan.cu_seqlens_q, None, plan.max_seqlen_q, plan.max_seqlen_k,
                        softmax_scale=d ** -0.5, block_table=plan.block_table, seqused_k=plan.seqused_k, **ds)


def _check_layer(fp8, exact, config, state, plan, layers, layer, q, kv_layer, snap, o, toks, tables, checks, page):
    """The checks of one layer of one step (run_engine's docstring)."""
    d = tables.d
    lay = layers[layer] if fp8 else None
    kc, vc = kv_layer[0], kv_layer[1]
    qk = q                                    # what the library gets: q, or q quantised with the layer's q scale
    if fp8:
        kc, vc = kc.view(F8), vc.view(F8)
        qk = fp8_quant(q, lay._q_scale)
    path = expected_path(config, plan, layer, fp8.path if fp8 else "sparse")
    config = layer_config(config, layer)      # per-layer settings: what this layer runs
    if plan.num_prefills:
        nt, na = plan.num_decode_tokens, plan.num_actual_tokens
        if path != "fa":
            assert state.dispatch.last_path == path, state.dispatch.last_reason
        if path != "fa" and (fp8 or exact):
            direct = direct_call(path, config, qk[nt:na], kc, vc, plan, lay, snap, d)
            assert same_bits(o[nt:na], direct), (layer, plan)
            checks["exact_calls"] += 1
            if fp8 and fp8.other_layer_differs:
                other = layers[(layer + 1) % len(layers)]
                wrong = direct_call(path, config, qk[nt:na], kc, vc, plan, lay, snap, d,
                                    scales=(lay._q_scale, other._k_scale, lay._v_scale))
                checks["other_layer_differs"] += not torch.equal(wrong, direct)
    scales = [1.0] * 3 if lay is None else [x.cpu() for x in (lay._q_scale, lay._k_scale, lay._v_scale)]
    row = 0
    for i, (r, s, n) in enumerate(toks):
        dense = i < plan.num_decodes or config.alpha == 0 or path != "sparse"
        cfg = None if dense else config
        kd = cache_rows(kc, r.pages, s + n, page).float() * scales[1]
        vd = cache_rows(vc, r.pages, s + n, page).float() * scales[2]
        qd = qk[row:row + n].cpu().float() * scales[0]
        got = o[row:row + n].float().cpu()
        compare_rows(checks, got, reference_attention(qd, kd, vd, cfg), vd.abs().max().item(), fp8)
        orig = (got - reference_rows(tables, layer, r, s, n, cfg)).abs()
        checks["worst_orig"] = max(checks["worst_orig"], orig.max().item())
        checks["worst_orig_mean"] = max(checks["worst_orig_mean"], orig.mean().item())
        if fp8 and fp8.bf16_reference:
            bf = reference_attention(qd.bfloat16(), kd.bfloat16(), vd.bfloat16(), None).float()
            checks["worst_bf16"] = max(checks["worst_bf16"], (got - bf).abs().max().item())
        row += n


def true_block_means(tables, layer, req, page_idx, page=PAGE):
    k, v = tables.kv(layer, req.tokens[page_idx * page:(page_idx + 1) * page], page_idx * page)
    return k.mean(0), v.mean(0)


def check_mean_cache(state, kv_layer, tables, layer, eng, written, fp8_layer=None):
    """Every complete block of every live request: the tracker's means equal the block's true means (FP8: the means
    of the block's dequantised cache contents, stored x the layer's scale)."""
    means = state.tracker.get(kv_layer.data_ptr(), kv_layer[0])
    if means is None:
        return 0
    n = 0
    for req in eng.running:
        for i in range(written.get(req.rid, req.computed) // eng.page_size):
            page = req.pages[i]
            if fp8_layer is None:    # a bfloat16 cache holds the rounded values: their means
                km, vm = (x.float().mean(0) for x in (kv_layer[0][page], kv_layer[1][page]))
                if kv_layer.dtype == torch.float32:
                    km, vm = true_block_means(tables, layer, req, i, eng.page_size)
            else:
                km = (kv_layer[0][page].view(F8).float() * fp8_layer._k_scale).mean(0)
                vm = (kv_layer[1][page].view(F8).float() * fp8_layer._v_scale).mean(0)
            torch.testing.assert_close(means[0][page], km, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(means[1][page], vm, atol=2e-5, rtol=1e-5)
            n += 1
    return n


def scenario_basic(seed=0, page=PAGE):
    """A: 300-token prompt (240 with pages of 128), decodes 90 tokens (completes a page by decode); B arrives with
    A's tokens up to the end of that page (320; 256 with pages of 128) + more (prefix hit on the decode-completed
    page); C = A's first 256 tokens (full hit: vLLM recomputes token 255 into its shared page); D, E plain prompts
    that run mixed with decodes; pages get reused after A finishes. Returns (A, B's prefix length)."""
    g = torch.Generator().manual_seed(seed)
    prompt = 300 if page == 64 else 240
    a = Request("A", torch.randint(0, 61, (prompt,), generator=g).tolist(), max_new=90)
    return a, (prompt // page + 1) * page


class Driver:
    """Arrivals that depend on A's generated tokens (B, C copy A's sequence once it is long enough)."""

    def __init__(self, a, seed=1, prefix=320):
        self.a = a
        self.sent = set()
        self.seed = seed
        self.prefix = prefix

    def __iter__(self):
        step = 0
        g = torch.Generator().manual_seed(self.seed)
        while step < 60:
            arrivals = []
            if step == 0:
                arrivals.append(self.a)
            p = self.prefix
            if "B" not in self.sent and len(self.a.tokens) >= p + 10 and self.a.computed >= p:
                arrivals.append(Request("B", self.a.tokens[:p] + torch.randint(0, 61, (150,), generator=g).tolist(),
                                        max_new=4))
                self.sent.add("B")
            if "C" not in self.sent and "B" in self.sent:
                arrivals.append(Request("C", self.a.tokens[:256], max_new=2))
                self.sent.add("C")
            if step == 3:
                arrivals.append(Request("D", torch.randint(0, 61, (200,), generator=g).tolist(), max_new=3))
            if step == 30:
                arrivals.append(Request("E", torch.randint(0, 61, (230,), generator=g).tolist(), max_new=3))
            yield step, arrivals
            step += 1


def _config(geom=GEOMETRY["cpu"], **kw):
    base = dict(block_size=geom.page, min_sparse_q_len=1, min_sparse_kv_len=0, sink=64, window=64)
    base.update(kw)
    return SparsePrefillConfig.load(environ={}, **base)


def _run(config, check_means=True, geom=GEOMETRY["cpu"], exact=False):
    tables = Tables(d=geom.d, device=geom.device)
    a, prefix = scenario_basic(page=geom.page)
    worst, eng, state, checks = run_engine(config, Driver(a, prefix=prefix), tables, check_means=check_means,
                                           geom=geom, exact=exact)
    checks["prefix"] = prefix
    return worst, eng, state, checks


@pytest.mark.parametrize("device", DEVICES)
def test_dense_equivalence_alpha0_with_prefix_hits_and_mixed_rows(device):
    # alpha 0 keeps every block: the sparse path (through the mean cache) == dense attention on the cache, and == the
    # library's direct call bit for bit
    geom = GEOMETRY[device]
    worst, eng, state, checks = _run(_config(geom, alpha=0.0), geom=geom, exact=True)
    assert worst <= 1, checks
    assert checks["exact_calls"] == 2 * checks["prefill_steps"] > 10
    assert eng.stats["prefix_hit_tokens"] >= checks["prefix"] + 255
    assert eng.stats["decode_completed_pages"], "the scenario must complete pages by decode"
    assert eng.stats["reused_pages"] > 0, "the scenario must reuse freed pages"
    assert checks["mixed_steps"] > 0 and checks["decode_rows"] > 0 and checks["prefill_rows"] > 0
    assert checks["mean_blocks"] > 50
    assert state.dispatch.calls == {"sparse": 2 * checks["prefill_steps"], "dense": 0}


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_selection_matches_contiguous_reference(device):
    # the library's selection (alpha default) through the engine's pages and the tracked mean cache ==
    # sp.sparse_prefill on contiguous K/V (CUDA: up to near-threshold flips), and == the direct call bit for bit
    geom = GEOMETRY[device]
    worst, eng, state, checks = _run(_config(geom), geom=geom, exact=True)
    assert state.config.alpha == sp.SELECTION_DEFAULTS["alpha"]
    check_selection_rows(checks, device, sparse=True)
    assert checks["exact_calls"] == 2 * checks["prefill_steps"] > 10 and checks["mean_blocks"] > 50
    assert state.dispatch.calls == {"sparse": 2 * checks["prefill_steps"], "dense": 0}


@pytest.mark.parametrize("device", DEVICES)
def test_dense_layers_and_short_chunks_run_dense_attention(device):
    """dense_layers=1 and min_sparse_q_len=90: layer 0 and the steps whose chunks are all short (< 90 queries) run
    dense sp.attention over the pages, the others sparse; each call == its direct library call bit for bit."""
    geom = GEOMETRY[device]
    worst, eng, state, checks = _run(_config(geom, dense_layers=1, min_sparse_q_len=90), geom=geom, exact=True,
                                     check_means=False)
    check_selection_rows(checks, device, sparse=True)
    calls = state.dispatch.calls
    assert checks["exact_calls"] == calls["sparse"] + calls["dense"] == 2 * checks["prefill_steps"]
    assert checks["prefill_steps"] < calls["dense"] < 2 * checks["prefill_steps"] and calls["sparse"] > 3


def test_per_layer_settings_reach_each_layer(monkeypatch):
    """Per-layer settings (`layers`, what sparse_prefill.calibrate writes; the layer index from layer.layer_name):
    layer 0's prefill calls reach the chunked_prefill operator with layer 0's own selection, layer 1's (dense in
    `layers`) run dense attention; every call equals the direct library call with that layer's settings bit for bit."""
    spy = LibrarySpy()
    monkeypatch.setattr(core, "spt", spy)
    cfg = _config(layers={"0": {"alpha": 0.5, "head_subgroups": 1, "dense_fraction": 1.0}, "1": {"dense": True}})
    assert cfg.alpha != 0.5 and cfg.head_subgroups != 1          # the top level differs from layer 0's entry
    worst, eng, state, checks = _run(cfg, exact=True, check_means=False)
    check_selection_rows(checks, "cpu", sparse=True)
    n = checks["prefill_steps"]
    assert n > 5 and [c[0] for c in spy.calls] == ["chunked_prefill", "attention"] * n
    assert all(kw["alpha"] == 0.5 and kw["head_subgroups"] == 1 and kw["dense_fraction"] == 1.0
               for name, kw in spy.calls if name == "chunked_prefill")
    assert checks["exact_calls"] == 2 * n and state.dispatch.calls == {"sparse": n, "dense": n}


def test_decode_rows_go_to_flash_attention_prefill_rows_to_sparse_prefill():
    FakeFlashAttentionImpl.calls.clear()
    _, _, state, checks = _run(_config(alpha=0.0), check_means=False)
    fa_tokens = [n for _, n in FakeFlashAttentionImpl.calls]
    assert fa_tokens and max(fa_tokens) <= 8          # FA served decode slices only (a few rows of one token)
    # one dispatch per (step with prefill rows, layer), all sparse with these thresholds
    assert state.dispatch.calls["dense"] == 0
    assert state.dispatch.calls["sparse"] == 2 * checks["prefill_steps"]


def test_untracked_mean_cache_would_be_stale():
    """Negative control: a mean cache that only the library writes holds nothing for pages decode completed."""
    tables = Tables()
    req = Request("A", list(range(50)) * 2, max_new=0)
    k_full, _ = tables.kv(0, req.tokens)
    kv = torch.zeros(2, 4, PAGE, tables.hkv, tables.d)
    plain = sp.mean_cache(kv[0], block_size=PAGE)
    from sparse_prefill.integrations import MeanCacheTracker
    tr = MeanCacheTracker(PAGE)
    # token by token, as decode writes them (pages 0, 1 hold the sequence)
    for pos in range(100):
        slot = torch.tensor([pos])
        kk, vv = tables.kv(0, req.tokens[pos:pos + 1], pos)
        tr.on_write("l0", kv[0], kv[1], slot, kk, vv)
        kv[0].view(-1, tables.hkv, tables.d)[pos] = kk[0]
        kv[1].view(-1, tables.hkv, tables.d)[pos] = vv[0]
    km, _ = tr.get("l0", kv[0])
    torch.testing.assert_close(km[0], k_full[:PAGE].mean(0), atol=2e-5, rtol=1e-5)
    assert (plain[0][0] - k_full[:PAGE].mean(0)).abs().max() > 0.1       # the hazard the tracker removes
    # a rewrite of a written position (vLLM's full-hit recompute) keeps the mean exact
    kk, vv = tables.kv(0, req.tokens[63:64], 63)
    tr.on_write("l0", kv[0], kv[1], torch.tensor([63]), kk, vv)
    torch.testing.assert_close(tr.get("l0", kv[0])[0][0], k_full[:PAGE].mean(0), atol=2e-5, rtol=1e-5)
    # page reuse: a new block starting at position 0 of page 0 replaces the old mean
    new = torch.randn(PAGE, tables.hkv, tables.d)
    tr.on_write("l0", kv[0], kv[1], torch.arange(PAGE), new, new)
    torch.testing.assert_close(tr.get("l0", kv[0])[0][0], new.mean(0), atol=2e-5, rtol=1e-5)
    # padding slots (-1, CUDA-graph padding) change nothing
    before = tr.get("l0", kv[0])[0].clone()
    tr.on_write("l0", kv[0], kv[1], torch.full((5,), -1), torch.randn(5, tables.hkv, tables.d),
                torch.randn(5, tables.hkv, tables.d))
    torch.testing.assert_close(tr.get("l0", kv[0])[0], before)


# ---------------------------------------------------------------------------------------------------------------------
# FP8 KV caches (--kv-cache-dtype fp8 / fp8_e4m3)
# ---------------------------------------------------------------------------------------------------------------------

def _run_fp8(fp8, config, seed, d=None, check_means=True, geom=GEOMETRY["cpu"]):
    """Fresh inputs per seed (tables, prompts); odd lengths: prompts of 300/470/256/200/230 tokens in 96-token
    chunks (240/406/... with pages of 128), decode rows of 1."""
    tables = Tables(seed=seed, d=d or geom.d, device=geom.device)
    a, prefix = scenario_basic(seed=seed, page=geom.page)
    worst, eng, state, checks = run_engine(config, Driver(a, seed=seed + 1, prefix=prefix), tables,
                                           check_means=check_means, fp8=fp8, geom=geom)
    checks["prefix"] = prefix
    return worst, eng, state, checks


@pytest.mark.parametrize("layer_quantises_q,seed,device", [(True, 11, "cpu"), (False, 12, "cpu"),
                                                            on_cuda(True, 13, "cuda")])
def test_fp8_cache_equals_the_library_call_and_the_dequantised_computation(monkeypatch, layer_quantises_q, seed,
                                                                           device):
    """alpha 0 (every block kept): the adapter's FP8 prefill == the library's direct FP8 call bit for bit at every
    step and layer; == attention on the dequantised cache up to the bf16 output rounding (CUDA: + P in e4m3);
    (CPU) == dense bf16 attention on bf16 dequantised values; == the original (unquantised) values within FP8
    tolerance; the k/v scales are each layer's own (another layer's give other bits); q arrives quantised by the
    layer or is quantised by the adapter with layer._q_scale, to the same bits."""
    monkeypatch.setattr(FakeFlashAttentionImpl, "quant_query_input", layer_quantises_q)
    geom = GEOMETRY[device]
    fp8 = Fp8Run(layer_quantises_q=layer_quantises_q, bf16_reference=device == "cpu", other_layer_differs=True)
    worst, eng, state, checks = _run_fp8(fp8, _config(geom, alpha=0.0), seed, geom=geom)
    assert checks["exact_calls"] == 2 * checks["prefill_steps"] > 10
    assert checks["other_layer_differs"] == checks["exact_calls"]
    assert worst <= 1, checks                  # the bfloat16 output rounding (CUDA: and P in e4m3), nothing more
    if device == "cpu":
        assert checks["worst_bf16"] < 3e-2, checks["worst_bf16"]      # + bf16 rounding of the dequantised inputs
    # e4m3 rounds each of q, k, v by up to 2^-4 relative: against the unquantised values the output is close, not
    # exact (max over ~3000 rows x 256 values; the mean error per row stays near 1 %)
    assert 1e-3 < checks["worst_orig"] < 0.35 and checks["worst_orig_mean"] < 0.02, checks
    assert eng.stats["prefix_hit_tokens"] >= checks["prefix"] + 255 and eng.stats["decode_completed_pages"]
    assert checks["mixed_steps"] > 0 and checks["mean_blocks"] > 50
    assert state.dispatch.calls == {"sparse": 2 * checks["prefill_steps"], "dense": 0}


@pytest.mark.parametrize("kv_cache_dtype,seed,device", [("fp8_e4m3", 21, "cpu"), ("fp8", 22, "cpu"),
                                                         on_cuda("fp8_e4m3", 23, "cuda")])
def test_fp8_cache_sparse_selection(kv_cache_dtype, seed, device):
    """The library's selection (default alpha) over an FP8 cache with the tracked mean cache (valid through decode
    writes and rewrites: its means are those of the dequantised cache): bit for bit the direct chunked_prefill, and
    the contiguous sparse reference on the dequantised values up to the output rounding (CUDA: + P in e4m3, and a
    few near-threshold flips). vLLM's 'fp8' is e4m3."""
    geom = GEOMETRY[device]
    worst, eng, state, checks = _run_fp8(Fp8Run(kv_cache_dtype=kv_cache_dtype), _config(geom), seed, geom=geom)
    assert checks["exact_calls"] == 2 * checks["prefill_steps"] > 10
    check_selection_rows(checks, device, sparse=True)
    assert checks["worst_orig_mean"] < 0.02, checks
    assert checks["mean_blocks"] > 50 and state.dispatch.calls == {"sparse": 2 * checks["prefill_steps"], "dense": 0}


def test_fp8_on_cuda_runs_sparse_and_dense_layers_dense(monkeypatch):
    """The dispatch's CUDA decisions replayed on the CPU: FP8 prefill runs block-sparse (head dim 128, block_size 128,
    pages of 64), without a warning; what runs dense is what runs dense for a 16-bit cache (here dense_layers=1:
    layer 0), dense FP8 attention; every call == its direct library call bit for bit."""
    replay_cuda(monkeypatch)
    monkeypatch.setattr(core, "_warned", set())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        worst, eng, state, checks = _run_fp8(Fp8Run(), _config(block_size=128, dense_layers=1), 31, d=128)
    n = checks["prefill_steps"]
    assert state.dispatch.calls == {"sparse": n, "dense": n} and state.dispatch.last_reason is None
    assert checks["exact_calls"] == 2 * n > 10 and worst <= 1, checks


def test_fp8_head_dim_64_on_cuda_goes_to_flash_attention(monkeypatch):
    """No CUDA FP8 kernel at all for head dim 64: the whole layer call goes to vLLM's FlashAttention (which serves
    FP8 at every head size), announced once naming kv_cache_dtype; results stay exact."""
    replay_cuda(monkeypatch)
    monkeypatch.setattr(core, "_warned", set())
    FakeFlashAttentionImpl.calls.clear()
    with pytest.warns(RuntimeWarning, match="kv_cache_dtype='fp8_e4m3': .*head dim 64.*FlashAttention"):
        worst, eng, state, checks = _run_fp8(Fp8Run(path="fa"), _config(alpha=0.0), 41)
    assert state.dispatch.calls == {"sparse": 0, "dense": 0}
    assert max(n for _, n in FakeFlashAttentionImpl.calls) > 90        # FA got the prefill chunks too
    assert worst <= 1 and checks["rows"] > 100


def test_fp8_descales_are_views_of_the_layer_scales(monkeypatch):
    """The library gets q quantised with layer._q_scale and [num_prefills, Hkv] descales that are stride-0 views of
    the layer's own scale tensors (no copy, no host read), for each layer its own."""
    import sparse_prefill.torch_ops as spt
    seen = []
    original = spt.chunked_prefill

    def spy(q, *args, **kwargs):
        seen.append((q, kwargs))
        return original(q, *args, **kwargs)

    monkeypatch.setattr(spt, "chunked_prefill", spy)  # the adapters' paged sparse call (core calls the operators)
    tables = Tables(seed=51)
    state = spv.engine_state(reset=True, config=_config())
    impl = Impl(tables.hq, tables.d, tables.d ** -0.5, tables.hkv, kv_cache_dtype="fp8_e4m3")
    lay = Layer(1)
    lay.load_scales(*tables.fp8_scales(1))
    kv = torch.zeros(Backend.get_kv_cache_shape(8, PAGE, tables.hkv, tables.d), dtype=torch.uint8)
    lens = [77, 131]                                                 # two prompts, odd lengths
    qsl = torch.tensor([0, 77, 208], dtype=torch.int32)
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    slots = torch.cat([torch.arange(77), 3 * PAGE + torch.arange(131)])
    cm = CommonAttentionMetadata(query_start_loc=qsl.clone(), query_start_loc_cpu=qsl,
                                 seq_lens=torch.tensor(lens, dtype=torch.int32), num_reqs=2, num_actual_tokens=208,
                                 max_query_len=131, max_seq_len=131, block_table_tensor=bt, slot_mapping=slots)
    md = Builder().build(0, cm)
    toks = torch.randint(0, 61, (208,), generator=torch.Generator().manual_seed(52))
    q = tables.qs(1, toks).bfloat16()
    k, v = (x.bfloat16() for x in tables.kv(1, toks))
    impl.do_kv_cache_update(lay, k, v, kv, slots)
    out = torch.full((208, tables.hq * tables.d), float("nan"), dtype=torch.bfloat16)
    impl.forward(lay, q, k, v, kv, md, out)
    assert len(seen) == 1 and state.dispatch.last_path == "sparse"
    q8, kw = seen[0]
    assert q8.dtype == F8 and torch.equal(q8.view(torch.uint8), fp8_quant(q, lay._q_scale).view(torch.uint8))
    for name, mine in (("q_descale", lay._q_scale), ("k_descale", lay._k_scale), ("v_descale", lay._v_scale)):
        d = kw[name]
        assert d.shape == (2, tables.hkv) and d.stride() == (0, 0) and d.data_ptr() == mine.data_ptr(), name
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("dtype", ["fp8_e5m2", "fp8_inc", "nvfp4", "int8"])
def test_unsupported_kv_cache_dtypes_raise_naming_the_argument(dtype):
    with pytest.raises(NotImplementedError, match=f"kv_cache_dtype='{dtype}'.*'fp8_e4m3'"):
        Impl(4, 64, 0.125, 2, kv_cache_dtype=dtype)
    assert not Backend.supports_kv_cache_dtype(dtype)


def test_backend_declarations():
    assert Backend.get_name() == "CUSTOM"
    assert Backend.get_impl_cls() is Impl and Backend.get_builder_cls() is Builder
    assert Backend.supported_kv_cache_dtypes == ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3"]
    assert all(Backend.supports_kv_cache_dtype(x) for x in (None, "auto", "fp8", "fp8_e4m3"))
    assert not Backend.supports_kv_connector() and not Backend.supports_sink()
    assert Backend.supports_compute_capability((9, 0)) and not Backend.supports_compute_capability((8, 0))
    assert Builder.reorder_batch_threshold == 1


def test_plan_step_reads_host_metadata_only():
    qsl_cpu = torch.tensor([0, 1, 2, 130, 400], dtype=torch.int32)
    plan = spv.plan_step(qsl_cpu.clone(), qsl_cpu, torch.tensor([50, 60, 900, 270], dtype=torch.int32),
                         torch.arange(16, dtype=torch.int32).view(4, 4), 4, 400, 900)
    assert (plan.num_decodes, plan.num_decode_tokens, plan.num_prefills) == (2, 2, 2)
    assert plan.cu_seqlens_q.tolist() == [0, 128, 398]
    assert plan.seqused_k.tolist() == [900, 270]
    assert (plan.max_seqlen_q, plan.max_seqlen_k) == (270, 900)
    assert plan.block_table.tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]


# ---------------------------------------------------------------------------------------------------------------------
# Conformance with the real vLLM (runs only where it imports)
# ---------------------------------------------------------------------------------------------------------------------

def test_vllm_conformance():
    vllm = pytest.importorskip("vllm")
    import inspect
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    spv.register()
    spv.register()          # idempotent
    cls = spv.SparsePrefillBackend
    assert issubclass(cls, FlashAttentionBackend) and issubclass(cls.get_impl_cls(), FlashAttentionImpl)
    assert AttentionBackendEnum.CUSTOM.get_path() == spv.BACKEND_PATH
    for name in ("forward", "do_kv_cache_update"):
        ours = inspect.signature(getattr(cls.get_impl_cls(), name)).parameters
        theirs = inspect.signature(getattr(FlashAttentionImpl, name)).parameters
        assert list(theirs)[: len(list(ours)) - 1] == list(ours)[: len(theirs)][: len(theirs)] or set(theirs) <= set(
            ours) | {"kwargs"}, (name, vllm.__version__)


def test_kernel_block_sizes_are_the_librarys_page_rule(monkeypatch):
    """The kernel block sizes vLLM may choose follow sp.CUDA_LIMITS.page_multiple (the C++ declaration the CUDA
    support checks read), not a restated 64: with another multiple the backend offers its multiples."""
    m = sp.CUDA_LIMITS.page_multiple
    assert Backend.get_supported_kernel_block_sizes() == [m, 2 * m, 4 * m]
    monkeypatch.setattr(spv, "CUDA_LIMITS", sp.CUDA_LIMITS._replace(page_multiple=32))
    assert Backend.get_supported_kernel_block_sizes() == [32, 64, 128]

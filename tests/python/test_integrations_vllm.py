"""vLLM adapter: contract tests against faithful fakes of vLLM V1's FlashAttention backend, metadata builder and
common metadata (field names and layouts of vllm/v1/attention/backend.py and backends/flash_attn.py), replaying the
engine's call sequence: metadata built once per step, then per layer do_kv_cache_update and forward; chunked prefill,
prefix hits (on pages decode completed, and vLLM's full-hit recompute of the last token), decode rows mixed with
prefill rows, page reuse. Checked against the CPU reference. Conformance tests run where vLLM imports."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
import sparse_prefill as sp  # noqa: E402
from engine_sim import Engine, Request, Tables, next_token, reference_rows  # noqa: E402
from sparse_prefill.integrations import SparsePrefillConfig  # noqa: E402
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
    """FA's impl: reshape_and_cache_flash for the write, flash_attn_varlen_func (here: the reference) for forward."""

    calls = []

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
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[ok].long()] = key[:n][ok].to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[ok].long()] = value[:n][ok].to(v_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        md = attn_metadata
        FakeFlashAttentionImpl.calls.append(("fa", md.num_actual_tokens))
        k_cache, v_cache = kv_cache.unbind(0)
        n = md.num_actual_tokens
        sp.attention(query[:n], k_cache, v_cache, md.query_start_loc, None, md.max_query_len, md.max_seq_len,
                     softmax_scale=self.scale, block_table=md.block_table, seqused_k=md.seq_lens,
                     out=output[:n].view(n, self.num_heads, self.head_size))
        return output


class Layer:
    def __init__(self, i):
        self.layer_name = f"model.layers.{i}.self_attn.attn"


Backend, Impl, Builder = spv.make_classes(FakeFlashAttentionBackend, FakeFlashAttentionImpl,
                                          FakeFlashAttentionMetadataBuilder)


# ---------------------------------------------------------------------------------------------------------------------
# Replaying vLLM's call sequence
# ---------------------------------------------------------------------------------------------------------------------

def run_engine(config, scenario, tables, num_pages=48, check_means=True):
    """Runs the scenario through the backend; returns (max error vs reference, engine, state, checks)."""
    state = spv.engine_state(reset=True, config=config)
    L, hq, hkv, d = tables.layers, tables.hq, tables.hkv, tables.d
    impls = [Impl(hq, d, d ** -0.5, hkv) for _ in range(L)]
    builder = Builder()
    kv = [torch.zeros(Backend.get_kv_cache_shape(num_pages, PAGE, hkv, d)) for _ in range(L)]
    eng = Engine(num_pages, PAGE, full_hit="vllm", chunk=96)
    worst, checks = 0.0, {"rows": 0, "decode_rows": 0, "prefill_rows": 0, "mixed_steps": 0, "mean_blocks": 0,
              "prefill_steps": 0}
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
        cm = CommonAttentionMetadata(query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq_lens,
                                     num_reqs=len(rows), num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens),
                                     max_seq_len=int(seq_lens.max()), block_table_tensor=bt, slot_mapping=slots)
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
            out = torch.full((q.shape[0], hq * d), float("nan"))
            impls[layer].do_kv_cache_update(Layer(layer), k, v, kv[layer], slots)
            if check_means:   # before forward: on the CPU the library rewrites the means of the blocks it pools
                written = {r.rid: s + n for r, s, n, _ in rows}
                checks["mean_blocks"] += check_mean_cache(state, kv[layer], tables, layer, eng, written)
            impls[layer].forward(Layer(layer), q, k, v, kv[layer], md, out)
            o = out.view(-1, hq, d)
            for i, (r, s, n) in enumerate(toks):
                is_dec = i < nd
                ref = reference_rows(tables, layer, r, s, n, None if (is_dec or config.alpha == 0) else config)
                err = (o[qsl[i]:qsl[i + 1]] - ref).abs().max().item()
                worst = max(worst, err)
                checks["rows"] += 1
        eng.commit(rows, next_token)
    return worst, eng, state, checks


def true_block_means(tables, layer, req, page_idx):
    k, v = tables.kv(layer, req.tokens[page_idx * PAGE:(page_idx + 1) * PAGE], page_idx * PAGE)
    return k.mean(0), v.mean(0)


def check_mean_cache(state, kv_layer, tables, layer, eng, written):
    """Every complete block of every live request: the tracker's means equal the block's true means."""
    means = state.tracker.get(kv_layer.data_ptr(), kv_layer[0])
    if means is None:
        return 0
    n = 0
    for req in eng.running:
        for i in range(written.get(req.rid, req.computed) // PAGE):
            km, vm = true_block_means(tables, layer, req, i)
            page = req.pages[i]
            torch.testing.assert_close(means[0][page], km, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(means[1][page], vm, atol=2e-5, rtol=1e-5)
            n += 1
    return n


def scenario_basic():
    """A: 300-token prompt, decodes 90 tokens (completes a page by decode); B arrives with A's first 320 tokens +
    more (prefix hit on the decode-completed page 4); C = A's first 256 tokens (full hit: vLLM recomputes token 255
    into its shared page); D, E plain prompts that run mixed with decodes; pages get reused after A finishes."""
    g = torch.Generator().manual_seed(0)
    a = Request("A", torch.randint(0, 61, (300,), generator=g).tolist(), max_new=90)
    steps = [(0, [a])]
    return a, steps


class Driver:
    """Arrivals that depend on A's generated tokens (B, C copy A's sequence once it is long enough)."""

    def __init__(self, a):
        self.a = a
        self.sent = set()

    def __iter__(self):
        step = 0
        g = torch.Generator().manual_seed(1)
        while step < 60:
            arrivals = []
            if step == 0:
                arrivals.append(self.a)
            if "B" not in self.sent and len(self.a.tokens) >= 330 and self.a.computed >= 320:
                arrivals.append(Request("B", self.a.tokens[:320] + torch.randint(0, 61, (150,), generator=g).tolist(),
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


def _config(**kw):
    base = dict(block_size=PAGE, min_sparse_q_len=1, min_sparse_kv_len=0, sink=64, window=64)
    base.update(kw)
    return SparsePrefillConfig.load(environ={}, **base)


def _run(config, check_means=True):
    tables = Tables()
    a, _ = scenario_basic()
    return run_engine(config, Driver(a), tables, check_means=check_means)


def test_dense_equivalence_alpha0_with_prefix_hits_and_mixed_rows():
    worst, eng, state, checks = _run(_config(alpha=0.0))
    assert worst < 2e-4, worst
    assert eng.stats["prefix_hit_tokens"] >= 320 + 255
    assert eng.stats["decode_completed_pages"], "the scenario must complete pages by decode"
    assert eng.stats["reused_pages"] > 0, "the scenario must reuse freed pages"
    assert checks["mixed_steps"] > 0 and checks["decode_rows"] > 0 and checks["prefill_rows"] > 0
    assert checks["mean_blocks"] > 50
    assert state.dispatch.calls["sparse"] > 0


def test_sparse_selection_matches_contiguous_reference():
    # the library's selection (alpha default) through the engine's pages == sp.sparse_prefill on contiguous K/V
    worst, eng, state, checks = _run(_config(), check_means=False)
    import inspect
    assert state.config.alpha == inspect.signature(sp.sparse_prefill).parameters["alpha"].default
    assert worst < 2e-4, worst
    assert state.dispatch.calls["sparse"] > 0


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


def test_fp8_kv_cache_rejected():
    with pytest.raises(NotImplementedError, match="FP8"):
        Impl(4, 64, 0.125, 2, kv_cache_dtype="fp8_e4m3")


def test_backend_declarations():
    assert Backend.get_name() == "CUSTOM"
    assert Backend.get_impl_cls() is Impl and Backend.get_builder_cls() is Builder
    assert "fp8" not in " ".join(Backend.supported_kv_cache_dtypes)
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

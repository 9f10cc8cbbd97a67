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
from engine_sim import Engine, Request, Tables, next_token, reference_rows  # noqa: E402
from sparse_prefill.integrations import SparsePrefillConfig  # noqa: E402
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
    def __init__(self, size, max_context_len):
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32)


class MHATokenToKVPool:
    def __init__(self, size, page_size, head_num, head_dim, layer_num):
        self.size, self.page_size = size, page_size
        self.k_buffer = [torch.zeros(size + page_size, head_num, head_dim) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(size + page_size, head_num, head_dim) for _ in range(layer_num)]

    def get_kv_buffer(self, layer_id):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None, layer_id_override=None):
        lid = layer.layer_id if layer_id_override is None else layer_id_override
        self.k_buffer[lid][loc.long()] = cache_k.to(self.k_buffer[lid].dtype)
        self.v_buffer[lid][loc.long()] = cache_v.to(self.v_buffer[lid].dtype)


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
    """FA3's role: decode (writes K/V via the pool, then paged attention with a token-level page table)."""

    calls = []

    def __init__(self, runner):
        self.runner = runner

    def init_forward_metadata(self, fb):
        self.fb = fb

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        FakeFA3Backend.calls.append(("decode", q.shape[0]))
        pool = self.runner.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer, fb.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        B = fb.batch_size
        max_k = int(fb.seq_lens_cpu.max())
        table = self.runner.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_k]   # token slots, page 1
        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        out = sp.attention(q.view(B, hq, d), k_buf.view(-1, 1, hkv, d), v_buf.view(-1, 1, hkv, d),
                           torch.arange(B + 1, dtype=torch.int32), None, 1, max_k, softmax_scale=layer.scaling,
                           block_table=table.contiguous(), seqused_k=fb.seq_lens.to(torch.int32))
        return out.reshape(B, hq * d)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        FakeFA3Backend.calls.append(("extend", q.shape[0]))
        raise AssertionError("extend is ours in these tests")

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        FakeFA3Backend.calls.append(("graph", max_bs))


class FakeBase:
    """SGLang's AttentionBackend.forward routing (decode -> forward_decode, else forward_extend)."""

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)


class Runner:
    def __init__(self, num_pages, tables, dtype="auto"):
        self.page_size = PAGE
        self.kv_cache_dtype_str = dtype
        self.req_to_token_pool = ReqToTokenPool(16, 2048)
        self.token_to_kv_pool = MHATokenToKVPool(num_pages * PAGE, PAGE, tables.hkv, tables.d, tables.layers)


Backend = sps.make_backend_class(FakeBase, FakeFA3Backend)


def _config(**kw):
    base = dict(block_size=PAGE, min_sparse_q_len=1, min_sparse_kv_len=0, sink=64, window=64)
    base.update(kw)
    return SparsePrefillConfig.load(environ={}, **base)


def run(config, mixed=True, check_means=True, steps=70):
    tables = Tables(seed=3)
    num_pages = 40
    runner = Runner(num_pages, tables)
    backend = Backend(runner, config=config)
    decode_backend = FakeFA3Backend(runner)          # HybridAttnBackend: decode goes to FA3, not to us
    eng = Engine(num_pages, PAGE, full_hit="sglang", chunk=100)
    slot_of_req = {}
    g = torch.Generator().manual_seed(5)
    a = Request("A", torch.randint(0, 61, (260,), generator=g).tolist(), max_new=80)
    worst, checks = 0.0, {"extend_steps": 0, "decode_steps": 0, "mixed_rows": 0, "mean_blocks": 0}
    sent = set()
    hq, hkv, d, L = tables.hq, tables.hkv, tables.d, tables.layers
    layers = [RadixAttention(i, hq, hkv, d, d ** -0.5) for i in range(L)]
    for step in range(steps):
        if step == 0:
            eng.add(a)
        if "B" not in sent and a.computed >= 320:
            eng.add(Request("B", a.tokens[:320] + torch.randint(0, 61, (130,), generator=g).tolist(), max_new=3))
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
                if mode == "decode":
                    out = be.forward_decode(q.reshape(-1, hq * d), k, v, layer, fb)
                else:
                    out = backend.forward(q.reshape(-1, hq * d), k, v, layer, fb)
                o = out.view(-1, hq, d)
                if check_means:
                    checks["mean_blocks"] += check_means_fn(backend, runner, tables, layer.layer_id, eng, brows)
                row = 0
                for r, s, n in toks:
                    ref = reference_rows(tables, layer.layer_id, r, s, n,
                                         None if (mode == "decode" or config.alpha == 0) else config)
                    worst = max(worst, (o[row:row + n] - ref).abs().max().item())
                    row += n
        eng.commit(rows, next_token)
    return worst, eng, backend, checks


def make_batch(mode, rows, eng, runner, slot_of_req):
    r2t = runner.req_to_token_pool.req_to_token
    for r, s, n, _ in rows:
        sl = eng.slots(r, 0, s + n)
        r2t[slot_of_req[r.rid], : s + n] = torch.tensor(sl, dtype=torch.int32)
    seq = torch.tensor([s + n for _, s, n, _ in rows], dtype=torch.int64)
    ext = [n for _, _, n, _ in rows]
    pre = [s for _, s, _, _ in rows]
    return ForwardBatch(forward_mode=ForwardMode(mode), batch_size=len(rows),
                        req_pool_indices=torch.tensor([slot_of_req[r.rid] for r, *_ in rows]),
                        seq_lens=seq, seq_lens_cpu=seq.clone(),
                        out_cache_loc=torch.tensor(sum((eng.slots(r, s, n) for r, s, n, _ in rows), [])),
                        extend_seq_lens=torch.tensor(ext), extend_prefix_lens=torch.tensor(pre),
                        extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=pre,
                        positions=torch.cat([torch.arange(s, s + n) for _, s, n, _ in rows]))


def check_means_fn(backend, runner, tables, layer_id, eng, rows):
    k_buf, _ = runner.token_to_kv_pool.get_kv_buffer(layer_id)
    means = backend.tracker.get(layer_id, k_buf.view(-1, PAGE, tables.hkv, tables.d))
    if means is None:
        return 0
    written = {r.rid: s + n for r, s, n, _ in rows}
    n = 0
    for req in eng.running:
        for i in range(written.get(req.rid, req.computed) // PAGE):
            km, vm = tables.kv(layer_id, req.tokens[i * PAGE:(i + 1) * PAGE], i * PAGE)
            torch.testing.assert_close(means[0][req.pages[i]], km.mean(0), atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(means[1][req.pages[i]], vm.mean(0), atol=2e-5, rtol=1e-5)
            n += 1
    return n


def test_alpha0_equals_dense_mixed_chunks_prefix_hits():
    worst, eng, backend, checks = run(_config(alpha=0.0))
    assert worst < 2e-4, worst
    assert eng.stats["prefix_hit_tokens"] >= 320
    assert eng.stats["decode_completed_pages"]
    assert checks["extend_steps"] > 3 and checks["mixed_rows"] > 0 and checks["mean_blocks"] > 50
    assert backend.dispatch.calls["sparse"] > 0


def test_sparse_selection_and_separate_decode_batches():
    FakeFA3Backend.calls.clear()
    worst, eng, backend, checks = run(_config(), mixed=False, check_means=True)
    assert worst < 2e-4, worst
    assert checks["decode_steps"] > 10       # decode writes went through FA3 -> the pool -> the tracker
    assert not any(c[0] == "extend" for c in FakeFA3Backend.calls)


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


def test_fp8_kv_cache_rejected():
    tables = Tables()
    with pytest.raises(NotImplementedError, match="FP8"):
        Backend(Runner(4, tables, dtype="fp8_e4m3"), config=_config())


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

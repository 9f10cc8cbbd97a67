"""The adapters' core: configuration sources and precedence, defaults taken from the library, the dispatch's choice
and its in-place output, and the varlen layout of padded transformers batches (CPU reference)."""

import json

import pytest

torch = pytest.importorskip("torch")
import sparse_prefill as sp  # noqa: E402
from engine_sim import replay_cuda  # noqa: E402
from sparse_prefill.integrations import SparsePrefillConfig, VarlenDispatch, library_selection_defaults  # noqa: E402
from sparse_prefill.integrations.core import layer_index  # noqa: E402


def test_defaults_come_from_the_library(monkeypatch):
    lib = sp.Selection()  # the library's defaults (sp.sparse_prefill's signature shows <library default>)
    c = SparsePrefillConfig.load(environ={})
    for name in ("alpha", "block_size", "sink", "window", "last_n", "correction", "rule", "union", "head_subgroups",
                 "mean_alpha", "key_rank"):
        assert getattr(c, name) == getattr(lib, name), name
    assert (c.rule, c.correction) == (sp.SELECTION_DEFAULTS["rule"], sp.SELECTION_DEFAULTS["correction"])
    # the library's table is the source: moving a default there moves the adapters' default
    monkeypatch.setitem(sp.SELECTION_DEFAULTS, "alpha", 0.25)
    c = SparsePrefillConfig.load(environ={})
    assert c.alpha == 0.25
    assert library_selection_defaults()["sink"] == lib.sink


def test_config_declares_every_selection_field():
    """The adapters' selection is the library's table (sp.Selection's fields) less final_chunk and max_kept_blocks:
    a field added to the C++ list reaches SELECTION_FIELDS and SparsePrefillConfig's generated fields by itself, each
    read from a variable as its library default's type."""
    import dataclasses
    from sparse_prefill.integrations.core import SELECTION_FIELDS
    assert set(SELECTION_FIELDS) == set(sp.Selection().as_dict()) - {"final_chunk", "max_kept_blocks"}
    declared = {f.name for f in dataclasses.fields(SparsePrefillConfig)}
    assert set(SELECTION_FIELDS) <= declared, set(SELECTION_FIELDS) - declared
    c = SparsePrefillConfig.load(environ={})
    assert c.selection() == {n: getattr(sp.Selection(), n) for n in SELECTION_FIELDS}
    env = {"SPARSE_PREFILL_ALPHA": "0.25", "SPARSE_PREFILL_RULE": "key_max", "SPARSE_PREFILL_CORRECTION": "1",
           "SPARSE_PREFILL_KEY_RANK": "32"}
    c = SparsePrefillConfig.load(environ=env)
    assert (c.alpha, c.rule, c.correction, c.key_rank) == (0.25, "key_max", True, 32)
    assert [type(getattr(c, n)) for n in ("alpha", "rule", "correction", "key_rank")] == [float, str, bool, int]


def test_precedence_kwargs_env_file(tmp_path):
    f = tmp_path / "sp.json"
    f.write_text(json.dumps({"alpha": 0.3, "dense_layers": 2, "final_chunk": "never", "correction": False}))
    env = {"SPARSE_PREFILL_CONFIG": str(f), "SPARSE_PREFILL_ALPHA": "0.05", "SPARSE_PREFILL_MIN_SPARSE_Q_LEN": "512"}
    c = SparsePrefillConfig.load(environ=env, dense_layers=4)
    assert (c.alpha, c.dense_layers, c.final_chunk, c.correction, c.min_sparse_q_len) == (0.05, 4, "never", False,
                                                                                           512)
    assert SparsePrefillConfig.load(config_file=str(f), environ={}).alpha == 0.3


@pytest.mark.parametrize("env,err", [({"SPARSE_PREFILL_ALPHA": "lots"}, "SPARSE_PREFILL_ALPHA"),
                                     ({"SPARSE_PREFILL_CORRECTION": "maybe"}, "SPARSE_PREFILL_CORRECTION"),
                                     ({"SPARSE_PREFILL_FINAL_CHUNK": "sometimes"}, "final_chunk")])
def test_bad_values_name_the_setting(env, err):
    with pytest.raises(ValueError, match=err):
        SparsePrefillConfig.load(environ=env)


def test_unknown_keys(tmp_path):
    f = tmp_path / "sp.json"
    f.write_text(json.dumps({"alpah": 0.1}))
    with pytest.raises(ValueError, match="alpah"):
        SparsePrefillConfig.load(config_file=str(f), environ={})
    with pytest.raises(TypeError, match="alpah"):
        SparsePrefillConfig.load(environ={}, alpah=0.1)


def test_layer_index():
    assert layer_index("model.layers.17.self_attn.attn") == 17
    assert layer_index(3) == 3 and layer_index("attn") is None


def _qkv(lq, lk, hq=4, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(lq, hq, d, generator=g), torch.randn(lk, hkv, d, generator=g),
            torch.randn(lk, hkv, d, generator=g))


def test_dispatch_choice_and_out_in_place():
    d = VarlenDispatch(SparsePrefillConfig.load(environ={}, min_sparse_q_len=64, min_sparse_kv_len=256,
                                                dense_layers=1, block_size=64))
    q, k, v = _qkv(300, 300)
    cu = torch.tensor([0, 300], dtype=torch.int32)
    ref = sp.attention(q, k, v, cu, cu, 300, 300)
    for layer, lq, expect in ((0, 300, "dense"), (1, 300, "sparse"), (1, 32, "dense")):
        out = torch.full_like(q[:lq], float("nan"))
        cq = torch.tensor([0, lq], dtype=torch.int32)
        r = d(q[300 - lq:], k, v, cq, cu, lq, 300, out=out, layer_idx=layer)
        assert r is out and d.last_path == expect, (layer, lq, d.last_reason)
        assert torch.isfinite(out).all()
        if expect == "dense":
            torch.testing.assert_close(out, ref[300 - lq:], atol=1e-5, rtol=1e-5)
    assert d.sparse_reason(q, k, 300, 300, layer_idx=1, window=(16, 0)) == "sliding window"
    assert d.sparse_reason(q, k, 300, 300, layer_idx=1, softcap=30.0) == "softcap"


def test_dispatch_sparse_equals_library_call():
    cfg = SparsePrefillConfig.load(environ={}, min_sparse_q_len=1, min_sparse_kv_len=0, block_size=64, sink=64,
                                   window=64, dense_fraction=1.0)  # the sparse path even where it keeps most blocks
    q, k, v = sp.workload.topic(1024, 4, 2, 64, seed=2, block=64)
    q, k, v = map(torch.from_numpy, (q, k, v))
    cu = torch.tensor([0, 1024], dtype=torch.int32)
    out = torch.empty_like(q)
    VarlenDispatch(cfg)(q, k, v, cu, cu, 1024, 1024, out=out)
    ref = sp.sparse_prefill(q, k, v, cu, cu, 1024, 1024, **cfg.selection())
    dense = sp.attention(q, k, v, cu, cu, 1024, 1024)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert (out - dense).abs().max() > 1e-3       # the sparse path really ran (topic data: density < 1)


# ---------------------------------------------------------------------------------------------------------------------
# FP8 KV caches: the pieces the engine adapters share
# ---------------------------------------------------------------------------------------------------------------------

from sparse_prefill.integrations import core  # noqa: E402

F8 = torch.float8_e4m3fn


def _bits(x):
    return x.view(torch.int16) if x.dtype in (torch.bfloat16, torch.float16) else x.view(torch.uint8)


def test_kv_cache_dtype_check_names_the_argument():
    assert core.check_kv_cache_dtype("auto", ("auto", "bfloat16"), ("fp8_e4m3",)) is False
    assert core.check_kv_cache_dtype("fp8_e4m3", ("auto", "bfloat16"), ("fp8_e4m3",)) is True
    for bad in ("fp8_e5m2", "fp8_inc", "nvfp4", "int8"):
        with pytest.raises(NotImplementedError, match=r"kv_cache_dtype='" + bad + "'.*'fp8_e4m3'") as e:
            core.check_kv_cache_dtype(bad, ("auto", "bfloat16"), ("fp8_e4m3",), hint="use auto")
        assert "use auto" in str(e.value)
    with pytest.raises(NotImplementedError, match="e5m2 caches have no kernel"):
        core.check_kv_cache_dtype("fp8_e5m2", ("auto",), ("fp8_e4m3",))


def test_fp8_descale_is_a_stride0_view_of_the_engine_scale():
    s = torch.tensor(0.0125)                       # vLLM's layer._k_scale / SGLang's layer.k_scale: 0-d float32
    d = core.fp8_descale(s, 5, 3, "k_scale")
    assert d.shape == (5, 3) and d.stride() == (0, 0) and d.data_ptr() == s.data_ptr()
    s.copy_(torch.tensor(0.5))                     # loaded after the backend was built: the view sees it
    assert (d == 0.5).all()
    per_head = torch.tensor([0.1, 0.2, 0.3])       # per-KV-head scales
    d = core.fp8_descale(per_head, 4, 3)
    assert d.stride() == (0, 1) and d.data_ptr() == per_head.data_ptr() and d[3].tolist() == per_head.tolist()
    assert core.fp8_descale(torch.tensor([0.25]), 2, 3).stride() == (0, 0)
    assert core.fp8_descale(None, 2, 3) is None
    with pytest.raises(ValueError, match="k_scale.*shape"):
        core.fp8_descale(torch.ones(2), 2, 3, "k_scale")
    with pytest.raises(TypeError, match="v_scale.*float32"):
        core.fp8_descale(torch.tensor(1.0, dtype=torch.float64), 2, 3, "v_scale")
    with pytest.raises(TypeError, match="q_scale"):
        core.fp8_descale(0.5, 2, 3, "q_scale")


def test_quantize_query():
    g = torch.Generator().manual_seed(11)
    q = (torch.randn(37, 4, 64, generator=g) * 3).to(torch.bfloat16)
    s = torch.tensor(0.02)
    expect = (q.float() / s).clamp(-448, 448).to(F8)
    assert torch.equal(_bits(core.quantize_query(q, s)), _bits(expect))
    assert (core.quantize_query(q, s).float() == 448).any()            # saturates (q / 0.02 reaches past 448)
    assert torch.isfinite(core.quantize_query(q * 1000, None).float()).all()
    per_head = torch.tensor([0.02, 0.05])                               # Hkv = 2: heads 0, 1 -> 0.02; 2, 3 -> 0.05
    got = core.quantize_query(q, per_head)
    assert torch.equal(_bits(got[:, :2]), _bits((q[:, :2].float() / 0.02).clamp(-448, 448).to(F8)))
    assert torch.equal(_bits(got[:, 2:]), _bits((q[:, 2:].float() / 0.05).clamp(-448, 448).to(F8)))
    assert torch.equal(_bits(core.quantize_query(q, None)), _bits(q.to(F8)))   # SGLang's FA3: q.to(e4m3)
    q8 = q.to(F8)
    assert core.quantize_query(q8, s) is q8                              # vLLM's layer already quantised it
    with pytest.raises(TypeError, match="q:"):
        core.quantize_query(q.to(torch.float8_e5m2), s)


def _fp8_case(lq=301, lk=333, hq=4, hkv=2, d=64, seed=5):
    q, k, v = _qkv(lq, lk, hq, hkv, d, seed)
    qs, ks, vs = torch.tensor(0.011), torch.tensor(0.013), torch.tensor(0.009)
    q8 = (q.float() / qs).clamp(-448, 448).to(F8)
    k8 = (k / ks).clamp(-448, 448).to(F8)
    v8 = (v / vs).clamp(-448, 448).to(F8)
    ds = {n: core.fp8_descale(x, 1, hkv) for n, x in (("q_descale", qs), ("k_descale", ks), ("v_descale", vs))}
    return q8, k8, v8, ds


def test_dispatch_fp8_sparse_on_the_cpu_equals_the_library_call():
    cfg = SparsePrefillConfig.load(environ={}, min_sparse_q_len=1, min_sparse_kv_len=0, block_size=64, sink=64,
                                   window=64)
    q8, k8, v8, ds = _fp8_case()
    cu_q = torch.tensor([0, 301], dtype=torch.int32)
    cu_k = torch.tensor([0, 333], dtype=torch.int32)
    out = torch.full((301, 4, 64), float("nan"), dtype=torch.bfloat16)
    disp = VarlenDispatch(cfg)
    assert disp(q8, k8, v8, cu_q, cu_k, 301, 333, out=out, **ds) is out and disp.last_path == "sparse"
    full = {n: torch.full((1, 2), float(x[0, 0])) for n, x in ds.items()}   # contiguous descales, same values
    ref = sp.sparse_prefill(q8, k8, v8, cu_q, cu_k, 301, 333, final_chunk=True, **cfg.selection(), **full)
    assert torch.equal(_bits(out), _bits(ref))
    # an fp32 model's output buffer: one bfloat16 temporary, the same values
    out32 = torch.full((301, 4, 64), float("nan"))
    assert disp(q8, k8, v8, cu_q, cu_k, 301, 333, out=out32, **ds) is out32
    assert torch.equal(out32, ref.float())


def test_dispatch_fp8_on_cuda_runs_sparse_and_dense_where_16_bits_do(monkeypatch):
    """The CUDA decision replayed on the CPU (core._on_cuda): FP8 prefill runs block-sparse, without a warning, and
    runs dense exactly where a bf16 call of the same shape does (the CUDA sparse kernels' constraints)."""
    replay_cuda(monkeypatch)
    monkeypatch.setattr(core, "_warned", set())
    cfg = SparsePrefillConfig.load(environ={}, min_sparse_q_len=1, min_sparse_kv_len=0, block_size=128)
    q8, k8, v8, ds = _fp8_case(d=128)
    cu_q = torch.tensor([0, 301], dtype=torch.int32)
    cu_k = torch.tensor([0, 333], dtype=torch.int32)
    disp = VarlenDispatch(cfg)
    out = torch.full((301, 4, 128), float("nan"), dtype=torch.bfloat16)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        disp(q8, k8, v8, cu_q, cu_k, 301, 333, out=out, **ds)
    assert (disp.last_path, disp.last_reason, disp.calls) == ("sparse", None, {"sparse": 1, "dense": 0})
    full = {n: torch.full((1, 2), float(x[0, 0])) for n, x in ds.items()}
    ref = sp.sparse_prefill(q8, k8, v8, cu_q, cu_k, 301, 333, final_chunk=True, **cfg.selection(), **full)
    assert torch.equal(_bits(out), _bits(ref))
    # what still runs dense, FP8 or not, with the same reason as a bf16 call of that shape: short keys, a sliding
    # window, pages of 32 (the kernels load pages of a multiple of 64 by TMA), block_size 64, dense_layers, head dim
    # 64; the kernels' reasons are the library's (sp.sparse_support, here as a CUDA build answers it)
    def paged(x, page):
        n = -(-x.shape[0] // page) * page
        return torch.cat([x, x[:n - x.shape[0]]]).reshape(n // page, page, *x.shape[1:])  # the tail: unread rows

    def decide(d, q, k, v, kw, page=None, descales=None):
        out = torch.empty(q.shape, dtype=torch.bfloat16)
        extra = dict(descales or {})
        if page is None:
            d(q, k, v, cu_q, cu_k, 301, 333, out=out, **kw, **extra)
        else:
            kc, vc = paged(k, page), paged(v, page)
            bt = torch.arange(kc.shape[0], dtype=torch.int32)[None]
            used = torch.tensor([333], dtype=torch.int32)
            d(q, kc, vc, cu_q, None, 301, 333, out=out, block_table=bt, seqused_k=used, **kw, **extra)
        return d.last_path, d.last_reason

    qb, kb, vb = q8.to(torch.bfloat16), k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    cfg = dict(environ={}, min_sparse_q_len=1, min_sparse_kv_len=0)
    cases = [(VarlenDispatch(SparsePrefillConfig.load(environ={}, block_size=128)), {}, None,
              "max_seqlen_k 333 < min_sparse_kv_len 8192"),
             (disp, dict(window=(63, 0)), None, "sliding window"),
             (disp, {}, 32, "got page_size 32"),
             (VarlenDispatch(SparsePrefillConfig.load(**cfg, block_size=64)), {}, None, "got block_size 64"),
             (VarlenDispatch(SparsePrefillConfig.load(**cfg, block_size=128, dense_layers=1)), dict(layer_idx=0),
              None, "layer 0 < dense_layers 1")]
    for d, kw, page, want in cases:
        path, why = decide(d, q8, k8, v8, kw, page, ds)
        assert path == "dense" and why is not None and want in why, (want, why)
        assert decide(d, qb, kb, vb, kw, page) == (path, why)
    assert decide(disp, q8, k8, v8, {}, 64, ds) == ("sparse", None)
    q64, k64, v64, ds64 = _fp8_case(d=64)
    path, why = decide(disp, q64, k64, v64, {}, None, ds64)
    assert path == "dense" and "head dim 128 only, got 64" in why


def test_fp8_kernel_reason(monkeypatch):
    q = torch.zeros(3, 4, 64, dtype=F8)
    assert core.fp8_kernel_reason(q, 64, 16) is None        # the CPU computes everything
    replay_cuda(monkeypatch)
    assert "head dim 64" in core.fp8_kernel_reason(q, 64, 64)
    assert "page_size 16" in core.fp8_kernel_reason(q, 128, 16)
    assert core.fp8_kernel_reason(q, 128, 128) is None and core.fp8_kernel_reason(q, 128) is None


def test_mean_tracker_fp8_means_of_the_dequantised_cache():
    """write= reads back what the cache stores; the means are of stored x descale, as the library pools them."""
    from sparse_prefill.integrations import MeanCacheTracker
    g = torch.Generator().manual_seed(3)
    kc = torch.zeros(4, 64, 2, 32, dtype=torch.uint8)          # an FP8 cache as engines allocate it (uint8 storage)
    vc = torch.zeros_like(kc)
    k8v, v8v = kc.view(F8), vc.view(F8)
    ks, vs = torch.tensor(0.02), torch.tensor([0.01, 0.03])   # per-tensor k scale, per-head v scale
    tr = MeanCacheTracker(64)
    k = torch.randn(100, 2, 32, generator=g)
    v = torch.randn(100, 2, 32, generator=g)
    loc = torch.arange(64, 164)                               # pages 1, 2

    def write():
        kc.view(-1, 2, 32)[loc] = (k / ks).clamp(-448, 448).to(F8).view(torch.uint8)
        vc.view(-1, 2, 32)[loc] = (v / vs.view(1, 2, 1)).clamp(-448, 448).to(F8).view(torch.uint8)

    tr.on_write("l", k8v, v8v, loc, k, v, write=write, k_descale=ks, v_descale=vs)
    km, vm = tr.get("l", k8v)
    stored_k = k8v[1].float() * ks
    stored_v = v8v[1].float() * vs.view(1, 2, 1)
    torch.testing.assert_close(km[1], stored_k.mean(0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(vm[1], stored_v.mean(0), atol=1e-6, rtol=1e-5)
    assert (km[1] - k[:64].mean(0)).abs().max() > 1e-5        # quantised, not the values handed to the engine
    torch.testing.assert_close(km[2][:, :], (k8v[2].float() * ks)[:36].sum(0) / 64, atol=1e-6, rtol=1e-5)  # partial


def test_cuda_limits_and_the_dispatchs_padding(monkeypatch):
    """sp.CUDA_LIMITS is the C++ declaration (include/sparse_prefill/attention.h CudaLimits) the CUDA checks read
    (test_sparse_support.py checks the checks against it on the GPU); the dispatch pads a contiguous 16-bit head dim
    to the next one the sparse kernels take, read from it at call time."""
    lim = sp.CUDA_LIMITS
    assert lim == sp.CudaLimits(dtypes=("bfloat16", "float16", "float8_e4m3fn"), sparse_head_dims=(128,),
                                page_multiple=64)
    assert set(lim.sparse_head_dims) <= set(sp.HEAD_DIMS) and "float32" not in lim.dtypes
    assert [core._padded_head_dim(d) for d in (32, 64, 128, 160)] == [128, 128, 128, 160]
    monkeypatch.setattr(sp, "CUDA_LIMITS", lim._replace(sparse_head_dims=(64, 128)))
    assert [core._padded_head_dim(d) for d in (32, 64, 96, 128)] == [64, 64, 128, 128]

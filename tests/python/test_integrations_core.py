"""The adapters' core: configuration sources and precedence, defaults taken from the library, the dispatch's choice
and its in-place output, and the varlen layout of padded transformers batches (CPU reference)."""

import inspect
import json

import pytest

torch = pytest.importorskip("torch")
import sparse_prefill as sp  # noqa: E402
from sparse_prefill.integrations import SparsePrefillConfig, VarlenDispatch, library_selection_defaults  # noqa: E402
from sparse_prefill.integrations.core import layer_index  # noqa: E402


def test_defaults_come_from_the_library(monkeypatch):
    sig = inspect.signature(sp.sparse_prefill).parameters
    c = SparsePrefillConfig.load(environ={})
    for name in ("alpha", "block_size", "sink", "window", "last_n", "correction", "rule", "union", "head_subgroups"):
        assert getattr(c, name) == sig[name].default, name
    assert (c.rule, c.correction) == (sp.SELECTION_DEFAULTS["rule"], sp.SELECTION_DEFAULTS["correction"])
    # the library's table is the source: moving a default there moves the adapters' default
    monkeypatch.setitem(sp.SELECTION_DEFAULTS, "alpha", 0.25)
    c = SparsePrefillConfig.load(environ={})
    assert c.alpha == 0.25
    assert library_selection_defaults()["sink"] == sig["sink"].default


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
                                   window=64)
    q, k, v = sp.workload.topic(1024, 4, 2, 64, seed=2, block=64)
    q, k, v = map(torch.from_numpy, (q, k, v))
    cu = torch.tensor([0, 1024], dtype=torch.int32)
    out = torch.empty_like(q)
    VarlenDispatch(cfg)(q, k, v, cu, cu, 1024, 1024, out=out)
    ref = sp.sparse_prefill(q, k, v, cu, cu, 1024, 1024, **cfg.selection())
    dense = sp.attention(q, k, v, cu, cu, 1024, 1024)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert (out - dense).abs().max() > 1e-3       # the sparse path really ran (topic data: density < 1)

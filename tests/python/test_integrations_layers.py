"""Per-layer settings in the adapters' configuration (`layers`, what `python -m sparse_prefill.calibrate` writes):
validation with errors naming the entry, the file round trip, the dispatch applying each layer's selection or dense
attention, the transformers adapter passing module.layer_idx through (spied library calls), and the zero-padding of
head dim 64 for CUDA sparse calls (replayed on the CPU). The vLLM and SGLang replays with per-layer settings are in
their own test files (test_per_layer_settings_reach_each_layer). Also `validated_lengths` (the lengths a calibrated
file was measured at): validation, and the dispatch's one warning for prompts past LONG_PROMPT_FACTOR times them."""

import functools
import json
import warnings

import pytest

torch = pytest.importorskip("torch")
import sparse_prefill as sp  # noqa: E402
from engine_sim import LibrarySpy, replay_cuda  # noqa: E402
from sparse_prefill.integrations import SparsePrefillConfig, VarlenDispatch  # noqa: E402
from sparse_prefill.integrations import core  # noqa: E402

LAYERS = {"0": {"alpha": 0.5, "head_subgroups": 1}, "2": {"dense": True}, "3": {"rule": "tile_energy",
                                                                                 "correction": True}}


def test_layers_select_per_layer_and_dense():
    c = SparsePrefillConfig.load(environ={}, alpha=0.05, layers=LAYERS)
    assert c.layers == {0: {"alpha": 0.5, "head_subgroups": 1}, 2: {"dense": True},
                        3: {"rule": "tile_energy", "correction": True}}
    assert c.selection(0)["alpha"] == 0.5 and c.selection(0)["head_subgroups"] == 1
    assert c.selection(1) == c.selection() and c.selection(1)["alpha"] == 0.05     # no entry: the top level
    assert c.selection(3)["rule"] == "tile_energy" and c.selection(3)["alpha"] == 0.05
    assert [c.layer_dense(i) for i in range(4)] == [False, False, True, False]
    assert "dense" not in c.selection(2)
    c2 = SparsePrefillConfig.load(environ={}, dense_layers=2, layers={"1": {"alpha": 0.2}})
    assert c2.layer_dense(1) and not c2.layer_dense(2)        # dense_layers comes first


def test_file_round_trip_and_no_environment_variable(tmp_path):
    c = SparsePrefillConfig.load(environ={}, alpha=0.05, block_size=256, layers=LAYERS)
    path = tmp_path / "sparse_prefill.json"
    c.save(str(path))
    data = json.loads(path.read_text())
    assert data == {"alpha": 0.05, "block_size": 256, "layers": {"0": {"alpha": 0.5, "head_subgroups": 1},
                                                                 "2": {"dense": True},
                                                                 "3": {"rule": "tile_energy", "correction": True}}}
    back = SparsePrefillConfig.load(config_file=str(path), environ={})
    assert back == c
    # layers come from the file or keyword arguments only: a SPARSE_PREFILL_LAYERS variable changes nothing
    env = {"SPARSE_PREFILL_CONFIG": str(path), "SPARSE_PREFILL_LAYERS": '{"0": {"dense": true}}'}
    assert SparsePrefillConfig.load(environ=env).layers == c.layers
    assert SparsePrefillConfig.load(environ={}).file_dict() == {}


@pytest.mark.parametrize("layers,err", [
    ({"0": {"alpha": "lots"}}, "layers.0.alpha: expected float"),
    ({"1": {"alpha": -0.1}}, r"layers.1.alpha: must lie in \[0, 1\]"),
    ({"1": {"alpha": 1.5}}, r"layers.1.alpha: must lie in \[0, 1\]"),     # the library refuses it at the first call
    ({"3": {"mean_alpha": 2}}, r"layers.3.mean_alpha: must lie in \[0, 1\]"),
    ({"1": {"dense_fraction": 1.5}}, r"layers.1.dense_fraction: must lie in \(0, 1\]"),
    ({"4": {"rule": "best"}}, "layers.4.rule: must be one of"),
    ({"4": {"head_subgroups": -1}}, r"layers.4.head_subgroups: must be 0 \(one selection per query head\) or >= 1"),
    ({"4": {"key_rank": 8}}, "layers.4.key_rank: must be 16 or 32, got 8"),
    ({"4": {"sink": -2}}, "layers.4.sink: must be >= 0"),
    ({"2": {"block_size": 256}}, "layers.2.block_size: block_size is one value for the whole model"),
    ({"2": {"alpah": 0.1}}, "layers.2.alpah: unknown per-layer setting"),
    ({"2": {"dense": "maybe"}}, "layers.2.dense: expected a boolean"),
    ({"first": {"alpha": 0.1}}, "layers: key 'first' is not a layer index"),
    ({"-1": {"alpha": 0.1}}, "layers: key '-1' is not a layer index"),
    ({"0": 0.1}, "layers.0: expected an object of selection settings"),
    ([{"alpha": 0.1}], "layers: expected a mapping from layer index to settings"),
])
def test_bad_layers_name_the_entry(tmp_path, layers, err):
    with pytest.raises(ValueError, match=err):
        SparsePrefillConfig.load(environ={}, layers=layers)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"layers": layers}))
    with pytest.raises(ValueError, match=err):
        SparsePrefillConfig.load(config_file=str(path), environ={})


@pytest.mark.parametrize("field,value,err", [("alpha", -1.0, r"alpha: must lie in \[0, 1\]"),
                                             ("alpha", 1.5, r"alpha: must lie in \[0, 1\]"),
                                             ("dense_fraction", 0.0, "dense_fraction: must lie in"),
                                             ("block_size", 96, "block_size: must be a positive multiple of 64"),
                                             ("rule", "rowmax", "rule: must be one of")])
def test_bad_top_level_selection_names_the_field(field, value, err):
    with pytest.raises(ValueError, match=err):
        SparsePrefillConfig.load(environ={}, **{field: value})


def _qkv(L=640, hq=4, hkv=2, d=64, dtype=torch.float32, seed=3):
    q, k, v = (torch.from_numpy(x).to(dtype) for x in sp.workload.topic(L, hq, hkv, d, seed=seed, block=64))
    return q, k, v, torch.tensor([0, L], dtype=torch.int32)


def test_dispatch_applies_each_layers_selection(monkeypatch):
    spy = LibrarySpy()
    monkeypatch.setattr(core, "spt", spy)
    cfg = SparsePrefillConfig.load(environ={}, min_sparse_q_len=1, min_sparse_kv_len=0, block_size=64, sink=64,
                                   window=64, dense_fraction=1.0,
                                   layers={"1": {"alpha": 0.5, "head_subgroups": 1}, "2": {"dense": True}})
    disp = VarlenDispatch(cfg)
    q, k, v, cu = _qkv()
    L = q.shape[0]
    outs = []
    for layer in (0, 1, 2):
        out = torch.full_like(q, float("nan"))
        disp(q, k, v, cu, cu, L, L, out=out, layer_idx=layer)
        outs.append(out)
    assert [c[0] for c in spy.calls] == ["sparse_prefill", "sparse_prefill", "attention"]
    assert spy.calls[0][1]["alpha"] == cfg.alpha and spy.calls[1][1]["alpha"] == 0.5
    assert spy.calls[1][1]["head_subgroups"] == 1 and spy.calls[0][1]["head_subgroups"] == cfg.head_subgroups
    assert disp.sparse_reason(q, k, L, L, layer_idx=2) == "layer 2 is dense in layers"
    for layer in (0, 1):
        ref = sp.sparse_prefill(q, k, v, cu, cu, L, L, **cfg.selection(layer))
        torch.testing.assert_close(outs[layer], ref, atol=1e-6, rtol=1e-6)
    assert (outs[0] - outs[1]).abs().max() > 1e-4             # the two selections differ on this input
    torch.testing.assert_close(outs[2], sp.attention(q, k, v, cu, cu, L, L, return_lse=False), atol=1e-6,
                               rtol=1e-6)
    # a call without a layer index runs dense when per-layer settings exist (as with dense_layers)
    assert "unknown layer index" in disp.sparse_reason(q, k, L, L, layer_idx=None)


def test_cuda_head_dim_64_is_padded_to_128(monkeypatch):
    """On CUDA the sparse kernels take head dim 128: contiguous 16-bit calls of head dim 64 (the transformers adapter)
    run zero-padded, with the model's softmax scale, and give the head-dim-64 result. Replayed on the CPU by replacing
    core._on_cuda; paged and FP8 calls of head dim 64 still run dense (no padding of an engine's cache)."""
    import sparse_prefill.torch_ops as spt
    replay_cuda(monkeypatch)
    seen = []
    real = spt.sparse_prefill

    @functools.wraps(real)
    def spy(q, *args, **kwargs):
        seen.append((q.shape[-1], kwargs.get("softmax_scale")))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(spt, "sparse_prefill", spy)   # the adapters' sparse call (core calls the operators)
    cfg = SparsePrefillConfig.load(environ={}, min_sparse_q_len=1, min_sparse_kv_len=0, block_size=128, sink=128,
                                   window=128, dense_fraction=1.0, alpha=0.3)
    q, k, v, cu = _qkv(L=1024, dtype=torch.bfloat16)
    L = q.shape[0]
    disp = VarlenDispatch(cfg)
    assert disp.sparse_reason(q, k, L, L) is None
    out = torch.full_like(q, float("nan"))
    disp(q, k, v, cu, cu, L, L, out=out)
    assert disp.last_path == "sparse" and seen == [(128, 64 ** -0.5)]
    ref = sp.sparse_prefill(q, k, v, cu, cu, L, L, **cfg.selection())
    dense = sp.attention(q, k, v, cu, cu, L, L, return_lse=False)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    assert (out.float() - dense.float()).abs().max() > 0.05   # sparse really ran (topic data)
    # an engine's paged cache is never padded: the library's answer for head dim 64 sends it to dense
    kc, vc = k[:1024].reshape(16, 64, 2, 64), v[:1024].reshape(16, 64, 2, 64)
    bt, used = torch.arange(16, dtype=torch.int32)[None], torch.tensor([1024], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    disp(q, kc, vc, cu, None, L, L, out=out, block_table=bt, seqused_k=used)
    assert disp.last_path == "dense" and "head dim 128 only, got 64" in disp.last_reason
    torch.testing.assert_close(out.float(), dense.float(), atol=1e-2, rtol=1e-2)


def test_transformers_adapter_passes_the_layer_index(monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    from sparse_prefill.integrations import transformers as sphf
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.save_pretrained(str(tmp_path / "m"))
    path = tmp_path / "sparse_prefill.json"
    path.write_text(json.dumps({"block_size": 64, "sink": 64, "window": 64, "alpha": 0.9,
                                "layers": {"1": {"dense": True}, "2": {"alpha": 0.01, "head_subgroups": 1}}}))
    dispatch = sphf.register("sp_layers_test", config_file=str(path), environ={}, min_sparse_kv_len=0)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), attn_implementation="sp_layers_test")
    spy = LibrarySpy()
    monkeypatch.setattr(core, "spt", spy)
    with torch.no_grad():
        m(input_ids=torch.randint(0, 128, (1, 700), generator=torch.Generator().manual_seed(1)), use_cache=False)
    assert [c[0] for c in spy.calls] == ["sparse_prefill", "attention", "sparse_prefill"]
    assert spy.calls[0][1]["alpha"] == 0.9 and spy.calls[0][1]["head_subgroups"] == dispatch.config.head_subgroups
    assert spy.calls[2][1]["alpha"] == 0.01 and spy.calls[2][1]["head_subgroups"] == 1
    assert dispatch.calls == {"sparse": 2, "dense": 1}


@pytest.mark.parametrize("value", [[], [0], [4096.5], ["4096"], "4096", 4096, [True], {"4096": 1}])
def test_bad_validated_lengths_name_the_field(tmp_path, value):
    with pytest.raises(ValueError, match="validated_lengths: expected a non-empty list of prompt lengths"):
        SparsePrefillConfig.load(environ={}, validated_lengths=value)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"validated_lengths": value}))
    with pytest.raises(ValueError, match="validated_lengths"):
        SparsePrefillConfig.load(config_file=str(path), environ={})


def test_validated_lengths_round_trip_and_no_environment_variable(tmp_path):
    c = SparsePrefillConfig.load(environ={}, validated_lengths=(8192, 4096))
    assert c.validated_lengths == [4096, 8192]
    path = tmp_path / "c.json"
    c.save(str(path))
    assert json.loads(path.read_text()) == {"validated_lengths": [4096, 8192]}
    env = {"SPARSE_PREFILL_CONFIG": str(path), "SPARSE_PREFILL_VALIDATED_LENGTHS": "999999"}
    assert SparsePrefillConfig.load(environ=env) == c
    assert SparsePrefillConfig.load(environ={}).validated_lengths is None


def _long_prompt_warnings(disp, lengths):
    """The RuntimeWarnings about validated_lengths of one call per length (every warning recorded, not Python's
    once-per-place filter: the dispatch's own once-only is under test)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for L in lengths:
            q, k, v, cu = _qkv(L=L)
            disp(q, k, v, cu, cu, L, L, out=torch.empty_like(q), layer_idx=0)
    return [w for w in seen if "validated_lengths" in str(w.message)]


def test_long_prompt_warns_once_past_the_factor(tmp_path, monkeypatch):
    monkeypatch.setattr(core, "_warned", set())
    geometry = dict(block_size=64, sink=64, window=64, last_n=1, min_sparse_q_len=1, min_sparse_kv_len=0)
    path = tmp_path / "sparse_prefill.json"
    path.write_text(json.dumps({"validated_lengths": [256, 320]}))
    disp = VarlenDispatch(SparsePrefillConfig.load(config_file=str(path), environ={}, **geometry))
    limit = int(core.LONG_PROMPT_FACTOR * 320)
    assert _long_prompt_warnings(disp, [320, limit]) == []              # up to the factor: silent
    seen = _long_prompt_warnings(disp, [limit + 64, limit + 128, limit + 64])
    assert len(seen) == 1 and issubclass(seen[0].category, RuntimeWarning)
    assert f"{limit + 64} tokens" in str(seen[0].message) and "320" in str(seen[0].message)
    assert disp.calls["sparse"] == 5
    # a file written before the field (no validated_lengths): never a warning
    monkeypatch.setattr(core, "_warned", set())
    path.write_text(json.dumps({"alpha": 0.01}))
    old = VarlenDispatch(SparsePrefillConfig.load(config_file=str(path), environ={}, **geometry))
    assert old.config.validated_lengths is None and _long_prompt_warnings(old, [limit + 128]) == []
    # a long prompt that runs dense runs no calibrated setting: no warning either
    dense = VarlenDispatch(SparsePrefillConfig.load(environ={}, validated_lengths=[320],
                                                    **{**geometry, "min_sparse_kv_len": 4096}))
    assert _long_prompt_warnings(dense, [limit + 128]) == [] and dense.calls == {"sparse": 0, "dense": 1}

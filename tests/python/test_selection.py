"""sp.Selection: the selection as one immutable value, validated once, with the library's defaults; the functions'
selection keywords are a shorthand for it. Also the named structures that cross the binding (_C.Inputs,
_C.SelectionParams, _C.IndexArrays, _C.HostIndex) on the CPU."""

import pickle
import re

import numpy as np
import pytest

import sparse_prefill as sp
from sparse_prefill import _C
from conftest import BAND_CASE_SELECTION, band_case, make_varlen

Q_LENS, K_LENS = [300, 129], [300, 500]
SEL = dict(block_size=64, sink=64, window=64, last_n=1, alpha=0.3)


@pytest.fixture
def call(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, Q_LENS, K_LENS, hq=4, hkv=2, d=64)
    return q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS)


def test_defaults_are_the_librarys():
    s = sp.Selection()
    for name, value in sp.SELECTION_DEFAULTS.items():
        assert getattr(s, name) == value, name
    assert (s.final_chunk, s.union, s.max_kept_blocks) == (True, False, None)
    c = _C.SelectionParams()  # SelectionParams{} through the binding
    for name in ("block_size", "sink", "window", "last_n", "correction", "head_subgroups", "final_chunk", "key_rank"):
        assert getattr(c, name) == getattr(s, name), name
    for name in ("alpha", "mean_alpha", "candidate_alpha", "dense_fraction"):
        assert abs(getattr(c, name) - getattr(s, name)) < 1e-7, name
    assert c.rule == sp._api._RULES[s.rule] and c.union_lists == s.union and c.max_kept_blocks == -1
    p = s._params  # what crosses the binding
    assert (p.block_size, p.rule, p.max_kept_blocks) == (c.block_size, c.rule, -1)


def test_key_max_rule_and_key_rank_round_trip(call):
    """rule 'key_max' <-> SelectionRule::kKeyMax (4) and key_rank (SELECTION_DEFAULTS from SelectionParams{}) through
    Selection, its params, replace, pickle, and a call: keywords and selection= give the same index."""
    assert sp.SELECTION_DEFAULTS["key_rank"] == _C.SelectionParams().key_rank == 16
    assert sp._api._RULES["key_max"] == 4 and sp._api._RULE_NAMES[4] == "key_max"
    s = sp.Selection(rule="key_max", key_rank=32, alpha=1.0, block_size=64, sink=0, window=0, last_n=0,
                     dense_fraction=1.0)
    assert (s.rule, s.key_rank, s._params.rule, s._params.key_rank) == ("key_max", 32, 4, 32)
    assert "key_rank=32" in repr(s) and "key_rank=32" in repr(s._params)
    assert pickle.loads(pickle.dumps(s)) == s and s.replace(key_rank=16).key_rank == 16
    assert s.as_dict()["key_rank"] == 32 and s != s.replace(key_rank=16)
    args = call
    by_kw = sp.build_index(*args, rule="key_max", key_rank=32, alpha=1.0, block_size=64, sink=0, window=0,
                           last_n=0, dense_fraction=1.0)
    by_sel = sp.build_index(*args, selection=s)
    assert np.array_equal(by_kw.block_ids, by_sel.block_ids) and by_kw.density < 1.0
    with pytest.raises(ValueError, match="^key_rank: given both"):
        sp.build_index(*args, selection=s, key_rank=32)


def test_exact_max_rule_and_candidate_alpha_round_trip(call):
    """rule 'exact_max' <-> SelectionRule::kExactMax (5) and candidate_alpha (default 0.003, SelectionParams{})
    through Selection, its params and a call: keywords and selection= give the same index, inside the candidates
    (rule 'row_max' at candidate_alpha), and candidate_alpha is read (1: each row's top pooled block and the
    always-kept ones the only candidates, fewer blocks than 0: every visible block a candidate)."""
    assert abs(sp.SELECTION_DEFAULTS["candidate_alpha"] - 0.003) < 1e-9
    assert sp._api._RULES["exact_max"] == 5 and sp._api._RULE_NAMES[5] == "exact_max"
    s = sp.Selection(rule="exact_max", alpha=0.5, candidate_alpha=0.01, block_size=64, sink=0, window=0, last_n=0,
                     dense_fraction=1.0)
    assert (s.rule, s._params.rule) == ("exact_max", 5) and abs(s._params.candidate_alpha - 0.01) < 1e-9
    assert "candidate_alpha=0.01" in repr(s) and pickle.loads(pickle.dumps(s)) == s
    by_kw = sp.build_index(*call, rule="exact_max", alpha=0.5, candidate_alpha=0.01, block_size=64, sink=0,
                           window=0, last_n=0, dense_fraction=1.0)
    by_sel = sp.build_index(*call, selection=s)
    assert np.array_equal(by_kw.block_ids, by_sel.block_ids) and by_kw.density < 1.0
    cand = sp.build_index(*call, selection=s.replace(rule="row_max", alpha=0.01))
    assert all(set(by_kw.block_ids[a:e]) <= set(cand.block_ids[c:f]) for a, e, c, f in
               zip(by_kw.segment_start, by_kw.segment_end, cand.segment_start, cand.segment_end))
    wide, narrow = (sp.build_index(*call, selection=s.replace(candidate_alpha=c)) for c in (0.0, 1.0))
    assert narrow.kept_blocks < wide.kept_blocks


@pytest.mark.parametrize("spike_key,far_kept", [(700, True), (768, False)])
def test_exact_max_scores_the_diagonal_block_not_the_window_band(spike_key, far_kept):
    """exact_max_spec.md step 2: of the always-kept blocks only those not fully visible to the tile are scored. Tile 6
    (positions 768-895, block 128, window 256: band blocks 4-6) sees a key of logit 10 and, in block 2, one of logit
    5; every other logit is 0 and alpha 0.05 (ln -3). In the band's block 5 (fully visible) the spike sets no row's
    maximum, so block 2 is the rows' top and kept; in the diagonal block 6 it is scored, and block 2 (-5) is dropped."""
    q, k, cu, L = band_case(spike_key)
    idx = sp.build_index(q, k, k.copy(), cu, cu, L, L, **BAND_CASE_SELECTION)
    blocks = set(idx.segment(0, 0, 6).tolist())
    assert {0, 4, 5, 6} <= blocks  # sink, band, diagonal: always kept
    assert (2 in blocks) == far_kept and 1 not in blocks  # block 1 (logit 0) is 10 or 5 below the top either way


@pytest.mark.parametrize("fields,exc,name", [
    (dict(alpha=-0.1), ValueError, "alpha"),
    (dict(alpha=1.5), ValueError, "alpha"),
    (dict(alpha="0.1"), TypeError, "alpha"),
    (dict(block_size=96), ValueError, "block_size"),
    (dict(block_size=64.0), TypeError, "block_size"),
    (dict(block_size=2**40), ValueError, "block_size"),
    (dict(mean_alpha=2.0), ValueError, "mean_alpha"),
    (dict(key_rank=8), ValueError, "key_rank"),
    (dict(key_rank=64), ValueError, "key_rank"),
    (dict(key_rank=16.0), TypeError, "key_rank"),
    (dict(dense_fraction=0.0), ValueError, "dense_fraction"),
    (dict(sink=-1), ValueError, "sink"),
    (dict(window=-1), ValueError, "window"),
    (dict(last_n=-2), ValueError, "last_n"),
    (dict(rule="max"), ValueError, "rule"),
    (dict(head_subgroups=-1), ValueError, "head_subgroups"),
    (dict(correction="yes"), TypeError, "correction"),
    (dict(union=2), TypeError, "union"),
    (dict(max_kept_blocks=-5), ValueError, "max_kept_blocks"),
    (dict(max_kept_blocks=1.5), TypeError, "max_kept_blocks"),
])
def test_validated_at_construction_naming_the_field(fields, exc, name):
    with pytest.raises(exc, match=f"^{name}: "):
        sp.Selection(**fields)


def test_immutable_and_a_value():
    s = sp.Selection(alpha=0.01)
    with pytest.raises(AttributeError, match="^alpha: a Selection is immutable"):
        s.alpha = 0.5
    with pytest.raises(AttributeError):
        del s.block_size
    with pytest.raises(AttributeError):
        s.other = 1
    assert s == sp.Selection(alpha=0.01) and hash(s) == hash(sp.Selection(alpha=0.01))
    assert s != sp.Selection() and "alpha=0.01" in repr(s)
    t = s.replace(block_size=256)
    assert (t.block_size, t.alpha, s.block_size) == (256, 0.01, 128)
    with pytest.raises(ValueError, match="^block_size: "):
        s.replace(block_size=100)
    with pytest.raises(TypeError, match="^blocksize: not a field"):
        s.replace(blocksize=256)
    assert pickle.loads(pickle.dumps(s)) == s
    with pytest.raises(TypeError):
        sp.Selection(0.01)  # keywords only


def test_keywords_and_selection_are_the_same_call(call):
    want, lse_want = sp.sparse_prefill(*call, **SEL, return_lse=True)
    got, lse_got = sp.sparse_prefill(*call, selection=sp.Selection(**SEL), return_lse=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(lse_got, lse_want)
    a = sp.build_index(*call, **SEL)
    b = sp.build_index(*call, selection=sp.Selection(**SEL))
    for name in a._ARRAYS[:-1]:
        np.testing.assert_array_equal(a.host[name], b.host[name])
    assert sp.index_workspace_bytes(*call, **SEL) == sp.index_workspace_bytes(*call, selection=sp.Selection(**SEL))


def test_chunked_prefill_takes_a_selection_and_its_final_chunk_wins(rng):
    hq, hkv, d, page, L, C = 4, 2, 64, 64, 512, 128
    k_cache = rng.standard_normal((L // page, page, hkv, d)).astype(np.float32)
    v_cache = rng.standard_normal((L // page, page, hkv, d)).astype(np.float32)
    q = rng.standard_normal((C, hq, d)).astype(np.float32)
    args = (q, k_cache, v_cache, np.array([0, C], np.int32), np.arange(L // page, dtype=np.int32)[None],
            np.array([L], np.int32), C, L)
    sel = sp.Selection(**SEL, final_chunk=True)
    for final in (False, True):
        want = sp.chunked_prefill(*args, final_chunk=final, **SEL)
        got = sp.chunked_prefill(*args, final_chunk=final, selection=sel)
        np.testing.assert_array_equal(got, want)


def test_a_keyword_beside_selection_is_an_error(call):
    sel = sp.Selection(alpha=0.2)
    with pytest.raises(ValueError, match=r"^alpha: given both as a keyword \(0.5\) and through selection= \(0.2\)"):
        sp.sparse_prefill(*call, selection=sel, alpha=0.5)
    with pytest.raises(ValueError, match="^block_size: given both"):
        sp.build_index(*call, selection=sel, block_size=64)
    with pytest.raises(ValueError, match="^union: given both"):
        sp.index_workspace_bytes(*call, selection=sel, union=True)
    with pytest.raises(TypeError, match="^selection: expected a sparse_prefill.Selection, got dict"):
        sp.sparse_prefill(*call, selection=dict(alpha=0.2))


# Every public function that takes both selection= and selection keywords, with the keywords it takes (chunked_prefill:
# its final_chunk is the step's, required, and not a selection keyword; the *_workspace_bytes() functions take the
# others through **keywords)
_ALL_KEYWORDS = tuple(sp.Selection().as_dict())  # the library's one table of fields (C++ selection_fields.h)
_ENTRY_POINTS = ("build_index", "sparse_prefill", "chunked_prefill", "index_workspace_bytes",
                 "sparse_prefill_workspace_bytes", "chunked_prefill_workspace_bytes")
# a valid value other than the library's default, per keyword
_OTHER = dict(alpha=0.01, rule="tile_energy", mean_alpha=0.25, key_rank=32, candidate_alpha=0.02, block_size=64,
              sink=0, window=0, last_n=1, correction=True, head_subgroups=1, dense_fraction=1.0, final_chunk=False,
              union=True, max_kept_blocks=1000)


def test_every_field_has_a_value_to_test():
    """A field added to the C++ list reaches every signature by itself; the tests here need a non-default value."""
    assert set(_OTHER) == set(_ALL_KEYWORDS)
    assert all(_OTHER[k] != getattr(sp.Selection(), k) for k in _OTHER)


def _keywords_of(name):
    return [k for k in _ALL_KEYWORDS if not (name.startswith("chunked_prefill") and k == "final_chunk")]


def _cases():
    return [(fn, kw) for fn in _ENTRY_POINTS for kw in _keywords_of(fn)]


@pytest.fixture
def paged_call(rng):
    hq, hkv, d, page, L, C = 4, 2, 64, 64, 256, 128
    k_cache = rng.standard_normal((L // page, page, hkv, d)).astype(np.float32)
    v_cache = rng.standard_normal((L // page, page, hkv, d)).astype(np.float32)
    q = rng.standard_normal((C, hq, d)).astype(np.float32)
    return (q, k_cache, v_cache, np.array([0, C], np.int32), np.arange(L // page, dtype=np.int32)[None],
            np.array([L], np.int32), C, L)


def _invoke(name, call, paged_call, **kwargs):
    fn = getattr(sp, name)
    if name == "chunked_prefill":
        return fn(*paged_call, final_chunk=True, **kwargs)
    return fn(*(paged_call if name.startswith("chunked_prefill") else call), **kwargs)


@pytest.mark.parametrize("name,keyword", _cases())
def test_a_keyword_at_its_default_beside_selection_is_an_error(call, paged_call, name, keyword):
    """Issue 43: `selection=sel, alpha=0.003` (alpha's default) was silently ignored while alpha=0.01 raised. Any
    selection keyword passed beside selection= raises, naming it, whatever its value."""
    default = getattr(sp.Selection(), keyword)
    sel = sp.Selection(**{keyword: _OTHER[keyword]})
    with pytest.raises(ValueError, match=rf"^{keyword}: given both as a keyword \({re.escape(repr(default))}\) and "
                                         rf"through selection= \({re.escape(repr(_OTHER[keyword]))}\)"):
        _invoke(name, call, paged_call, selection=sel, **{keyword: default})
    # also when the keyword equals the Selection's own field: which of the two was meant is not guessed
    with pytest.raises(ValueError, match=f"^{keyword}: given both"):
        _invoke(name, call, paged_call, selection=sp.Selection(), **{keyword: default})


@pytest.mark.parametrize("name,keyword", _cases())
def test_a_keyword_off_its_default_beside_selection_is_an_error(call, paged_call, name, keyword):
    other = _OTHER[keyword]
    assert other != getattr(sp.Selection(), keyword)
    with pytest.raises(ValueError, match=rf"^{keyword}: given both as a keyword \({re.escape(repr(other))}\)"):
        _invoke(name, call, paged_call, selection=sp.Selection(), **{keyword: other})
    with pytest.raises(ValueError, match=f"^{keyword}: given both"):  # equal to the Selection's field
        _invoke(name, call, paged_call, selection=sp.Selection(**{keyword: other}), **{keyword: other})


def test_selection_keywords_default_to_the_library_default():
    """The signatures show <library default> (one sentinel object) for every selection keyword; left out, each
    resolves to sp.SELECTION_DEFAULTS / Selection()'s value (the C++ SelectionParams{})."""
    import inspect
    from sparse_prefill._selection import _LIBRARY_DEFAULT, _selection
    assert repr(_LIBRARY_DEFAULT) == "<library default>"
    import copy
    assert copy.deepcopy(_LIBRARY_DEFAULT) is _LIBRARY_DEFAULT
    assert pickle.loads(pickle.dumps(_LIBRARY_DEFAULT)) is _LIBRARY_DEFAULT
    for name in _ENTRY_POINTS:
        params = inspect.signature(getattr(sp, name)).parameters
        for keyword in _keywords_of(name):
            if keyword in params:  # the *_workspace_bytes() functions take the rest through **keywords
                assert params[keyword].default is _LIBRARY_DEFAULT, (name, keyword)
        assert "<library default>" in str(inspect.signature(getattr(sp, name)))
    assert _selection(None, {}) is _selection(None, {}) == sp.Selection()
    assert {k: getattr(sp.Selection(), k) for k in sp.SELECTION_DEFAULTS} == sp.SELECTION_DEFAULTS


def test_keywords_alone_or_selection_alone_give_the_same_index(call, paged_call):
    """Only keywords, or only selection=, work as before: left out, passed at their default values, or as the
    Selection of those values, the index is the same; so are a non-default selection's three forms."""
    defaults = sp.Selection().as_dict()
    for form in (dict(alpha=0.3, block_size=64, sink=64, window=64, last_n=1), {}):
        indexes = [sp.build_index(*call, **form),
                   sp.build_index(*call, **dict(defaults, **form)),  # every keyword passed, no selection=
                   sp.build_index(*call, selection=sp.Selection(**form))]
        for other in indexes[1:]:
            for name in indexes[0]._ARRAYS[:-1]:
                np.testing.assert_array_equal(other.host[name], indexes[0].host[name])
        assert indexes[0].block_size == form.get("block_size", sp.SELECTION_DEFAULTS["block_size"])
        outs = [sp.sparse_prefill(*call, **form), sp.sparse_prefill(*call, **dict(defaults, **form)),
                sp.sparse_prefill(*call, selection=sp.Selection(**form))]
        for other in outs[1:]:
            np.testing.assert_array_equal(other, outs[0])
        sizes = {sp.sparse_prefill_workspace_bytes(*call, **form),
                 sp.sparse_prefill_workspace_bytes(*call, **dict(defaults, **form)),
                 sp.sparse_prefill_workspace_bytes(*call, selection=sp.Selection(**form))}
        assert len(sizes) == 1
    # chunked_prefill: final_chunk= beside selection= is the step's, not a conflict
    chunk_defaults = {k: v for k, v in defaults.items() if k != "final_chunk"}
    for final in (False, True):
        want = sp.chunked_prefill(*paged_call, final_chunk=final)
        np.testing.assert_array_equal(sp.chunked_prefill(*paged_call, final_chunk=final, **chunk_defaults), want)
        np.testing.assert_array_equal(sp.chunked_prefill(*paged_call, final_chunk=final, selection=sp.Selection()),
                                      want)


def test_keyword_errors_still_name_the_keyword(call):
    with pytest.raises(ValueError, match="^alpha: "):
        sp.sparse_prefill(*call, alpha=2.0)
    with pytest.raises(TypeError, match="^block_size: "):
        sp.sparse_prefill(*call, block_size=64.0)
    with pytest.raises(TypeError, match="^window: "):  # not the cached Selection of window=64
        sp.sparse_prefill(*call, **dict(SEL, window=64.0))


def test_named_structures_at_the_binding(call):
    q, k, v, cu_q, cu_k, mq, mk = call
    inputs = _C.Inputs(q, k, v, cu_q, mq, mk, cu_seqlens_k=cu_k, window_left=3, window_right=-1)
    assert (inputs.max_seqlen_q, inputs.max_seqlen_k, inputs.causal, inputs.window, inputs.stream) == \
        (mq, mk, True, (3, -1), 0)
    assert not inputs.paged and inputs.softmax_scale is None
    with pytest.raises(TypeError):
        _C.Inputs(q, k, v, cu_q, mq, mk, cu_k)  # the optional fields are keywords
    with pytest.raises(TypeError, match="^q: expected an array"):
        _C.Inputs("q", k, v, cu_q, mq, mk)
    opts = _C.LaunchOptions(checked=True)
    assert (opts.dense_path, opts.split_kv, opts.checked) == (0, True, True)
    # one Inputs serves several calls (it holds its arrays)
    index = sp.build_index(*call, **SEL)
    inputs = _C.Inputs(q, k, v, cu_q, mq, mk, cu_seqlens_k=cu_k)
    out1, out2 = np.empty_like(q), np.empty_like(q)
    view = index._arrays(index._lib)
    _C.sparse_attention(inputs, view, out1, None)
    _C.sparse_attention(inputs, view, out2, None)
    np.testing.assert_array_equal(out1, out2)
    host = index._host_index()
    assert (host.block_size, host.group_size, host.num_kv_heads, host.kept_blocks) == \
        (index.block_size, index.group_size, index.num_kv_heads, index.kept_blocks)
    u = sp.union_index(index, *call)
    assert u.mode == "union"


def test_selection_reaches_the_torch_operators(call):
    torch = pytest.importorskip("torch")
    import sparse_prefill.torch_ops as spt
    t = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in call]
    want = spt.sparse_prefill(*t, **SEL)
    np.testing.assert_array_equal(want.numpy(), sp.sparse_prefill(*call, selection=sp.Selection(**SEL)))
    with pytest.raises(ValueError, match=r"^rule: must be one of 0 \('tile_energy'\), .*5 \('exact_max'\), got 7"):
        torch.ops.sparse_prefill.sparse_prefill(*t, rule=7)
    with pytest.raises(ValueError, match="^alpha: must lie in"):
        spt.sparse_prefill(*t, alpha=3.0)

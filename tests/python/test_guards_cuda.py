"""Issue 19 on CUDA: bad device values (cu_seqlens, seqused_k, block_table, index arrays) never make a kernel read or
write out of bounds; the call returns without a host read, the affected rows come out NaN, sp.check_errors() raises
naming the argument (and clears the word), checked mode raises before the launch, and CUDA-graph capture still works.
Skipped without a GPU (scripts/gpu.sh runs them on the H200, also under compute-sanitizer in the fuzz phase)."""

import numpy as np
import pytest

import sparse_prefill as sp
from conftest import make_varlen, to_paged

torch = pytest.importorskip("torch")
if not (torch.cuda.is_available() and sp._C.with_cuda):
    pytest.skip("needs a CUDA GPU and a CUDA build", allow_module_level=True)

pytestmark = pytest.mark.cuda
CHECKED = sp.LaunchOptions(checked=True)


@pytest.fixture(autouse=True)
def clean_error_word():
    sp.check_errors()
    yield
    torch.cuda.synchronize()


def _g(x, dtype=None):
    t = torch.from_numpy(np.ascontiguousarray(x)).cuda()
    return t.to(dtype) if dtype is not None else t


def _arg(e):
    return getattr(e.value, "argument", None)


def _flagged(arg, contains=None):
    torch.cuda.synchronize()  # no sticky CUDA error: nothing was accessed out of bounds
    with pytest.raises(ValueError) as e:
        sp.check_errors()
    assert _arg(e) == arg, str(e.value)
    if contains:
        assert contains in str(e.value), str(e.value)
    sp.check_errors()  # cleared


def _paged_case(rng, q_len, k_len, page_size, hq=8, hkv=2, d=128, extra_pages=0):
    q, k, v, cu_q, cu_k = make_varlen(rng, [q_len], [k_len], hq=hq, hkv=hkv, d=d)
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, page_size, extra_pages=extra_pages)
    bf = torch.bfloat16
    return _g(q, bf), _g(kc, bf), _g(vc, bf), _g(cu_q), _g(bt), _g(used)


@pytest.mark.parametrize("page_size,q_len", [(8, 10), (64, 100), (64, 3), (128, 200)])  # gather, TMA, split-KV
def test_seqused_k_beyond_the_pages(page_size, q_len):
    """The issue's first example: seqused_k = [5000] with 2 pages (memcheck saw 130 invalid reads)."""
    rng = np.random.default_rng(0)
    q, kc, vc, cu_q, bt, used = _paged_case(rng, q_len, 2 * page_size - 3, page_size)
    bad = torch.tensor([5000], dtype=torch.int32, device="cuda")
    out = sp.attention(q, kc, vc, cu_q, None, q_len, 5000, block_table=bt, seqused_k=bad, return_lse=False)
    assert torch.isnan(out).all()
    _flagged("seqused_k", f"seqused_k[0] = 5000 exceeds the {bt.shape[1] * page_size} rows")
    with pytest.raises(ValueError) as e:
        sp.attention(q, kc, vc, cu_q, None, q_len, 5000, block_table=bt, seqused_k=bad, options=CHECKED)
    assert _arg(e) == "seqused_k"


@pytest.mark.parametrize("dense_path", ["dense", "split_kv"])
def test_cu_seqlens_q_past_the_rows(dense_path):
    """The issue's second example: cu_seqlens_q = [0, 11] with 10 rows of q."""
    rng = np.random.default_rng(1)
    q, k, v, cu_q, cu_k = make_varlen(rng, [10], [300], hq=8, hkv=2, d=128)
    bf = torch.bfloat16
    args = (_g(q, bf), _g(k, bf), _g(v, bf), _g(np.array([0, 11], np.int32)), _g(cu_k), 11, 300)
    out, lse = sp.attention(*args, options=sp.LaunchOptions(dense_path=dense_path), return_lse=True)
    assert torch.isnan(out).all() and torch.isnan(lse).all()  # the clipped rows [0, 10) of the bad sequence
    _flagged("cu_seqlens_q", "exceeds the 10 rows of q")
    with pytest.raises(ValueError) as e:
        sp.attention(*args, options=sp.LaunchOptions(dense_path=dense_path, checked=True))
    assert _arg(e) == "cu_seqlens_q"


@pytest.mark.parametrize("page_size", [8, 64, 128])
def test_block_table_page_out_of_range(page_size):
    """The issue's third example: page id 99 with 2 pages in the cache."""
    rng = np.random.default_rng(2)
    q, kc, vc, cu_q, bt, used = _paged_case(rng, 20, 2 * page_size, page_size)
    bad = bt.clone()
    bad[0, 1] = 99
    out = sp.attention(q, kc, vc, cu_q, None, 20, 2 * page_size, block_table=bad, seqused_k=used, return_lse=False)
    assert torch.isnan(out).any()
    _flagged("block_table", "= 99 is out of range [0, 2)")
    with pytest.raises(ValueError) as e:
        sp.attention(q, kc, vc, cu_q, None, 20, 2 * page_size, block_table=bad, seqused_k=used, options=CHECKED)
    assert _arg(e) == "block_table"


def test_bad_sequence_leaves_the_others_intact():
    rng = np.random.default_rng(3)
    q, k, v, cu_q, cu_k = make_varlen(rng, [100, 50, 70], [100, 50, 70], hq=4, hkv=2, d=128)
    bf = torch.bfloat16
    good = sp.attention(_g(q, bf), _g(k, bf), _g(v, bf), _g(cu_q), _g(cu_k), 100, 300, return_lse=False)
    bad_k = cu_k.copy()
    bad_k[2] = bad_k[1] - 1  # sequence 1: decreasing key offsets (sequence 2 then spans 121 keys: valid, wrong)
    out = sp.attention(_g(q, bf), _g(k, bf), _g(v, bf), _g(cu_q), _g(bad_k), 100, 300, return_lse=False)
    _flagged("cu_seqlens_k")
    assert torch.isnan(out[100:150]).all()
    assert torch.equal(out[:100], good[:100])  # sequence 0 is untouched (sequence 2 reads other rows: wrong, flagged)


def _sparse_inputs(rng, paged):
    q, k, v, cu_q, cu_k = make_varlen(rng, [700, 300], [700, 300], hq=8, hkv=2, d=128)
    bf = torch.bfloat16
    if paged:
        kc, vc, bt, used = to_paged(rng, k, v, cu_k, 64)
        return dict(q=_g(q, bf), k=_g(kc, bf), v=_g(vc, bf), cu_seqlens_q=_g(cu_q), cu_seqlens_k=None,
                    block_table=_g(bt), seqused_k=_g(used))
    return dict(q=_g(q, bf), k=_g(k, bf), v=_g(v, bf), cu_seqlens_q=_g(cu_q), cu_seqlens_k=_g(cu_k),
                block_table=None, seqused_k=None)


def _sp(x, mq=700, mk=700, **kw):
    return sp.sparse_prefill(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], mq, mk,
                             block_table=x["block_table"], seqused_k=x["seqused_k"], **kw)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("workspace", [False, True])
def test_sparse_prefill_bad_values(paged, workspace):
    rng = np.random.default_rng(4)
    x = _sparse_inputs(rng, paged)
    ws = None
    if workspace:
        n = sp.sparse_prefill_workspace_bytes(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], 1100, 700,
                                              block_table=x["block_table"], seqused_k=x["seqused_k"])
        ws = torch.empty(n, dtype=torch.uint8, device="cuda")
    ref = _sp(x, workspace=ws)
    sp.check_errors()  # valid: nothing flagged
    bad = dict(x, cu_seqlens_q=_g(np.array([0, 700, 1100], np.int32)))  # sequence 1 past the 1000 rows
    out = _sp(bad, mq=1100, workspace=ws)
    _flagged("cu_seqlens_q")
    assert torch.isnan(out[700:]).all()
    assert torch.equal(out[:700], ref[:700])
    if paged:
        bt = x["block_table"].clone()
        bt[1, 2] = -5
        out = _sp(dict(x, block_table=bt), workspace=ws)
        _flagged("block_table")
        assert torch.isnan(out[700:]).any() and not torch.isnan(out[:700]).any()
    with pytest.raises(ValueError) as e:
        _sp(bad, mq=1100, workspace=ws, options=CHECKED)
    assert _arg(e) == "cu_seqlens_q"


def test_chunked_prefill_bad_values():
    rng = np.random.default_rng(5)
    q, k, v, cu_q, cu_k = make_varlen(rng, [128, 64], [1500, 900], hq=8, hkv=2, d=128)
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, 64)
    bf = torch.bfloat16
    args = [_g(q, bf), _g(kc, bf), _g(vc, bf), _g(cu_q), _g(bt), _g(used), 128, 1500]
    means = sp.mean_cache(args[1], block_size=128)
    sp.chunked_prefill(*args, final_chunk=False, mean_cache=means, dense_fraction=1.0)
    sp.check_errors()
    bad_bt = _g(bt)
    bad_bt[0, 0] = 10**6  # the sink block: always loaded
    args[4] = bad_bt
    out = sp.chunked_prefill(*args, final_chunk=False, mean_cache=means, dense_fraction=1.0)
    _flagged("block_table")
    assert torch.isnan(out[:128]).any()
    args[4] = _g(bt)
    args[5] = _g(np.array([1500, 10**5], np.int32))
    sp.chunked_prefill(*args, final_chunk=True, mean_cache=means, dense_fraction=1.0)
    _flagged("seqused_k")
    args[5] = _g(np.array([1500, 1600], np.int32))  # within the pages but above max_seqlen_k
    sp.chunked_prefill(*args, final_chunk=True, dense_fraction=1.0)
    _flagged("max_seqlen_k")


@pytest.mark.parametrize("mutation", ["segment", "block_id"])
def test_index_view_bad_values(mutation):
    rng = np.random.default_rng(6)
    x = _sparse_inputs(rng, False)
    index = sp.build_index(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], 700, 700,
                           dense_fraction=1.0).to_host()
    h = index.host
    if mutation == "segment":
        h["segment_end"][3] = len(h["block_ids"]) + 10
        arg = "index.segment_start"
    else:
        s = int(np.nonzero(h["segment_end"] > h["segment_start"])[0][0])
        h["block_ids"][h["segment_end"][s] - 1] = 10**4
        arg = "index.block_ids"
    call = lambda **kw: sp.sparse_attention(x["q"], x["k"], x["v"], index, x["cu_seqlens_q"], x["cu_seqlens_k"],
                                            700, 700, return_lse=False, **kw)
    out = call()
    _flagged(arg)
    assert torch.isnan(out).any()
    with pytest.raises(ValueError) as e:
        call(options=CHECKED)
    assert _arg(e) == arg


def test_nan_policy_matches_the_cpu_reference():
    rng = np.random.default_rng(7)
    q, k, v, cu_q, cu_k = make_varlen(rng, [600], [600], hq=8, hkv=2, d=128)
    q[400, 3, 5] = np.nan
    k[100, 1, 7] = np.nan
    bf = torch.bfloat16
    cpu = [torch.from_numpy(a).to(bf) for a in (q, k, v)] + [torch.from_numpy(cu_q), torch.from_numpy(cu_k)]
    kw = dict(alpha=0.9, block_size=128, sink=0, window=0, last_n=0, dense_fraction=1.0, head_subgroups=1)
    ref = sp.build_index(*cpu, 600, 600, **kw)
    got = sp.build_index(*[a.cuda() for a in cpu], 600, 600, **kw).to_host()
    # NaN tiles: every tile of KV head 1 (its block 0 has a NaN key: a NaN mean every tile sees) and the tile of
    # KV head 0 holding packed row 400 * 4 + 3 (the NaN query). Both backends keep every visible block there.
    for kvh, t in [(1, t) for t in range(ref.tiles[0])] + [(0, (400 * 4 + 3) // 128)]:
        visible = list(range((min(t * 128 + 127, 600 * 4 - 1) // 4) // 128 + 1))
        assert list(ref.segment(0, kvh, t)) == visible, (kvh, t)
        assert list(got.segment(0, kvh, t)) == visible, (kvh, t)
    dense = sp.attention(*[a.cuda() for a in cpu], 600, 600, return_lse=False)
    out = sp.sparse_prefill(*[a.cuda() for a in cpu], 600, 600, **kw)
    assert torch.equal(torch.isnan(dense), torch.isnan(out))


def test_cuda_graph_capture_with_bad_values():
    """The default path stays free of host syncs: capture succeeds, and a replay over a bad seqused_k is flagged."""
    rng = np.random.default_rng(8)
    q, kc, vc, cu_q, bt, used = _paged_case(rng, 64, 500, 64)
    out = torch.empty_like(q)
    ws = torch.empty(sp.attention_workspace_bytes(128), dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        sp.attention(q, kc, vc, cu_q, None, 64, 500, block_table=bt, seqused_k=used, out=out, workspace=ws,
                     return_lse=False, stream=s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        sp.attention(q, kc, vc, cu_q, None, 64, 500, block_table=bt, seqused_k=used, out=out, workspace=ws,
                     return_lse=False, stream=s)
    g.replay()
    torch.cuda.synchronize()
    sp.check_errors()
    assert not torch.isnan(out).any()
    used.fill_(10**5)  # the captured graph reads the new (bad) value on the device
    g.replay()
    torch.cuda.synchronize()
    _flagged("seqused_k")
    assert torch.isnan(out).all()

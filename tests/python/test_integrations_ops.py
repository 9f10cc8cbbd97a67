"""The engine adapters' one path into the library: VarlenDispatch runs its dense, sparse and chunked calls through the
torch operators (sparse_prefill.torch_ops), never the generic sp.* functions, keeps no workspace of its own, and so
follows the operators' workspace rule: on CUDA its calls allocate nothing outside torch and can be captured in a
torch.cuda.CUDAGraph (the GPU tests below; they skip without a GPU and a CUDA build)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparse_prefill as sp  # noqa: E402
import sparse_prefill.torch_ops as spt  # noqa: E402
from conftest import to_paged, topic_batch  # noqa: E402
from sparse_prefill.integrations import MeanCacheTracker, SparsePrefillConfig, VarlenDispatch  # noqa: E402
from sparse_prefill.integrations import core  # noqa: E402

_HAS_CUDA = torch.cuda.is_available() and sp.with_cuda
needs_cuda = pytest.mark.skipif(not _HAS_CUDA, reason="needs a GPU and a CUDA build")

Q_LENS = [37, 130]                  # two sequences, one shorter than a tile, one crossing a block boundary
CACHE_LENS = [37 + 300, 130 + 520]  # chunked: each chunk is the last Q_LENS[b] positions of its cache
HQ, HKV, D, PAGE = 4, 2, 128, 128   # D, pages and blocks of 128: what the CUDA sparse kernels and the tracker take


def _config():
    # every call of these shapes runs sparse unless forced dense; a pruning selection (final_chunk matters)
    return SparsePrefillConfig.load(environ={}, min_sparse_q_len=1, min_sparse_kv_len=0, alpha=0.5, sink=0,
                                    window=0, dense_fraction=1.0, final_chunk="never")


def _t(a, device, dtype=None):
    t = torch.from_numpy(np.ascontiguousarray(a))
    return (t if dtype is None else t.to(dtype)).to(device)


def _problems(device):
    """(contiguous prefill args, paged chunk args, paged dense-decode-like args) as VarlenDispatch takes them."""
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, cu_q, cu_k = topic_batch(Q_LENS, Q_LENS, hq=HQ, hkv=HKV, d=D, seed=1)
    prefill = ((_t(q, device, dt), _t(k, device, dt), _t(v, device, dt), _t(cu_q, device), _t(cu_k, device),
                max(Q_LENS), max(Q_LENS)), {})
    q, k, v, cu_q, cu_k = topic_batch(Q_LENS, CACHE_LENS, hq=HQ, hkv=HKV, d=D, seed=2)
    kc, vc, bt, used = to_paged(np.random.default_rng(5), k, v, cu_k, PAGE)
    chunk = ((_t(q, device, dt), _t(kc, device, dt), _t(vc, device, dt), _t(cu_q, device), None, max(Q_LENS),
              max(CACHE_LENS)), {"block_table": _t(bt, device), "seqused_k": _t(used, device)})
    return prefill, chunk


def _calls(device):
    """name -> (run(dispatch, out), inputs to refill, the path it takes)."""
    prefill, (chunk, chunk_kw) = _problems(device)
    tracker = MeanCacheTracker(block_size=128)
    means = tracker.get("layer0", chunk[1])
    assert means is not None
    # as the earlier steps leave it: the step run once (it reads only the blocks before its chunk: idempotent)
    sp.chunked_prefill(*chunk[:4], chunk_kw["block_table"], chunk_kw["seqused_k"], *chunk[5:], final_chunk=False,
                       mean_cache=means, block_size=128)

    def run_chunk(disp, out):
        return disp(*chunk, out=out, mean_cache=means, **chunk_kw)

    return {
        "sparse_prefill": (lambda disp, out: disp(*prefill[0], out=out), list(prefill[0][:3]), "sparse"),
        "chunked_prefill": (run_chunk, list(chunk[:3]), "sparse"),
        "dense_paged": (lambda disp, out: disp(*chunk, out=out, force_dense=True, **chunk_kw), list(chunk[:3]),
                        "dense"),
    }


_NAMES = ["sparse_prefill", "chunked_prefill", "dense_paged"]
# torch_ops' handles of the registered operators (what its wrappers call) -> the operator's name
_OP_ATTRS = {"_attention_op": "attention", "_attention_out_op": "attention_out", "_sparse_op": "sparse_prefill",
             "_sparse_out_op": "sparse_prefill_out", "_chunked_op": "chunked_prefill",
             "_chunked_out_op": "chunked_prefill_out"}


@pytest.mark.parametrize("name", _NAMES)
def test_dispatch_calls_the_operators_not_the_generic_functions(monkeypatch, name):
    """Every call of the dispatch reaches a torch.ops.sparse_prefill operator (the `_out` form: the engine's output is
    written in place) and none of sp.attention / sp.sparse_prefill / sp.chunked_prefill; the result equals the
    public function's."""
    run, refill, path = _calls("cpu")[name]
    for fn in ("attention", "sparse_prefill", "chunked_prefill"):
        monkeypatch.setattr(sp, fn, lambda *a, _fn=fn, **k: pytest.fail(f"the adapter called sp.{_fn}"))
    reached = []
    for attr, op_name in _OP_ATTRS.items():
        def spy(*a, _op=spt.OPS[op_name], _name=op_name, **k):
            reached.append(_name)
            return _op(*a, **k)
        monkeypatch.setattr(spt, attr, spy)
    disp = VarlenDispatch(_config())
    out = torch.full_like(refill[0], float("nan"))
    assert run(disp, out) is out
    monkeypatch.undo()
    assert disp.last_path == path
    want = {"sparse_prefill": ["sparse_prefill_out"], "chunked_prefill": ["chunked_prefill_out"],
            "dense_paged": ["attention_out"]}[name]
    assert reached == want
    # the same call through the public functions (a fresh tracker state: the chunk's means are rewritten the same)
    ref = torch.full_like(out, float("nan"))
    run(_PublicDispatch(_config()), ref)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


class _PublicDispatch(VarlenDispatch):
    """The dispatch with the operators' wrappers replaced by the public functions of the same names (the reference
    above: the two paths must give the same bits)."""

    def __call__(self, *args, **kwargs):
        saved = core.spt
        core.spt = _Public()
        try:
            return super().__call__(*args, **kwargs)
        finally:
            core.spt = saved


class _Public:
    attention = staticmethod(sp.attention)
    sparse_prefill = staticmethod(sp.sparse_prefill)
    chunked_prefill = staticmethod(sp.chunked_prefill)


def test_dispatch_keeps_no_buffer():
    """The dispatch holds no tensor after its calls: its scratch memory is the operators' (torch's caching
    allocator, per call), not a buffer of its own."""
    disp = VarlenDispatch(_config())
    for name, (run, refill, _) in _calls("cpu").items():
        run(disp, torch.empty_like(refill[0]))

    def tensors(x, depth=0):
        if isinstance(x, torch.Tensor):
            return 1
        if depth > 3:
            return 0
        if isinstance(x, dict):
            return sum(tensors(v, depth + 1) for v in x.values())
        if isinstance(x, (list, tuple, set)):
            return sum(tensors(v, depth + 1) for v in x)
        return 0
    assert tensors(vars(disp)) == 0
    assert not hasattr(disp, "reserve_sparse")


# ---------------------------------------------------------------------------------------------------------------------
# CUDA: the adapters' calls captured in a CUDA graph, and no allocation outside torch
# ---------------------------------------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", _NAMES)
def test_cuda_graph_replay_of_the_dispatch_equals_eager(name):
    """An engine capturing its step: the dispatch's call captured once in a torch.cuda.CUDAGraph (its workspace
    from the graph's pool), replayed on new input values of the same shapes, equals the eager call bit for bit."""
    run, refill, path = _calls("cuda")[name]
    disp = VarlenDispatch(_config())
    out = torch.empty_like(refill[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run(disp, out)  # warm-up outside the capture (support answer and workspace sizes cached)
    torch.cuda.current_stream().wait_stream(side)
    assert disp.last_path == path, disp.last_reason
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(disp, out)
    gen = torch.Generator(device="cuda").manual_seed(7)
    eager = VarlenDispatch(_config())
    for _ in range(2):
        for t in refill:
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float32).to(t.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.full_like(out, float("nan"))
        run(eager, ref)
        torch.cuda.synchronize()
        assert eager.last_path == path
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", _NAMES)
def test_cuda_dispatch_allocates_nothing_outside_torch(name):
    """Eager: the device's stream-ordered pool is untouched during the dispatch's call; captured: the graph holds no
    memory-allocation node (test_torch_ops.py's checks, on the adapter's call)."""
    from test_torch_ops import _PoolWatch, _alloc_nodes, _instantiate, _keep_graph, _native_allocator
    _native_allocator()
    run, refill, path = _calls("cuda")[name]
    disp = VarlenDispatch(_config())
    out = torch.empty_like(refill[0])
    run(disp, out)
    assert disp.last_path == path, disp.last_reason
    with _PoolWatch() as w:
        run(disp, out)
    assert w.peak == 0, f"the call took {w.peak} bytes from the stream-ordered pool"
    graph = _keep_graph()
    with torch.cuda.graph(graph):
        run(disp, out)
    assert _alloc_nodes(graph) == 0, "the captured call holds a stream-ordered allocation (cudaMallocAsync)"
    _instantiate(graph)
    graph.replay()
    torch.cuda.synchronize()

"""torch.library operators (sparse_prefill.torch_ops): opcheck, equality with the eager public functions, out=,
torch.compile(fullgraph=True), and on CUDA graph capture/replay and the no-allocation-outside-torch rule.

Every test runs on the CPU (reference backend, float32) and on CUDA (bf16; skipped without a GPU or a CUDA build).
The sparse operators use D = 128, pages of 64 tokens and block_size 128 everywhere (what the CUDA sparse path
takes)."""

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparse_prefill as sp  # noqa: E402
import sparse_prefill.torch_ops as spt  # noqa: E402
from conftest import make_varlen, to_paged, topic_batch  # noqa: E402

_HAS_CUDA = torch.cuda.is_available() and sp.with_cuda
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _HAS_CUDA, reason="needs a GPU and a CUDA build"))]

Q_LENS = [37, 130]           # two sequences, one shorter than a tile, one crossing a block boundary
CACHE_LENS = [37 + 300, 130 + 520]  # chunked prefill: the chunk is the last Q_LENS[b] positions of each cache
HQ, HKV = 4, 2
PAGE = 64


def _dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def _t(a, device, dtype=None):
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype is not None:
        t = t.to(dtype)
    return t.to(device)


def _equal(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------------------------------
# Problems: positional argument tuples of the operators (with kwargs of the wrappers)
# ---------------------------------------------------------------------------------------------------------------------

def dense_problem(device, d=128, kind="prefill"):
    """(args of sp.attention, kwargs): kind 'prefill' (q = k lengths), 'chunk' (short queries against longer keys: on
    CUDA with D = 128 the split path that needs the workspace) or 'paged' (chunk shape over a paged cache)."""
    rng = np.random.default_rng(3)
    k_lens = Q_LENS if kind == "prefill" else CACHE_LENS
    q, k, v, cu_q, cu_k = make_varlen(rng, Q_LENS, k_lens, hq=HQ, hkv=HKV, d=d)
    dt = _dtype(device)
    if kind == "paged":
        kc, vc, bt, used = to_paged(rng, k, v, cu_k, PAGE)
        args = (_t(q, device, dt), _t(kc, device, dt), _t(vc, device, dt), _t(cu_q, device), None, max(Q_LENS),
                max(k_lens))
        return args, {"block_table": _t(bt, device), "seqused_k": _t(used, device)}
    return (_t(q, device, dt), _t(k, device, dt), _t(v, device, dt), _t(cu_q, device), _t(cu_k, device),
            max(Q_LENS), max(k_lens)), {}


def sparse_problem(device):
    """Selective (topic) sequences, contiguous for the CPU, paged (page 64) on CUDA; queries = keys (prefill)."""
    q, k, v, cu_q, cu_k = topic_batch(Q_LENS, Q_LENS, hq=HQ, hkv=HKV, d=128, seed=1)
    dt = _dtype(device)
    if device == "cpu":
        return (_t(q, device, dt), _t(k, device, dt), _t(v, device, dt), _t(cu_q, device), _t(cu_k, device),
                max(Q_LENS), max(Q_LENS)), {"block_size": 128}
    kc, vc, bt, used = to_paged(np.random.default_rng(4), k, v, cu_k, PAGE)
    return (_t(q, device, dt), _t(kc, device, dt), _t(vc, device, dt), _t(cu_q, device), None, max(Q_LENS),
            max(Q_LENS)), {"block_size": 128, "block_table": _t(bt, device), "seqused_k": _t(used, device)}


def chunk_problem(device):
    """One chunked-prefill step: chunks of Q_LENS queries at the end of caches of CACHE_LENS tokens (page 64)."""
    q, k, v, cu_q, cu_k = topic_batch(Q_LENS, CACHE_LENS, hq=HQ, hkv=HKV, d=128, seed=2)
    kc, vc, bt, used = to_paged(np.random.default_rng(5), k, v, cu_k, PAGE)
    dt = _dtype(device)
    return (_t(q, device, dt), _t(kc, device, dt), _t(vc, device, dt), _t(cu_q, device), _t(bt, device),
            _t(used, device), max(Q_LENS), max(CACHE_LENS))


def _zero_means(kc):
    return sp.mean_cache(kc, block_size=128)


def _prefilled_means(args, **kw):
    """A mean cache filled as earlier steps would leave it: the public step run once (its writes are the blocks the
    chunk completes; it reads only blocks before the chunk, so running the step again is idempotent)."""
    means = _zero_means(args[1])
    sp.chunked_prefill(*args, final_chunk=kw.pop("final_chunk", False), mean_cache=means, **kw)
    return means


# ---------------------------------------------------------------------------------------------------------------------
# Import and registration
# ---------------------------------------------------------------------------------------------------------------------

def test_import_sparse_prefill_does_not_import_torch():
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(sp.__file__)))
    code = ("import sys, sparse_prefill; assert 'torch' not in sys.modules, 'torch imported'; "
            "import sparse_prefill.torch_ops, torch; print(torch.ops.sparse_prefill.chunked_prefill.default)")
    env = dict(os.environ, PYTHONPATH=pkg + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "sparse_prefill.chunked_prefill" in r.stdout



_EXIT_SCRIPT = """
import sys
import torch
import sparse_prefill as sp
import sparse_prefill.torch_ops as spt

dev = sys.argv[1]
dt = torch.float32 if dev == "cpu" else torch.bfloat16
L, C, HQ, HKV, D, PAGE = 512, 128, 4, 2, 128, 64
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(L, h, D, generator=g).to(dev, dt) for h in (HQ, HKV, HKV))
cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
kc, vc = k.reshape(L // PAGE, PAGE, HKV, D), v.reshape(L // PAGE, PAGE, HKV, D)
bt = torch.arange(L // PAGE, dtype=torch.int32, device=dev).reshape(1, -1)
qc, cuq = q[L - C:].contiguous(), torch.tensor([0, C], dtype=torch.int32, device=dev)
su = torch.tensor([L], dtype=torch.int32, device=dev)
paged = (qc, kc, vc, cuq, bt, su, C, L)
sp.sparse_prefill(q, k, v, cu, cu, L, L, alpha=0.05)
sp.sparse_prefill(q, k, v, cu, cu, L, L, selection=sp.Selection(alpha=0.02))
sp.chunked_prefill(*paged, final_chunk=False)
sp.chunked_prefill(*paged, final_chunk=True, alpha=0.06)
spt.sparse_prefill(q, k, v, cu, cu, L, L, alpha=0.03)
spt.chunked_prefill(*paged, final_chunk=False)
spt.chunked_prefill(*paged, final_chunk=False, selection=sp.Selection(rule="tile_energy"))
torch.ops.sparse_prefill.chunked_prefill(*paged, False, alpha=0.07)
print("calls done")
"""


@pytest.mark.parametrize("device", DEVICES)
def test_exit_leaves_no_extension_object(device):
    """A process that calls the operators and the public functions with selections and exits frees every _C object
    before nanobind's leak check, which prints "nanobind: leaked N instances" at exit otherwise. torch's dispatcher
    keeps the registered kernels, and so torch_ops' globals (its Selection caches; through _selection, the module's
    _PARAMS and default Selection), past the interpreter's teardown unless the module stays alive for it to wipe."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(sp.__file__)))
    env = dict(os.environ, PYTHONPATH=pkg + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, device], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "calls done" in r.stdout
    assert "nanobind: leaked" not in r.stderr, r.stderr

def test_operators_registered():
    for name in ("attention", "attention_out", "sparse_prefill", "sparse_prefill_out", "chunked_prefill",
                 "chunked_prefill_out"):
        op = getattr(torch.ops.sparse_prefill, name).default
        assert spt.OPS[name] is op
        assert torch.Tag.pt2_compliant_tag in op.tags
    mutated = {a.name for a in torch.ops.sparse_prefill.chunked_prefill_out.default._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
    assert mutated == {"out", "mean_k", "mean_v"}


def test_kernel_and_fake_defaults_match_the_schema():
    """The dispatcher leaves out trailing arguments equal to their defaults when it calls a Python kernel: every
    kernel and fake implementation must default them to the schema's values. The selection's fields are the schemas'
    keyword-only arguments, the library's table exactly (chunked: final_chunk is the step's positional one), at its
    defaults (a kernel takes them as **fields and resolves the ones left out through sp.Selection's defaults)."""
    import inspect
    D = sp.Selection().as_dict()  # every field at its default
    for name, (_, kernel, fake) in spt._SCHEMAS.items():
        schema = spt.OPS[name]._schema
        positional = [a for a in schema.arguments if not a.kwarg_only]
        selection = {a.name: a for a in schema.arguments if a.kwarg_only}
        if "sparse" in name or "chunked" in name:
            assert set(selection) == set(D) - ({"final_chunk"} if "chunked" in name else set()), name
            for key, a in selection.items():
                want = (sp._api._as_rule(D[key]) if key == "rule" else -1 if key == "max_kept_blocks" else D[key])
                assert a.default_value == pytest.approx(want, abs=1e-7), (name, key)
        else:
            assert not selection, name
        for fn in (kernel, fake):
            params = inspect.signature(fn).parameters
            named = [p for p in params.values() if p.kind is not p.VAR_KEYWORD]
            assert [p.name for p in named] == [a.name for a in positional], (name, fn.__name__)
            assert any(p.kind is p.VAR_KEYWORD for p in params.values()) == bool(selection), (name, fn.__name__)
            for a in positional:
                p = params[a.name]
                if a.has_default_value():
                    want = a.default_value
                    got = list(p.default) if isinstance(p.default, tuple) else p.default
                    assert got == want, (name, fn.__name__, a.name, got, want)
                else:
                    assert p.default is inspect.Parameter.empty, (name, fn.__name__, a.name)


# ---------------------------------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------------------------------

def _opcheck(op, args, kwargs=None):
    torch.library.opcheck(op, args, kwargs or {})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["prefill", "chunk", "paged"])
def test_opcheck_attention(device, d, kind):
    args, kw = dense_problem(device, d, kind)
    _opcheck(spt.OPS["attention"], args, dict(kw, return_lse=True))
    _opcheck(spt.OPS["attention"], args, dict(kw, window=[16, 0], softmax_scale=0.1) if kind == "prefill" else kw)
    _opcheck(spt.OPS["attention_out"], args + (torch.empty_like(args[0]),), dict(kw, return_lse=True))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_sparse_prefill(device):
    args, kw = sparse_problem(device)
    _opcheck(spt.OPS["sparse_prefill"], args, dict(kw, return_lse=True))
    _opcheck(spt.OPS["sparse_prefill"], args, dict(kw, alpha=0.3, correction=False))
    _opcheck(spt.OPS["sparse_prefill_out"], args + (torch.empty_like(args[0]),), dict(kw, return_lse=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("union", [False, True])
def test_opcheck_chunked_prefill(device, union):
    args = chunk_problem(device)
    _opcheck(spt.OPS["chunked_prefill"], args, {"final_chunk": False, "union": union, "return_lse": True})
    _opcheck(spt.OPS["chunked_prefill"], args, {"final_chunk": True, "union": union})
    mk, mv = _prefilled_means(args, union=union)
    _opcheck(spt.OPS["chunked_prefill"], args, {"final_chunk": False, "union": union, "mean_k": mk, "mean_v": mv})
    _opcheck(spt.OPS["chunked_prefill_out"], args + (torch.empty_like(args[0]),),
             {"final_chunk": False, "union": union, "mean_k": mk, "mean_v": mv, "return_lse": True})


# ---------------------------------------------------------------------------------------------------------------------
# Equal to the eager public functions; out=
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["prefill", "chunk", "paged"])
def test_attention_equals_public(device, d, kind):
    args, kw = dense_problem(device, d, kind)
    ref, ref_lse = sp.attention(*args, return_lse=True, **kw)
    out, lse = spt.attention(*args, return_lse=True, **kw)
    _equal(out, ref)
    _equal(lse, ref_lse)
    assert out.dtype == args[0].dtype and lse.dtype == torch.float32 and lse.shape == (HQ, args[0].shape[0])
    _equal(spt.attention(*args, **kw), ref)
    buf = torch.full_like(args[0], float("nan"))
    got = spt.attention(*args, out=buf, **kw)
    assert got is buf
    _equal(buf, ref)
    buf.fill_(float("nan"))
    got, lse2 = spt.attention(*args, out=buf, return_lse=True, **kw)
    assert got is buf
    _equal(buf, ref)
    _equal(lse2, ref_lse)
    if kind == "prefill":
        ref_w = sp.attention(*args, window=(16, 0), softmax_scale=0.1, causal=False, **kw)
        _equal(spt.attention(*args, window=(16, 0), softmax_scale=0.1, causal=False, **kw), ref_w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opts", [{}, {"alpha": 0.3, "correction": False}, {"sink": 0, "window": 128, "last_n": 0},
                                  {"rule": "probe_row_max", "alpha": 0.2, "mean_alpha": 0.9, "sink": 0, "last_n": 0},
                                  {"rule": "key_max", "alpha": 0.5, "key_rank": 32, "sink": 0, "last_n": 0}])
def test_sparse_prefill_equals_public(device, opts):
    args, kw = sparse_problem(device)
    kw = dict(kw, **opts)
    ref, ref_lse = sp.sparse_prefill(*args, return_lse=True, **kw)
    out, lse = spt.sparse_prefill(*args, return_lse=True, **kw)
    _equal(out, ref)
    _equal(lse, ref_lse)
    buf = torch.full_like(args[0], float("nan"))
    assert spt.sparse_prefill(*args, out=buf, **kw) is buf
    _equal(buf, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("union", [False, True])
@pytest.mark.parametrize("final_chunk", [False, True])
def test_chunked_prefill_equals_public(device, union, final_chunk):
    args = chunk_problem(device)
    kw = {"final_chunk": final_chunk, "union": union}
    ref, ref_lse = sp.chunked_prefill(*args, return_lse=True, **kw)
    out, lse = spt.chunked_prefill(*args, return_lse=True, **kw)
    _equal(out, ref)
    _equal(lse, ref_lse)
    # with a mean cache: the same writes as the public step, from the same state
    m_ref = _zero_means(args[1])
    m_op = _zero_means(args[1])
    ref = sp.chunked_prefill(*args, mean_cache=m_ref, **kw)
    buf = torch.full_like(args[0], float("nan"))
    assert spt.chunked_prefill(*args, mean_cache=m_op, out=buf, **kw) is buf
    _equal(buf, ref)
    _equal(m_op[0], m_ref[0])
    _equal(m_op[1], m_ref[1])
    assert m_op[0].abs().sum() > 0  # the step wrote the blocks its chunk completes


@pytest.mark.parametrize("device", DEVICES)
def test_mean_cache_block_size_reaches_the_library(device):
    """A MeanCache remembers the block size it was made for; the wrappers pass it to the operators
    (mean_block_size), so a step selecting with another block size raises the library's error naming mean_cache, as
    sp.chunked_prefill does (the operators took the two tensors only, and such a step went through whenever the slot
    counts agreed)."""
    args = chunk_problem(device)
    means = sp.mean_cache(args[1], block_size=256)
    with pytest.raises(ValueError) as ref:
        sp.chunked_prefill(*args, final_chunk=False, mean_cache=means, block_size=128)
    assert str(ref.value).startswith("mean_cache")
    with pytest.raises(ValueError) as got:
        spt.chunked_prefill(*args, final_chunk=False, mean_cache=means, block_size=128)
    assert str(got.value) == str(ref.value)
    with pytest.raises(ValueError) as got:
        spt.OPS["chunked_prefill"](*args, False, mean_k=means[0], mean_v=means[1], mean_block_size=256)
    assert str(got.value) == str(ref.value)
    # a plain pair (an engine's own tensors, e.g. MeanCacheTracker's) carries no block size: 0, not checked
    ref = sp.chunked_prefill(*args, final_chunk=False, mean_cache=tuple(_zero_means(args[1])))
    _equal(spt.chunked_prefill(*args, final_chunk=False, mean_cache=tuple(_zero_means(args[1]))), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_wrappers_take_selection_as_the_public_functions(device):
    """selection= or the selection keywords, not both, as sp.sparse_prefill / sp.chunked_prefill take them; the
    operator's keyword-only fields reach the same selection (rule by its int, max_kept_blocks -1 for None)."""
    args, kw = sparse_problem(device)
    tensors = {k: v for k, v in kw.items() if k in ("block_table", "seqused_k")}
    sel = sp.Selection(alpha=0.3, block_size=128, sink=0, rule="key_max", max_kept_blocks=4096)
    ref = sp.sparse_prefill(*args, selection=sel, **tensors)
    _equal(spt.sparse_prefill(*args, selection=sel, **tensors), ref)
    _equal(spt.sparse_prefill(*args, **sel.as_dict(), **tensors), ref)
    out, _ = spt.OPS["sparse_prefill"](*args, rule=4, alpha=0.3, sink=0, max_kept_blocks=4096, **tensors)
    _equal(out, ref)
    with pytest.raises(ValueError, match="^alpha: given both"):
        spt.sparse_prefill(*args, selection=sel, alpha=0.3, **tensors)
    with pytest.raises(TypeError, match="^alpah: unexpected keyword"):
        spt.sparse_prefill(*args, alpah=0.3, **tensors)
    with pytest.raises(ValueError, match="^rule: must be one of 0"):
        spt.OPS["sparse_prefill"](*args, rule=9, **tensors)
    # chunked: the step's final_chunk wins over the Selection's, as in sp.chunked_prefill
    cargs = chunk_problem(device)
    pruning = dict(alpha=0.5, sink=0, window=0, dense_fraction=1.0)  # final_chunk then changes the blocks kept
    csel = sp.Selection(final_chunk=False, **pruning)
    ref = sp.chunked_prefill(*cargs, final_chunk=True, **pruning)
    _equal(sp.chunked_prefill(*cargs, final_chunk=True, selection=csel), ref)
    _equal(spt.chunked_prefill(*cargs, final_chunk=True, selection=csel), ref)
    assert not torch.equal(spt.chunked_prefill(*cargs, final_chunk=False, selection=csel), ref)  # it matters here


def test_one_selection_cache():
    """The operators' selection arguments and the functions' keywords reach Selections through one cache
    (_selection._SELECTIONS): the operator's kernel finds the Selection a wrapper's keywords made there, and a
    Selection's operator arguments are made once and kept on it. torch_ops keeps no dict of its own."""
    from sparse_prefill import _selection
    args, kw = sparse_problem("cpu")
    _selection._SELECTIONS.clear()
    spt.sparse_prefill(*args, alpha=0.37, **kw)
    by_keywords = {k: s for k, s in _selection._SELECTIONS.items() if isinstance(k, tuple)}
    by_op = {k: s for k, s in _selection._SELECTIONS.items() if isinstance(k, frozenset)}
    assert len(by_keywords) == 1 and len(by_op) == 1
    (sel,), (op_sel,) = by_keywords.values(), by_op.values()
    assert sel == op_sel and sel.alpha == 0.37 and sel.block_size == 128
    assert _selection._op_fields(sel) is _selection._op_fields(sel) == {"alpha": 0.37}
    spt.sparse_prefill(*args, alpha=0.37, **kw)       # the same selection again: no new entry
    assert len(_selection._SELECTIONS) == 2
    assert not [n for n, v in vars(spt).items() if isinstance(v, dict) and v and n != "OPS" and
                any(isinstance(x, sp.Selection) for x in v.values())]


@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_argument(device):
    args, kw = dense_problem(device, 64)
    with pytest.raises(ValueError, match="^max_seqlen_q") as e:
        spt.attention(*args[:5], -1, args[6])
    assert e.value.argument == "max_seqlen_q"
    with pytest.raises(ValueError, match="^window"):
        spt.attention(*args, window=(1, 2, 3))
    with pytest.raises(TypeError, match="^out: must not require grad"):
        spt.attention(*args, out=torch.empty_like(args[0]).requires_grad_(args[0].dtype.is_floating_point))
    sargs, skw = sparse_problem(device)
    with pytest.raises(ValueError, match="^head_subgroups"):
        spt.sparse_prefill(*sargs, head_subgroups=-1, **skw)
    with pytest.raises(ValueError, match="^dense_fraction"):
        spt.sparse_prefill(*sargs, dense_fraction=1.5, **skw)
    with pytest.raises(ValueError, match="^block_size"):
        spt.sparse_prefill(*sargs, **dict(skw, block_size=100))
    cargs = chunk_problem(device)
    with pytest.raises(TypeError, match="^mean_cache"):
        spt.chunked_prefill(*cargs, final_chunk=False, mean_cache=cargs[1])
    if device == "cpu":
        with pytest.raises(ValueError, match="^seqused_k: sequence 1 holds"):
            spt.chunked_prefill(*cargs[:5], torch.tensor([300, 100], dtype=torch.int32), *cargs[6:],
                                final_chunk=False)
        with pytest.raises(ValueError, match="^max_seqlen_k"):
            spt.chunked_prefill(*cargs[:7], 10, final_chunk=False)


# ---------------------------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ---------------------------------------------------------------------------------------------------------------------

def _compile(fn, device):
    import torch._dynamo
    torch._dynamo.reset()
    # CPU: aot_eager (dynamo + AOT functionalisation of the mutated arguments, without compiling C++ kernels);
    # CUDA: the default inductor backend.
    return torch.compile(fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_equals_eager(device):
    dargs, dkw = dense_problem(device, 128, "paged")
    sargs, skw = sparse_problem(device)
    cargs = chunk_problem(device)

    def step(dargs, sargs, cargs, means):
        q = dargs[0] * 2
        o1, lse = spt.attention(q, *dargs[1:], return_lse=True, **dkw)
        o2 = spt.sparse_prefill(*sargs, **skw)
        buf = torch.empty_like(cargs[0])
        spt.chunked_prefill(*cargs, final_chunk=False, out=buf, mean_cache=means)
        o4, lse4 = spt.chunked_prefill(*cargs, final_chunk=True, union=True, return_lse=True)
        return o1.float() + 1, lse, o2, buf, o4, lse4

    m_eager, m_comp = _zero_means(cargs[1]), _zero_means(cargs[1])
    ref = step(dargs, sargs, cargs, m_eager)
    got = _compile(step, device)(dargs, sargs, cargs, m_comp)
    for a, b in zip(got, ref):
        _equal(a, b)
    _equal(m_comp[0], m_eager[0])
    _equal(m_comp[1], m_eager[1])
    # the public functions agree too (the ops are the same computation)
    _equal(ref[4], sp.chunked_prefill(*cargs, final_chunk=True, union=True))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic_shapes(device):
    """A compiled function over two batches of other lengths (dynamic=True): the fake implementations' shapes are
    symbolic."""
    import torch._dynamo
    torch._dynamo.reset()
    # aot_eager on both devices: what is tested is tracing with symbolic shapes (inductor's code generation is covered
    # by test_compile_fullgraph_equals_eager and would add minutes to the GPU suite)
    fn = torch.compile(lambda *a: spt.attention(*a, return_lse=True), fullgraph=True, dynamic=True,
                       backend="aot_eager")
    rng = np.random.default_rng(8)
    for q_lens in ([37, 130], [5, 64, 99]):
        q, k, v, cu_q, cu_k = make_varlen(rng, q_lens, q_lens, hq=HQ, hkv=HKV, d=64)
        dt = _dtype(device)
        args = (_t(q, device, dt), _t(k, device, dt), _t(v, device, dt), _t(cu_q, device), _t(cu_k, device),
                max(q_lens), max(q_lens))
        out, lse = fn(*args)
        ref, ref_lse = sp.attention(*args, return_lse=True)
        _equal(out, ref)
        _equal(lse, ref_lse)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_growing_max_seqlen_k_does_not_recompile_each_step(device):
    """An engine's chunked steps pass a new max_seqlen_k (the cache length) every step: the operators take it as a
    SymInt, so after dynamo's first recompile (which makes the int dynamic) further values reuse the graph."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    args = chunk_problem(device)
    counter = CompileCounter()  # dynamo frames only (eager backend): recompiles are what is counted
    fn = torch.compile(lambda *a: spt.chunked_prefill(*a, final_chunk=False), fullgraph=True, backend=counter)
    for extra in (0, 7, 64, 300):  # larger bounds than the caches are valid
        _equal(fn(*args[:7], args[7] + extra), sp.chunked_prefill(*args[:7], args[7] + extra, final_chunk=False))
    assert counter.frame_count <= 2  # with an `int` schema: one per value (4)


# ---------------------------------------------------------------------------------------------------------------------
# CUDA: graph capture and replay; no allocation outside torch
# ---------------------------------------------------------------------------------------------------------------------

_CU_GRAPH_NODE_TYPE_MEM_ALLOC = 10
_CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8
_CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("libcuda.so.1 not found")


def _check(rc, what):
    assert rc == 0, f"{what} failed with CUresult {rc}"


def _alloc_nodes(graph) -> int:
    """Stream-ordered allocations (cudaMallocAsync) recorded in a captured graph: its memory-allocation nodes."""
    cu = _libcuda()
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    _check(cu.cuGraphGetNodes(handle, None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * max(n.value, 1))()
    _check(cu.cuGraphGetNodes(handle, nodes, ctypes.byref(n)), "cuGraphGetNodes")
    kinds = []
    for i in range(n.value):
        t = ctypes.c_int(-1)
        _check(cu.cuGraphNodeGetType(ctypes.c_void_p(nodes[i]), ctypes.byref(t)), "cuGraphNodeGetType")
        kinds.append(t.value)
    assert n.value > 0
    return sum(1 for t in kinds if t == _CU_GRAPH_NODE_TYPE_MEM_ALLOC)


class _PoolWatch:
    """Peak use of the device's current stream-ordered memory pool (where cudaMallocAsync takes memory) during a
    block. torch's native caching allocator does not use it, so any use is the library's own allocation."""

    def __init__(self):
        self.cu = _libcuda()
        dev = ctypes.c_int(0)
        _check(self.cu.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()), "cuDeviceGet")
        self.pool = ctypes.c_void_p()
        _check(self.cu.cuDeviceGetMemPool(ctypes.byref(self.pool), dev), "cuDeviceGetMemPool")

    def _get(self, attr):
        v = ctypes.c_uint64(0)
        _check(self.cu.cuMemPoolGetAttribute(self.pool, attr, ctypes.byref(v)), "cuMemPoolGetAttribute")
        return v.value

    def __enter__(self):
        torch.cuda.synchronize()
        zero = ctypes.c_uint64(0)  # resets the high watermark to the current use
        _check(self.cu.cuMemPoolSetAttribute(self.pool, _CU_MEMPOOL_ATTR_USED_MEM_HIGH, ctypes.byref(zero)),
               "cuMemPoolSetAttribute")
        self.before = self._get(_CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.peak = self._get(_CU_MEMPOOL_ATTR_USED_MEM_HIGH) - self.before
        return False


def _native_allocator():
    if torch.cuda.get_allocator_backend() != "native":
        pytest.skip("torch's allocator backend is not 'native' (cudaMallocAsync would share the pool)")


def _keep_graph():
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        pytest.skip("this torch has no CUDAGraph(keep_graph=True) to inspect the captured graph")


def _instantiate(graph):
    if hasattr(graph, "instantiate"):  # keep_graph=True: instantiated here (or by the first replay)
        graph.instantiate()


def _cases():
    """(name, make(device) -> (run_op, run_public, inputs to refill, uses_sparse_workspace))."""
    def dense(kind):
        def make(device):
            args, kw = dense_problem(device, 128, kind)
            return (lambda out: spt.attention(*args, out=out, **kw), lambda: sp.attention(*args, **kw),
                    [args[0], args[1], args[2]], False)
        return make

    def sparse(device):
        args, kw = sparse_problem(device)
        return (lambda out: spt.sparse_prefill(*args, out=out, **kw), lambda: sp.sparse_prefill(*args, **kw),
                [args[0], args[1], args[2]], True)

    def chunked(device):
        args = chunk_problem(device)
        return (lambda out: spt.chunked_prefill(*args, final_chunk=False, out=out),
                lambda: sp.chunked_prefill(*args, final_chunk=False), [args[0], args[1], args[2]], True)

    return [("attention_chunk", dense("chunk")), ("attention_paged", dense("paged")),
            ("attention_prefill", dense("prefill")), ("sparse_prefill", sparse), ("chunked_prefill", chunked)]


_CASES = _cases()
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a GPU and a CUDA build")
@pytest.mark.parametrize("name,make", _CASES, ids=[c[0] for c in _CASES])
def test_cuda_graph_replay_equals_eager(name, make):
    run_op, run_public, refill, _ = make("cuda")
    out = torch.empty_like(refill[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run_op(out)  # warm-up outside the capture (workspace sizes cached, kernels loaded)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_op(out)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(2):  # new input values, same shapes: the replay reads them
        for t in refill:
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float32).to(t.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _equal(out, run_public())


@pytest.mark.skipif(not _HAS_CUDA, reason="needs a GPU and a CUDA build")
@pytest.mark.parametrize("name,make", _CASES, ids=[c[0] for c in _CASES])
def test_cuda_ops_allocate_nothing_outside_torch(name, make):
    """Eager: the stream-ordered pool is not touched during the call. Captured: the graph has no memory-allocation
    node (a cudaMallocAsync inside the call would be recorded as one; the workspace comes from torch's graph pool)."""
    _native_allocator()
    run_op, _, refill, _ = make("cuda")
    out = torch.empty_like(refill[0])
    run_op(out)
    with _PoolWatch() as w:
        run_op(out)
    assert w.peak == 0, f"the call took {w.peak} bytes from the stream-ordered pool"
    graph = _keep_graph()
    with torch.cuda.graph(graph):
        run_op(out)
    assert _alloc_nodes(graph) == 0, "the captured call holds a stream-ordered allocation (cudaMallocAsync)"
    _instantiate(graph)
    graph.replay()
    torch.cuda.synchronize()


@pytest.mark.skipif(not _HAS_CUDA, reason="needs a GPU and a CUDA build")
def test_cuda_allocation_checks_detect_the_stream_ordered_temporary():
    """Positive control of the two checks above: the public attention() without a workspace on the split path
    (short queries against long keys, D = 128) takes its partials from cudaMallocAsync, which both checks see."""
    _native_allocator()
    args, kw = dense_problem("cuda", 128, "chunk")
    if hasattr(sp, "attention_path"):
        assert sp.attention_path(*args, **kw) == "split_kv"
    out = torch.empty_like(args[0])
    sp.attention(*args, out=out)
    with _PoolWatch() as w:
        sp.attention(*args, out=out)
    assert w.peak > 0
    graph = _keep_graph()
    with torch.cuda.graph(graph):
        sp.attention(*args, out=out)
    assert _alloc_nodes(graph) >= 1
    _instantiate(graph)
    graph.replay()
    torch.cuda.synchronize()
    _equal(out, sp.attention(*args))

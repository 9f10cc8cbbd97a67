"""sp.sparse_support: the one answer to "why would this call not run sparse?", in the backend's own words (the
NotImplementedError the call would raise); None where it runs sparse. CPU: every valid call (the reference). CUDA:
each refusal of src/cuda/support.cpp, and None exactly where sparse_prefill / chunked_prefill then run."""

import numpy as np
import pytest

import sparse_prefill as sp
from conftest import make_varlen, to_paged


def _contiguous(rng, d=64, dtype=np.float32):
    q, k, v, cu_q, cu_k = make_varlen(rng, [70, 200], [70, 200], d=d, dtype=dtype)
    return (q, k, v, cu_q, cu_k, 200, 200)


def test_cpu_runs_every_valid_call(rng):
    args = _contiguous(rng)
    assert sp.sparse_support(*args) is None
    assert sp.sparse_support(*args, rule="key_max", alpha=0.1, block_size=64) is None
    assert sp.sparse_support(*args, selection=sp.Selection(union=True), causal=False) is None
    q, k, v, cu_q, cu_k = make_varlen(rng, [37, 130], [337, 650])
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, 16)
    assert sp.sparse_support(q, kc, vc, cu_q, None, 130, 650, block_table=bt, seqused_k=used) is None


def test_bad_arguments_raise_as_the_call_does(rng):
    args = _contiguous(rng)
    with pytest.raises(ValueError, match="^block_size"):
        sp.sparse_support(*args, block_size=100)
    with pytest.raises(ValueError, match="^max_seqlen_q"):
        sp.sparse_support(*args[:5], -1, args[6])
    with pytest.raises(ValueError, match="^alpha: given both"):
        sp.sparse_support(*args, selection=sp.Selection(), alpha=0.1)
    with pytest.raises(TypeError, match="^alpah: unexpected keyword"):
        sp.sparse_support(*args, alpah=0.1)


torch = pytest.importorskip("torch")
_CUDA = torch.cuda.is_available() and sp.with_cuda


@pytest.mark.skipif(not _CUDA, reason="needs a GPU and a CUDA build")
def test_cuda_reasons_are_the_calls_refusals(rng):
    """Each case: sparse_support's reason is the message of the NotImplementedError that sparse_prefill raises on the
    same arrays (one source); None: the call runs."""
    dev = "cuda"

    def t(a, dtype=torch.bfloat16):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype)

    def i32(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    def case(d=128, dtype=torch.bfloat16, page=None, **kw):
        q, k, v, cu_q, cu_k = make_varlen(rng, [70, 200], [300, 700], d=d)
        if page is None:
            return (t(q, dtype), t(k, dtype), t(v, dtype), i32(cu_q), i32(cu_k), 200, 700), kw
        kc, vc, bt, used = to_paged(rng, k, v, cu_k, page)
        return (t(q, dtype), t(kc, dtype), t(vc, dtype), i32(cu_q), None, 200, 700), dict(
            kw, block_table=i32(bt), seqused_k=i32(used))

    cases = {
        "runs": (case(), None),
        "runs paged": (case(page=64), None),
        "head dim 64": (case(d=64), "head dim 128"),
        "float32": (case(dtype=torch.float32), "bfloat16"),
        "page 32": (case(page=32), "page_size"),
        "block 64": (case(block_size=64), "block_size"),
        "not causal": (case(causal=False), "causal"),
    }
    for name, ((args, kw), want) in cases.items():
        why = sp.sparse_support(*args, **kw)
        if want is None:
            assert why is None, (name, why)
            sp.sparse_prefill(*args, **kw)  # runs
            continue
        assert why is not None and want in why, (name, why)
        with pytest.raises(NotImplementedError) as e:
            sp.sparse_prefill(*args, **kw)
        assert str(e.value) == why, name


def test_fp8_attention_support_names_what_is_not_built():
    if not sp.with_cuda:
        assert "no CUDA backend" in sp.fp8_attention_support(128)
        return
    assert sp.fp8_attention_support(128) is None and sp.fp8_attention_support(128, 64) is None
    assert "head dim 128 only, got head dim 64" in sp.fp8_attention_support(64)
    assert "got page_size 16" in sp.fp8_attention_support(128, 16)


def test_fp8_attention_support_checks_its_arguments():
    with pytest.raises(ValueError, match="^page_size"):
        sp.fp8_attention_support(128, 0)
    with pytest.raises(TypeError, match="^head_dim"):
        sp.fp8_attention_support(128.0)


@pytest.mark.skipif(not _CUDA, reason="needs a GPU and a CUDA build")
def test_the_replays_stand_in_answers_as_the_cuda_build(rng):
    """engine_sim.cuda_sparse_support (the adapters' CPU replays of CUDA decisions) gives the CUDA build's answers."""
    from engine_sim import cuda_fp8_attention_support, cuda_sparse_support
    for d in (64, 96, 128):
        for page in (None, 16, 32, 64, 128):
            assert sp.fp8_attention_support(d, page) == cuda_fp8_attention_support(d, page), (d, page)
    for d in (64, 128):
        for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
            for page in (None, 32, 64):
                for kw in ({}, dict(block_size=64), dict(causal=False)):
                    q, k, v, cu_q, cu_k = make_varlen(rng, [70, 200], [300, 700], d=d)
                    extra = {}
                    if page is not None:
                        k, v, bt, used = to_paged(rng, k, v, cu_k, page)
                        cu_k, extra = None, dict(block_table=bt, seqused_k=used)
                    arrays = [torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v)]
                    if dtype == torch.float8_e4m3fn:
                        arrays = [x.to(dtype) for x in arrays]
                        extra.update({n: torch.ones(2, 2) for n in ("q_descale", "k_descale", "v_descale")})
                    else:
                        arrays = [x.to(dtype) for x in arrays]
                    cuda = [x.cuda() for x in arrays]
                    dev = {n: torch.from_numpy(np.ascontiguousarray(x)).cuda() if not torch.is_tensor(x)
                           else x.cuda() for n, x in extra.items()}
                    cu = [None if c is None else torch.from_numpy(c).cuda() for c in (cu_q, cu_k)]
                    real = sp.sparse_support(*cuda, *cu, 200, 700, **dev, **kw)
                    stand_in = cuda_sparse_support(*arrays, cu_q, cu_k, 200, 700, **extra, **kw)
                    assert real == stand_in, (d, dtype, page, kw, real, stand_in)

"""An index is bound to the call it was built for: sparse_attention rejects another mask, scale, shape, length bound
or array with an error naming the argument, and reuse_index=True applies a selection to other arrays of the same
problem (CPU reference backend; the same checks run before every CUDA launch)."""

import numpy as np
import pytest

import sparse_prefill as sp
from conftest import make_varlen

Q_LENS, K_LENS = [300, 129], [300, 500]
SEL = dict(block_size=64, sink=64, window=64, last_n=1, alpha=0.3)


@pytest.fixture
def call(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, Q_LENS, K_LENS, hq=4, hkv=2, d=64)
    return q, k, v, cu_q, cu_k


def _args(call, mq=max(Q_LENS), mk=max(K_LENS)):
    q, k, v, cu_q, cu_k = call
    return q, k, v, cu_q, cu_k, mq, mk


def test_binding_records_the_problem(call):
    index = sp.build_index(*_args(call), **SEL)
    b = index.binding
    assert (b.causal, b.batch, b.num_q_heads, b.num_kv_heads, b.head_dim) == (True, 2, 4, 2, 64)
    assert (b.total_q, b.total_k, b.max_seqlen_q, b.max_seqlen_k) == (429, 800, 300, 500)
    assert b.block_size == 64 and abs(b.softmax_scale - 64 ** -0.5) < 1e-7 and b.device == "cpu"


def test_index_built_causal_is_refused_without_the_mask(call):
    q, k, v, cu_q, cu_k = call
    index = sp.build_index(*_args(call), **SEL)
    with pytest.raises(ValueError, match="^causal: is False but the index was built for True") as e:
        sp.sparse_attention(q, k, v, index, cu_q, cu_k, max(Q_LENS), max(K_LENS), causal=False)
    assert e.value.argument == "causal"
    with pytest.raises(ValueError, match="^causal"):   # not even with reuse_index: the mask is the problem's
        sp.sparse_attention(q, k, v, index, cu_q, cu_k, max(Q_LENS), max(K_LENS), causal=False, reuse_index=True)


@pytest.mark.parametrize("change,argument", [
    (dict(softmax_scale=0.2), "softmax_scale"),
    (dict(max_seqlen_k=max(K_LENS) + 1), "max_seqlen_k"),
    (dict(max_seqlen_q=max(Q_LENS) + 7), "max_seqlen_q"),
])
def test_other_problem_parameters_are_refused(call, change, argument):
    q, k, v, cu_q, cu_k = call
    index = sp.build_index(*_args(call), **SEL)
    kw = dict(max_seqlen_q=max(Q_LENS), max_seqlen_k=max(K_LENS))
    kw.update(change)
    mq, mk = kw.pop("max_seqlen_q"), kw.pop("max_seqlen_k")
    with pytest.raises(ValueError, match=f"^{argument}: "):
        sp.sparse_attention(q, k, v, index, cu_q, cu_k, mq, mk, **kw)


def test_index_of_other_data_with_the_same_shapes_is_refused(call, rng):
    q, k, v, cu_q, cu_k = call
    index = sp.build_index(*_args(call), **SEL)
    q2, k2, v2 = (rng.standard_normal(a.shape).astype(a.dtype) for a in (q, k, v))
    for (qq, kk, vv, cu), name in (((q2, k, v, cu_q), "q"), ((q, k2, v, cu_q), "k"), ((q, k, v2, cu_q), "v"),
                                   ((q, k, v, cu_q.copy()), "cu_seqlens_q")):
        with pytest.raises(ValueError, match=f"^{name}: is not the array the index was built from") as e:
            sp.sparse_attention(qq, kk, vv, index, cu, cu_k, max(Q_LENS), max(K_LENS))
        assert e.value.argument == name


def test_reuse_index_applies_a_selection_to_other_data(call):
    """The same values in other arrays: refused by default, and with reuse_index=True exactly the result of the
    arrays the index was built from."""
    q, k, v, cu_q, cu_k = call
    index = sp.build_index(*_args(call), **SEL)
    want = sp.sparse_attention(q, k, v, index, cu_q, cu_k, max(Q_LENS), max(K_LENS))
    copies = [a.copy() for a in call]
    with pytest.raises(ValueError, match="^q: is not the array"):
        sp.sparse_attention(copies[0], copies[1], copies[2], index, *copies[3:], max(Q_LENS), max(K_LENS))
    got = sp.sparse_attention(copies[0], copies[1], copies[2], index, *copies[3:], max(Q_LENS), max(K_LENS),
                              reuse_index=True)
    np.testing.assert_array_equal(got, want)


def test_other_shapes_are_refused_even_with_reuse(call, rng):
    q, k, v, cu_q, cu_k = call
    index = sp.build_index(*_args(call), **SEL)
    q8 = np.concatenate([q, q], axis=1)   # 8 query heads
    with pytest.raises(ValueError, match="^q: is 8 query heads"):
        sp.sparse_attention(q8, k, v, index, cu_q, cu_k, max(Q_LENS), max(K_LENS), reuse_index=True)


def test_union_index_keeps_the_binding(call):
    index = sp.build_index(*_args(call), **SEL)
    u = sp.union_index(index, *_args(call))
    assert u.binding.union and u.binding.total_q == index.binding.total_q
    q, k, v, cu_q, cu_k = call
    with pytest.raises(ValueError, match="^causal"):
        sp.sparse_attention(q, k, v, u, cu_q, cu_k, max(Q_LENS), max(K_LENS), causal=False)

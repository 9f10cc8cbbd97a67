"""Bad arguments raise ValueError (values, shapes) or TypeError (types, dtypes, libraries) naming the argument."""

import numpy as np
import pytest

import sparse_prefill as sp
from conftest import make_varlen, to_paged
from test_attention import DLPackOnly

_rng = np.random.default_rng(5)
Q, K, V, CU_Q, CU_K = make_varlen(_rng, [8, 12], [10, 20])   # Hq=4, Hkv=2, D=64
KC, VC, BT, USED = to_paged(_rng, K, V, CU_K, 16, extra_pages=0)


def base(**over):
    a = dict(q=Q, k=K, v=V, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_q=12, max_seqlen_k=20)
    a.update(over)
    return a


def paged(**over):
    a = dict(q=Q, k=KC, v=VC, cu_seqlens_q=CU_Q, cu_seqlens_k=None, max_seqlen_q=12, max_seqlen_k=20,
             block_table=BT, seqused_k=USED)
    a.update(over)
    return a


def strided_last(a):
    big = np.repeat(a, 2, axis=-1)
    return big[..., ::2]


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


SEL = dict(block_size=64, sink=64, window=64, last_n=1, head_subgroups=1)

ATTENTION_CASES = [
    # shapes and ranks
    ("q_rank2", base(q=Q[:, 0]), ValueError, "q"),
    ("q_rank4", base(q=Q[None]), ValueError, "q"),
    ("k_rank2", base(k=K[:, 0]), ValueError, "k"),
    ("k_rank5", base(k=K[None, None]), ValueError, "k"),
    ("v_shape", base(v=V[:, :1]), ValueError, "v"),
    ("heads_not_multiple", base(q=np.ascontiguousarray(Q[:, :3])), ValueError, "k"),
    ("head_dim_96", base(q=np.zeros((20, 4, 96), np.float32), k=np.zeros((30, 2, 96), np.float32),
                         v=np.zeros((30, 2, 96), np.float32)), ValueError, "q"),
    ("k_head_dim_mismatch", base(k=np.zeros((30, 2, 128), np.float32), v=np.zeros((30, 2, 128), np.float32)),
     ValueError, "k"),
    ("q_last_dim_strided", base(q=strided_last(Q)), ValueError, "q"),
    ("k_last_dim_strided", base(k=strided_last(K)), ValueError, "k"),
    ("v_last_dim_strided", base(v=strided_last(V)), ValueError, "v"),
    # dtypes
    ("q_float64", base(q=Q.astype(np.float64)), TypeError, "q"),
    ("k_dtype_mismatch", base(k=K.astype(np.float16)), TypeError, "k"),
    ("v_dtype_mismatch", base(v=V.astype(np.float16)), TypeError, "v"),
    ("cu_seqlens_q_int16", base(cu_seqlens_q=CU_Q.astype(np.int16)), TypeError, "cu_seqlens_q"),  # int64: test_package
    ("cu_seqlens_k_float", base(cu_seqlens_k=CU_K.astype(np.float32)), TypeError, "cu_seqlens_k"),
    # cu_seqlens values
    ("cu_seqlens_q_not_monotone", base(cu_seqlens_q=np.array([0, 21, 20], np.int32), max_seqlen_q=21),
     ValueError, "cu_seqlens_q"),
    ("cu_seqlens_q_total", base(cu_seqlens_q=np.array([0, 8, 19], np.int32)), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_q_start", base(cu_seqlens_q=np.array([1, 8, 20], np.int32)), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_k_total", base(cu_seqlens_k=np.array([0, 10, 31], np.int32), max_seqlen_k=21), ValueError,
     "cu_seqlens_k"),
    ("cu_seqlens_k_batch", base(cu_seqlens_k=np.array([0, 30], np.int32), max_seqlen_k=30), ValueError,
     "cu_seqlens_k"),
    ("cu_seqlens_q_rank", base(cu_seqlens_q=CU_Q[None]), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_k_missing", base(cu_seqlens_k=None), ValueError, "cu_seqlens_k"),
    ("max_seqlen_q_small", base(max_seqlen_q=11), ValueError, "max_seqlen_q"),
    ("max_seqlen_k_small", base(max_seqlen_k=19), ValueError, "max_seqlen_k"),
    ("max_seqlen_q_negative", base(max_seqlen_q=-1), ValueError, "max_seqlen_q"),
    ("max_seqlen_k_float", base(max_seqlen_k=20.0), TypeError, "max_seqlen_k"),
    # Python-level kinds
    ("q_list", base(q=Q.tolist()), TypeError, "q"),
    ("q_none", base(q=None), TypeError, "q"),
    ("cu_seqlens_q_list", base(cu_seqlens_q=[0, 8, 20]), TypeError, "cu_seqlens_q"),
    ("mixed_libraries", base(k=DLPackOnly(K)), TypeError, "k"),
    ("window_not_pair", dict(base(), window=(1, 2, 3)), ValueError, "window"),
    ("window_int", dict(base(), window=5), TypeError, "window"),
    ("window_float", dict(base(), window=(1.5, 0)), TypeError, "window"),
    ("window_below_minus_one", dict(base(), window=(-2, 0)), ValueError, "window"),
    ("softmax_scale_str", dict(base(), softmax_scale="0.1"), TypeError, "softmax_scale"),
    ("softmax_scale_negative", dict(base(), softmax_scale=-1.0), ValueError, "softmax_scale"),
    ("softmax_scale_nan", dict(base(), softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("causal_str", dict(base(), causal="yes"), TypeError, "causal"),
    ("stream_str", dict(base(), stream="default"), TypeError, "stream"),
    ("stream_negative", dict(base(), stream=-1), ValueError, "stream"),
    # outputs
    ("out_shape", dict(base(), out=np.zeros((20, 4, 32), np.float32)), ValueError, "out"),
    ("out_dtype", dict(base(), out=np.zeros((20, 4, 64), np.float16)), TypeError, "out"),
    ("out_readonly", dict(base(), out=readonly(np.zeros((20, 4, 64), np.float32))), TypeError, "out"),
    ("out_list", dict(base(), out=[0.0]), TypeError, "out"),
    ("out_last_dim_strided", dict(base(), out=strided_last(np.zeros((20, 4, 64), np.float32))), ValueError, "out"),
    # paged KV
    ("seqused_k_contiguous", base(seqused_k=USED), ValueError, "seqused_k"),
    ("page_id_out_of_range", paged(block_table=np.where(BT == BT[1, 0], KC.shape[0], BT).astype(np.int32)),
     ValueError, "block_table"),
    ("page_id_negative", paged(block_table=np.where(BT == BT[0, 0], -1, BT).astype(np.int32)), ValueError,
     "block_table"),
    ("seqused_k_beyond_pages", paged(seqused_k=np.array([10, BT.shape[1] * 16 + 1], np.int32), max_seqlen_k=999),
     ValueError, "seqused_k"),
    ("seqused_k_negative", paged(seqused_k=np.array([-1, 20], np.int32)), ValueError, "seqused_k"),
    ("seqused_k_over_max", paged(max_seqlen_k=15), ValueError, "max_seqlen_k"),
    ("seqused_k_missing", paged(seqused_k=None), ValueError, "seqused_k"),
    ("seqused_k_length", paged(seqused_k=USED[:1]), ValueError, "seqused_k"),
    ("paged_with_cu_seqlens_k", paged(cu_seqlens_k=CU_K), ValueError, "cu_seqlens_k"),
    ("block_table_rows", paged(block_table=BT[:1]), ValueError, "block_table"),
    ("block_table_int16", paged(block_table=BT.astype(np.int16)), TypeError, "block_table"),  # int64: test_package
    ("paged_k_rank3", paged(k=K, v=V), ValueError, "k"),
    # workspace (used by the CUDA split path; its shape, layout and writability are checked everywhere)
    ("workspace_2d", base(workspace=np.zeros((4, 4), np.int32)), ValueError, "workspace"),
    ("workspace_strided", base(workspace=np.zeros(64, np.int32)[::2]), ValueError, "workspace"),
    ("workspace_readonly", base(workspace=readonly(np.zeros(64, np.int32))), TypeError, "workspace"),
]


def check_error(excinfo, name):
    msg = str(excinfo.value)
    assert msg.startswith(name), msg
    # errors raised by the C++ library carry the argument name
    assert getattr(excinfo.value, "argument", name) == name


@pytest.mark.parametrize("kwargs,exc,name", [c[1:] for c in ATTENTION_CASES], ids=[c[0] for c in ATTENTION_CASES])
def test_attention_bad_arguments(kwargs, exc, name):
    with pytest.raises(exc) as e:
        sp.attention(**kwargs)
    check_error(e, name)


@pytest.mark.parametrize("kwargs,exc,name", [c[1:] for c in ATTENTION_CASES[:30]],
                         ids=[c[0] for c in ATTENTION_CASES[:30]])
def test_build_index_bad_inputs(kwargs, exc, name):
    with pytest.raises(exc) as e:
        sp.build_index(**kwargs, **SEL)
    check_error(e, name)


SELECTION_CASES = [
    ("block_size_96", dict(block_size=96), ValueError, "block_size"),
    ("block_size_32", dict(block_size=32), ValueError, "block_size"),
    ("block_size_0", dict(block_size=0), ValueError, "block_size"),
    ("block_size_float", dict(block_size=64.0), TypeError, "block_size"),
    ("alpha_negative", dict(alpha=-0.1), ValueError, "alpha"),
    ("alpha_above_one", dict(alpha=1.5), ValueError, "alpha"),
    ("alpha_str", dict(alpha="0.1"), TypeError, "alpha"),
    ("mean_alpha_negative", dict(mean_alpha=-0.5, rule="probe_row_max"), ValueError, "mean_alpha"),
    ("mean_alpha_above_one", dict(mean_alpha=2.0), ValueError, "mean_alpha"),
    ("mean_alpha_nan", dict(mean_alpha=float("nan"), rule="probe_row_max"), ValueError, "mean_alpha"),
    ("mean_alpha_str", dict(mean_alpha="0.5"), TypeError, "mean_alpha"),
    ("candidate_alpha_negative", dict(candidate_alpha=-0.1, rule="exact_max"), ValueError, "candidate_alpha"),
    ("candidate_alpha_above_one", dict(candidate_alpha=1.5), ValueError, "candidate_alpha"),  # under every rule
    ("candidate_alpha_str", dict(candidate_alpha="0.003"), TypeError, "candidate_alpha"),
    ("key_rank_8", dict(key_rank=8, rule="key_max"), ValueError, "key_rank"),
    ("key_rank_64", dict(key_rank=64, rule="key_max"), ValueError, "key_rank"),
    ("key_rank_other_rule", dict(key_rank=24), ValueError, "key_rank"),   # checked under every rule, as mean_alpha
    ("key_rank_float", dict(key_rank=16.0), TypeError, "key_rank"),
    ("rule_unknown", dict(rule="keymax"), ValueError, "rule"),
    ("sink_negative", dict(sink=-1), ValueError, "sink"),
    ("window_negative", dict(window=-1), ValueError, "window"),
    ("window_pair", dict(window=(64, 0)), TypeError, "window"),
    ("last_n_negative", dict(last_n=-1), ValueError, "last_n"),
    ("correction_str", dict(correction="no"), TypeError, "correction"),
    ("head_subgroups_negative", dict(head_subgroups=-1), ValueError, "head_subgroups"),
    ("dense_fraction_0", dict(dense_fraction=0.0), ValueError, "dense_fraction"),
    ("dense_fraction_above_1", dict(dense_fraction=1.5), ValueError, "dense_fraction"),
    ("head_subgroups_not_dividing_g", dict(head_subgroups=3), ValueError, "head_subgroups"),   # g = 4 // 2
    ("head_subgroups_float", dict(head_subgroups=2.0), TypeError, "head_subgroups"),
]


@pytest.mark.parametrize("over,exc,name", [c[1:] for c in SELECTION_CASES], ids=[c[0] for c in SELECTION_CASES])
def test_selection_bad_parameters(over, exc, name):
    with pytest.raises(exc) as e:
        sp.build_index(**base(), **dict(SEL, **over))
    check_error(e, name)
    with pytest.raises(exc) as e:
        sp.sparse_prefill(**base(), **dict(SEL, **over))
    check_error(e, name)


@pytest.fixture(scope="module")
def index():
    return sp.build_index(**base(), **SEL)


def test_sparse_attention_index_type():
    with pytest.raises(TypeError) as e:
        sp.sparse_attention(Q, K, V, {"block_ids": []}, CU_Q, CU_K, 12, 20)
    check_error(e, "index")


def test_sparse_attention_index_for_other_inputs(index):
    q, k, v, cu_q, cu_k = make_varlen(_rng, [8, 200], [10, 200])
    with pytest.raises(ValueError) as e:    # the index's binding names the first argument that differs
        sp.sparse_attention(q, k, v, index, cu_q, cu_k, 200, 200)
    check_error(e, "q")
    with pytest.raises(ValueError) as e:    # not even with reuse_index: other shapes are another problem
        sp.sparse_attention(q, k, v, index, cu_q, cu_k, 200, 200, reuse_index=True)
    check_error(e, "q")


@pytest.mark.parametrize("case", ["q_rank2", "k_dtype_mismatch", "cu_seqlens_q_total", "page_id_out_of_range",
                                  "out_shape", "mixed_libraries"])
def test_sparse_attention_bad_inputs(index, case):
    kwargs, exc, name = next(c[1:] for c in ATTENTION_CASES if c[0] == case)
    with pytest.raises(exc) as e:
        sp.sparse_attention(index=index, **kwargs)
    check_error(e, name)


def test_union_index_errors(index):
    with pytest.raises(TypeError) as e:
        sp.union_index(None, **base())
    check_error(e, "index")
    q, k, v, cu_q, cu_k = make_varlen(_rng, [8, 200], [10, 200])
    with pytest.raises(ValueError) as e:
        sp.union_index(index, q, k, v, cu_q, cu_k, 200, 200)
    check_error(e, "q")


def test_segment_helper_errors(index):
    for args, name in (((2, 0, 0), "b"), ((0, 2, 0), "kv_head"), ((0, 0, 99), "tile")):
        with pytest.raises(ValueError) as e:
            index.segment(*args)
        check_error(e, name)


@pytest.mark.parametrize("call,exc,name", [
    (lambda: sp.pool_kv(K, V, CU_K, block_size=100), ValueError, "block_size"),
    (lambda: sp.pool_kv(np.zeros((30, 2, 96), np.float32), np.zeros((30, 2, 96), np.float32), CU_K), ValueError,
     "k"),
    (lambda: sp.pool_kv(K, V.astype(np.float16), CU_K), TypeError, "v"),
    (lambda: sp.pool_kv(K, V, np.array([0, 10, 29], np.int32)), ValueError, "cu_seqlens_k"),
    (lambda: sp.pool_kv(K, V, None), ValueError, "cu_seqlens_k"),
    (lambda: sp.pool_kv(K, DLPackOnly(V), CU_K), TypeError, "v"),
    (lambda: sp.pool_kv(K[:, 0], V, CU_K), ValueError, "k"),
    (lambda: sp.pool_kv(KC, VC, None, block_table=np.where(BT == BT[0, 0], 99, BT).astype(np.int32),
                        seqused_k=USED), ValueError, "block_table"),
    (lambda: sp.pool_kv([1.0], V, CU_K), TypeError, "k"),
])
def test_pool_kv_errors(call, exc, name):
    with pytest.raises(exc) as e:
        call()
    check_error(e, name)


def test_jax_out_rejected():
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(TypeError) as e:
        sp.attention(jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V), jnp.asarray(CU_Q), jnp.asarray(CU_K), 12, 20,
                     out=np.zeros_like(Q))
    check_error(e, "out")


def test_torch_mixed_with_numpy():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError) as e:
        sp.attention(torch.from_numpy(Q), K, V, CU_Q, CU_K, 12, 20)
    check_error(e, "k")


def test_torch_cuda_not_implemented_or_runs():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    t = [torch.from_numpy(a).cuda() for a in (Q, K, V, CU_Q, CU_K)]
    try:
        out = sp.attention(*t, 12, 20)
    except NotImplementedError as e:
        assert "CUDA" in str(e)
    else:
        assert out.is_cuda and out.shape == t[0].shape

"""The seeded workload generators exposed as sparse_prefill.workload."""

import numpy as np
import pytest

import sparse_prefill as sp


def test_topic_shapes_and_determinism():
    q, k, v = sp.workload.topic(384, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=7)
    assert q.shape == (384, 4, 64) and k.shape == (384, 2, 64) and v.shape == (384, 2, 64)
    assert q.dtype == k.dtype == v.dtype == np.float32
    assert all(a.flags.c_contiguous for a in (q, k, v))
    q2, k2, v2 = sp.workload.topic(384, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=7)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        np.testing.assert_array_equal(a, b)
    q3, _, _ = sp.workload.topic(384, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=8)
    assert not np.array_equal(q, q3)


def test_topic_defaults_and_statistics():
    q, k, v = sp.workload.topic(256, head_dim=64)
    assert q.shape == (256, 32, 64) and k.shape == (256, 8, 64)
    # K = topic + N(0, I): keys of one block share their topic, so their per-block mean has variance ~ 1 + 1/128
    blocks = k.reshape(2, 128, 8, 64)
    within = blocks - blocks.mean(axis=1, keepdims=True)
    assert within.var() == pytest.approx(1.0, rel=0.05)
    assert v.var() == pytest.approx(1.0, rel=0.05)


def test_topic_density_falls_with_length():
    dens = []
    for L in (1024, 2048):
        q, k, v = sp.workload.topic(L, 4, 2, 64, seed=0, block=64)
        cu = np.array([0, L], np.int32)
        dens.append(sp.build_index(q, k, v, cu, cu, L, L, block_size=64, sink=64, window=64, last_n=1).density)
    assert 0 < dens[1] < dens[0] < 1


def test_structured_shapes_determinism_and_knobs():
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, seed=3, needle_min_distance=256)
    q, k, v = sp.workload.structured(1024, **kw)
    assert q.shape == (1024, 4, 64) and k.shape == (1024, 2, 64) and q.dtype == np.float32
    q2, k2, v2 = sp.workload.structured(1024, **kw)
    np.testing.assert_array_equal(q, q2)
    np.testing.assert_array_equal(v, v2)
    q3, _, _ = sp.workload.structured(1024, **dict(kw, sink_logit=2.0))
    assert not np.array_equal(q, q3)
    defaults = sp.workload.structured_defaults()
    assert "needle_logit" in defaults and "rope_base" in defaults


def test_needle_positions_match_values():
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, seed=5, needle_min_distance=256, needles=1)
    q, k, v = sp.workload.structured(1024, **kw)
    needles = sp.workload.needle_positions(1024, **kw)
    assert needles, "a 1024-token sequence has room for a needle at distance 256"
    for n in needles:
        assert 0 <= n["key_begin"] < n["key_end"] <= n["query_begin"] < n["query_end"] <= 1024
        assert n["value"].shape == (64,)
        np.testing.assert_array_equal(v[n["key_begin"]:n["key_end"], n["kv_head"]],
                                      np.broadcast_to(n["value"], (n["key_end"] - n["key_begin"], 64)))


@pytest.mark.parametrize("call,name,exc", [
    (lambda: sp.workload.topic(-1), "seqlen", ValueError),
    (lambda: sp.workload.topic(128, num_q_heads=6, num_kv_heads=4), "num_q_heads", ValueError),
    (lambda: sp.workload.topic(128.0), "seqlen", TypeError),
    (lambda: sp.workload.topic(128, seed=-1), "seed", ValueError),
    (lambda: sp.workload.structured(128, bogus=1), "bogus", TypeError),
    (lambda: sp.workload.structured(128, needles=1.5), "needles", TypeError),
])
def test_workload_bad_arguments(call, name, exc):
    with pytest.raises(exc) as e:
        call()
    assert str(e.value).startswith(name)

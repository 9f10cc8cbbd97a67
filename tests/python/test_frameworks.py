"""torch / cupy / jax specifics: device routing, CUDA streams, output allocation. Skipped where a library or a GPU
is missing (the CPU-only CI covers numpy; the GPU machine runs these)."""

import numpy as np
import pytest

import sparse_prefill as sp
import sp_naive as naive
from sparse_prefill import _arrays
from conftest import make_varlen

_rng = np.random.default_rng(11)
Q, K, V, CU_Q, CU_K = make_varlen(_rng, [8, 12], [10, 20])


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


def test_torch_cuda_stream_default_and_explicit():
    torch = _torch_cuda()
    q = torch.zeros(4, 2, 64, device="cuda")
    lib = _arrays.ArrayLib("torch", q)
    assert lib.cuda
    assert _arrays.resolve_stream(None, lib) == torch.cuda.current_stream().cuda_stream
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert _arrays.resolve_stream(None, lib) == s.cuda_stream
    assert _arrays.resolve_stream(s, lib) == s.cuda_stream
    assert _arrays.resolve_stream(1234, lib) == 1234
    assert _arrays.resolve_stream(None, _arrays.ArrayLib("numpy", Q)) == 0


def _check_cuda_result(run, to_numpy):
    try:
        out, lse = run()
    except NotImplementedError as e:
        assert "CUDA" in str(e) or "cuda" in str(e)
        return False
    ref_out, ref_lse = naive.attention(Q, K, V, CU_Q, CU_K)
    np.testing.assert_allclose(to_numpy(out).astype(np.float64), ref_out, atol=2e-2, rtol=0)
    return True


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_torch_cuda_attention(dtype_name):
    torch = _torch_cuda()
    dtype = getattr(torch, dtype_name)
    t = [torch.from_numpy(a).cuda() for a in (Q, K, V)]
    t = [x.to(dtype) for x in t] + [torch.from_numpy(a).cuda() for a in (CU_Q, CU_K)]

    def run():
        out, lse = sp.attention(*t, 12, 20, return_lse=True)
        assert out.is_cuda and out.dtype == dtype and lse.is_cuda and lse.dtype == torch.float32
        buf = torch.empty_like(t[0])
        assert sp.attention(*t, 12, 20, out=buf) is buf
        return out, lse

    _check_cuda_result(run, lambda x: x.float().cpu().numpy())


def test_torch_cuda_device_mismatch():
    torch = _torch_cuda()
    t = [torch.from_numpy(a).cuda().half() for a in (Q, K, V)]
    with pytest.raises(TypeError) as e:
        sp.attention(*t, torch.from_numpy(CU_Q), torch.from_numpy(CU_K).cuda(), 12, 20)
    assert str(e.value).startswith("cu_seqlens_q")


def test_cupy_attention():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    c = [cupy.asarray(a.astype(np.float16)) for a in (Q, K, V)] + [cupy.asarray(a) for a in (CU_Q, CU_K)]
    lib = _arrays.ArrayLib("cupy", c[0])
    assert _arrays.resolve_stream(None, lib) == cupy.cuda.get_current_stream().ptr

    def run():
        out, lse = sp.attention(*c, 12, 20, return_lse=True)
        assert isinstance(out, cupy.ndarray) and out.dtype == np.float16
        return out, lse

    _check_cuda_result(run, lambda x: x.get())


def test_jax_cpu():
    jax = pytest.importorskip("jax")
    cpu = jax.devices("cpu")[0]
    j = [jax.device_put(a, cpu) for a in (Q, K, V, CU_Q, CU_K)]
    out, lse = sp.attention(*j, 12, 20, return_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    ref_out, ref_lse = naive.attention(Q, K, V, CU_Q, CU_K)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=0)
    index = sp.build_index(*j, 12, 20, block_size=64, head_subgroups=1)  # means per KV head, as pool_kv's
    assert index.density == 1.0
    k_mean, v_mean, cu_blocks = sp.pool_kv(j[1], j[2], j[4], block_size=64)
    assert isinstance(k_mean, jax.Array)
    np.testing.assert_allclose(np.asarray(k_mean), index.k_mean, atol=1e-6, rtol=0)


def test_jax_cuda():
    jax = pytest.importorskip("jax")
    pytest.importorskip("cupy")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("no jax GPU backend")
    j = [jax.device_put(a, gpu) for a in (Q.astype(np.float16), K.astype(np.float16), V.astype(np.float16))]
    j += [jax.device_put(a, gpu) for a in (CU_Q, CU_K)]

    def run():
        out, lse = sp.attention(*j, 12, 20, return_lse=True)
        assert isinstance(out, jax.Array) and out.dtype == np.float16
        return out, lse

    _check_cuda_result(run, np.asarray)


def test_torch_cpu_index_arrays_are_torch():
    torch = pytest.importorskip("torch")
    t = [torch.from_numpy(a) for a in (Q, K, V, CU_Q, CU_K)]
    index = sp.build_index(*t, 12, 20, block_size=64, head_subgroups=1)  # means per KV head, as pool_kv's
    assert index.v_mean is None  # no correction: no V means
    assert all(isinstance(getattr(index, n), torch.Tensor) for n in Index_ARRAYS if n != "v_mean")
    corrected = sp.build_index(*t, 12, 20, block_size=64, correction=True)
    assert all(isinstance(getattr(corrected, n), torch.Tensor) for n in Index_ARRAYS)
    k_mean, v_mean, cu_blocks = sp.pool_kv(t[1], t[2], t[4], block_size=64)
    assert isinstance(k_mean, torch.Tensor) and cu_blocks.dtype == torch.int32
    np.testing.assert_array_equal(k_mean.numpy(), index.k_mean.numpy())


Index_ARRAYS = ("segment_start", "segment_end", "block_ids", "cu_blocks", "k_mean", "v_mean")

"""ctypes binding of build-cuda/libsp_cuda_test.so (tests/gpu/sp_cuda_shim.cpp) for the GPU tests and benchmarks.

Takes torch CUDA tensors; launches on torch's current stream. This is test infrastructure: engines use the
sparse_prefill Python package."""
import ctypes
import math
import os

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LIB = None
_LIBS = {}


class NotImplementedByKernel(Exception):
    pass


def lib_path():
    return os.environ.get("SP_CUDA_LIB", os.path.join(_ROOT, "build-cuda", "libsp_cuda_test.so"))


def lib(path=None):
    """The default library (SP_CUDA_LIB or build-cuda/libsp_cuda_test.so), or the one at `path` (A/B variants)."""
    path = path or lib_path()
    if path not in _LIBS:
        handle = ctypes.CDLL(path)
        f = handle.sp_cuda_attention
        P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        f.argtypes = [P, P, P, P, P, P, P, P, P, I, I, I, I, I, I, I, I, I, I, I, I, I, F, I, I, P, ctypes.c_char_p, I]
        f.restype = I
        _LIBS[path] = handle
    return _LIBS[path]


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else ctypes.c_void_p(0)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None,
              window=(-1, -1), out=None, lse=None, block_table=None, seqused_k=None, return_lse=True, lib_path=None):
    """Same vocabulary as flash_attn_varlen_func. q [total_q, Hq, D]; k/v [total_k, Hkv, D] or paged
    [num_pages, page_size, Hkv, D] with block_table/seqused_k."""
    total_q, hq, d = q.shape
    paged = block_table is not None
    if paged:
        num_pages, page_size, hkv, _ = k.shape
        total_k, batch, max_pages = 0, block_table.shape[0], block_table.shape[1]
    else:
        num_pages, page_size, max_pages = 0, 0, 0
        total_k, hkv, _ = k.shape
        batch = cu_seqlens_q.numel() - 1
    if out is None:
        out = torch.empty_like(q)
    if return_lse and lse is None:
        lse = torch.empty(hq, total_q, dtype=torch.float32, device=q.device)
    dtype = {torch.bfloat16: 0, torch.float16: 1}[q.dtype]
    err = ctypes.create_string_buffer(512)
    rc = lib(lib_path).sp_cuda_attention(
        _ptr(q), _ptr(k), _ptr(v), _ptr(out), _ptr(lse if return_lse else None), _ptr(cu_seqlens_q),
        _ptr(None if paged else cu_seqlens_k), _ptr(block_table), _ptr(seqused_k), dtype, batch, total_q, total_k,
        num_pages, page_size, max_pages, hq, hkv, d, int(max_seqlen_q), int(max_seqlen_k), int(causal),
        float(softmax_scale or 0.0), int(window[0]), int(window[1]),
        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), err, 512)
    if rc == 1:
        raise NotImplementedByKernel(err.value.decode())
    if rc != 0:
        raise RuntimeError(err.value.decode())
    return (out, lse) if return_lse else out

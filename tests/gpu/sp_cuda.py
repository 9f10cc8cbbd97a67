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
        P, I, F, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_longlong
        call = [P, P, P, P, P, P, P, P, P, I, I, I, I, I, I, I, I, I, I, I, I, I, F, I, I, P]
        err = [ctypes.c_char_p, I]
        sigs = {"sp_cuda_attention": call + err,
                "sp_cuda_dense_path": call + [ctypes.POINTER(I)] + err,
                "sp_cuda_index_bytes": call + [I, I, ctypes.POINTER(LL)] + err,
                "sp_cuda_build_index": call + [F, I, I, I, I, I, I, I, I, P, LL, ctypes.POINTER(LL), P, P] + err,
                "sp_cuda_sparse_attention": call + [P, P, P, P, P, P, P, LL, I, I, I] + err}
        for name, argtypes in sigs.items():
            if hasattr(handle, name):  # A/B variant libraries built from older shims lack the sparse entry points
                getattr(handle, name).argtypes = argtypes
                getattr(handle, name).restype = I
        _LIBS[path] = handle
    return _LIBS[path]


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else ctypes.c_void_p(0)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None,
              window=(-1, -1), out=None, lse=None, block_table=None, seqused_k=None, return_lse=True, lib_path=None):
    """Same vocabulary as flash_attn_varlen_func. q [total_q, Hq, D]; k/v [total_k, Hkv, D] or paged
    [num_pages, page_size, Hkv, D] with block_table/seqused_k."""
    total_q, hq, d = q.shape
    if out is None:
        out = torch.empty_like(q)
    if return_lse and lse is None:
        lse = torch.empty(hq, total_q, dtype=torch.float32, device=q.device)
    args = _call_args(q, k, v, out, lse if return_lse else None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k, causal, softmax_scale, window, block_table, seqused_k)
    _check(lib(lib_path).sp_cuda_attention, args)
    return (out, lse) if return_lse else out


def dense_path(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, window=(-1, -1),
               block_table=None, seqused_k=None, lib_path=None):
    """'split' when attention() runs these shapes on PackGQA tiles with split-KV (cuda::dense_uses_full_list),
    else 'dense'."""
    args = _call_args(q, k, v, q, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, None, window,
                      block_table, seqused_k)
    flag = ctypes.c_int(-1)
    _check(lib(lib_path).sp_cuda_dense_path, args + [ctypes.byref(flag)])
    return "split" if flag.value == 1 else "dense"


def _call_args(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
               softmax_scale=None, window=(-1, -1), block_table=None, seqused_k=None):
    """The leading arguments every shim entry point shares (SP_CALL_PARAMS in sp_cuda_shim.cpp)."""
    total_q, hq, d = q.shape
    paged = block_table is not None
    if paged:
        num_pages, page_size, hkv, _ = k.shape
        total_k, batch, max_pages = 0, block_table.shape[0], block_table.shape[1]
    else:
        num_pages, page_size, max_pages = 0, 0, 0
        total_k, hkv, _ = k.shape
        batch = cu_seqlens_q.numel() - 1
    dtype = {torch.bfloat16: 0, torch.float16: 1}[q.dtype]
    return [_ptr(q), _ptr(k), _ptr(v), _ptr(out), _ptr(lse), _ptr(cu_seqlens_q),
            _ptr(None if paged else cu_seqlens_k), _ptr(block_table), _ptr(seqused_k), dtype, batch, total_q, total_k,
            num_pages, page_size, max_pages, hq, hkv, d, int(max_seqlen_q), int(max_seqlen_k), int(causal),
            float(softmax_scale or 0.0), int(window[0]), int(window[1]),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)]


def _check(fn, args):
    err = ctypes.create_string_buffer(512)
    rc = fn(*args, err, 512)
    if rc == 1:
        raise NotImplementedByKernel(err.value.decode())
    if rc != 0:
        raise RuntimeError(err.value.decode())


class DeviceIndex:
    """The GPU index stage's output in a torch-owned workspace: torch views of segment_start, segment_end, block_ids,
    cu_tiles, cu_blocks, k_mean_lowp, v_mean_lowp (q's dtype) and counters ([kept, visible] blocks)."""

    def __init__(self, ws, info, batch, hkv, d, dtype, correction, head_subgroups=1):
        base = ws.data_ptr()

        def view(ptr, n, dt):
            off = ptr - base
            nbytes = n * torch.empty((), dtype=dt).element_size()
            return ws[off:off + nbytes].view(dt)
        self.ws = ws
        max_segments, capacity, max_blocks, block_size = (int(x) for x in info[8:12])
        self.segment_start = view(info[0], max_segments, torch.int32)
        self.segment_end = view(info[1], max_segments, torch.int32)
        self.block_ids = view(info[2], capacity, torch.int32)
        self.cu_tiles = view(info[3], batch + 1, torch.int32)
        self.cu_blocks = view(info[4], batch + 1, torch.int32)
        self.k_mean = view(info[5], max_blocks * hkv * d, dtype).view(max_blocks, hkv, d)
        self.v_mean = view(info[6], max_blocks * hkv * d, dtype).view(max_blocks, hkv, d)
        self.counters = view(info[7], 3, torch.int64)
        self.block_size, self.correction, self.mean_rows = block_size, correction, max_blocks
        self.head_subgroups = head_subgroups

    def density(self):
        kept, visible, _ = (int(x) for x in self.counters.cpu())
        return kept / visible if visible else 1.0

    def tile_density(self):
        """Union mode: the density of the per-tile lists before the union."""
        _, visible, per_tile = (int(x) for x in self.counters.cpu())
        return per_tile / visible if visible else 1.0


def index_workspace(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size=128,
                    block_table=None, seqused_k=None, head_subgroups=1):
    """A torch uint8 workspace large enough for the index stage on these shapes (and head_subgroups)."""
    n = ctypes.c_longlong(0)
    args = _call_args(q, k, v, q, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      block_table=block_table, seqused_k=seqused_k)
    _check(lib().sp_cuda_index_bytes, args + [int(block_size), int(head_subgroups), ctypes.byref(n)])
    return torch.empty(int(n.value), dtype=torch.uint8, device=q.device)


def build_index(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ws, alpha=0.1, block_size=128,
                sink=256, window=512, last_n=2, correction=True, block_table=None, seqused_k=None, final_chunk=True,
                union=False, mean_cache=None, head_subgroups=1):
    """GPU index stage into `ws` (index_workspace) on torch's current stream; no synchronisation.
    mean_cache: (k_mean, v_mean) float32 [slots, Hkv, D] (sparse_prefill.mean_cache), paged KV only."""
    info = (ctypes.c_longlong * 12)()
    args = _call_args(q, k, v, q, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      block_table=block_table, seqused_k=seqused_k)
    _check(lib().sp_cuda_build_index, args + [float(alpha), int(block_size), int(sink), int(window), int(last_n),
                                               int(bool(correction)), int(bool(final_chunk)), int(bool(union)),
                                               int(head_subgroups), _ptr(ws), ws.numel(), info,
                                               _ptr(mean_cache[0] if mean_cache else None),
                                               _ptr(mean_cache[1] if mean_cache else None)])
    hkv = k.shape[-2]
    return DeviceIndex(ws, list(info), cu_seqlens_q.numel() - 1, hkv, q.shape[2], q.dtype, bool(correction),
                       int(head_subgroups))


def sparse_attention(q, k, v, index, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out=None, lse=None,
                     return_lse=False, correction=None, block_table=None, seqused_k=None):
    """Sparse attention over a device index (DeviceIndex, or any object with the same torch attributes)."""
    if out is None:
        out = torch.empty_like(q)
    if return_lse and lse is None:
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    corr = index.correction if correction is None else correction
    args = _call_args(q, k, v, out, lse if return_lse else None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k, block_table=block_table, seqused_k=seqused_k)
    _check(lib().sp_cuda_sparse_attention,
           args + [_ptr(index.segment_start), _ptr(index.segment_end), _ptr(index.block_ids), _ptr(index.cu_tiles),
                   _ptr(index.cu_blocks), _ptr(index.k_mean), _ptr(index.v_mean), int(index.mean_rows),
                   int(index.block_size), int(bool(corr)), int(getattr(index, "head_subgroups", 1))])
    return (out, lse) if return_lse else out

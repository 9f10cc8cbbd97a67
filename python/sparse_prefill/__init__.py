"""SparsePrefill: fast prefill of long prompts — dense attention, block-sparse prefill (FlashPrefill V2) and
chunked-prefill block union — for numpy, torch, cupy and jax arrays.

    import sparse_prefill as sp
    out, lse = sp.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal=True, softmax_scale=None, window=(-1, -1), out=None, return_lse=True)
    out = sp.attention(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k,
                       block_table=block_table, seqused_k=seqused_k)                      # paged KV
    index = sp.build_index(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)  # selection keywords:
                                  # help(sp.build_index), "Selection arguments"; their defaults: sp.SELECTION_DEFAULTS
    out = sp.sparse_attention(q, k, v, index, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = sp.sparse_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)   # both in one call
    sel = sp.Selection(alpha=0.01, block_size=128)      # the selection as one validated value: selection=sel
    out = sp.chunked_prefill(q_chunk, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_chunk,
                             max_cache, final_chunk=False)                              # one chunked-prefill step
    means = sp.mean_cache(k_cache, block_size=128)      # pooled-means cache: pass mean_cache=means to every step
    q, k, v = sp.workload.topic(8192, num_q_heads=32, num_kv_heads=8, head_dim=128, seed=0)

CPU arrays run the exact CPU reference backend; CUDA arrays run the CUDA backend where it implements the call
(otherwise NotImplementedError). Every function documents its arguments (help(sp.attention));
sparse_prefill._api holds the shapes, masking and error conventions.

dtypes: q/k/v are float32 (CPU only), float16 or bfloat16 (or float8_e4m3fn, or its uint8 bit patterns with
qkv_dtype='float8_e4m3fn' for array libraries without float8); float64 is refused with a TypeError naming the
argument. Index arrays (cu_seqlens_q/k, block_table, seqused_k) are int32; numpy's default int64 is accepted
on the host and converted to int32 (a small host copy) when every value fits, and refused on CUDA ("pass int32").

Install: `pip install .` (or `pip install -e .` for development) from the repository root; a plain CMake build
(`bash scripts/build.sh`) writes the extension into python/sparse_prefill for `PYTHONPATH=python`.
"""

from typing import NamedTuple


def _load_extension():
    """The compiled extension sparse_prefill._C, or an ImportError that says how to build it."""
    try:
        from . import _C as ext
    except ImportError:
        import glob
        import importlib.util
        import os
        if importlib.util.find_spec(__name__ + "._C") is not None:
            raise  # the extension is there but does not load: the original error says why
        here = os.path.dirname(os.path.abspath(__file__))
        others = sorted(os.path.basename(f) for f in glob.glob(os.path.join(here, "_C*")) if not f.endswith(".py"))
        note = (f" (found {', '.join(others)}: built for another Python version or platform)" if others else "")
        raise ImportError(
            f"sparse_prefill: the compiled extension sparse_prefill._C is missing from {here}{note}. This looks like a "
            "source tree that has not been built. Build and install it from the repository root with "
            "`pip install .` (or `pip install -e .` for an editable development install), or build it in place "
            "with `bash scripts/build.sh` and use PYTHONPATH=python.", name=__name__ + "._C", path=here) from None
    return ext


_C = _load_extension()
del _load_extension
from ._api import (SELECTION_DEFAULTS, Index, LaunchOptions, MeanCache, Selection, attention, attention_path,
                   attention_workspace_bytes, build_index, check_errors, chunked_prefill, chunked_prefill_workspace_bytes, index_workspace_bytes, mean_cache, pool_kv,
                   sparse_attention, sparse_attention_workspace_bytes, sparse_prefill, sparse_prefill_workspace_bytes,
                   sparse_support, union_index, fp8_attention_support)
from . import workload
from .fp8 import quantize_fp8

with_cuda: bool = bool(_C.with_cuda)
"""True when the extension was built with the CUDA backend."""

HEAD_DIMS: tuple = tuple(_C.HEAD_DIMS)
"""The head dims every call takes (q, k and v's last dimension), on every backend: the C++ list the checks read
(include/sparse_prefill/attention.h kHeadDims). The engine adapters route other head dims to their own attention."""


class CudaLimits(NamedTuple):
    """What the CUDA kernels are built for beyond HEAD_DIMS (include/sparse_prefill/attention.h CudaLimits, the
    values src/cuda/support.cpp's checks read), for callers that choose a layout before they call: an engine's page
    size, an adapter's dtype or head-dim padding. The CPU reference takes every dtype, head dim and page size. Whether
    one call runs sparse is sparse_support's answer; these are its parts that do not depend on a call."""
    dtypes: tuple            # q, k, v dtypes of every CUDA kernel, by name ("bfloat16", ...): no float32 kernels
    sparse_head_dims: tuple  # head dims of the block-sparse and FP8 kernels (16-bit dense attention takes HEAD_DIMS)
    page_multiple: int       # paged KV of the block-sparse and FP8 kernels: page_size a multiple of it


CUDA_LIMITS: CudaLimits = CudaLimits(**_C.CUDA_LIMITS)

__version__ = "0.1.0"

__all__ = ["quantize_fp8", "attention", "attention_path", "attention_workspace_bytes", "build_index", "index_workspace_bytes", "sparse_attention",
           "sparse_attention_workspace_bytes", "sparse_prefill", "sparse_prefill_workspace_bytes", "sparse_support", "fp8_attention_support", "chunked_prefill",
           "chunked_prefill_workspace_bytes", "union_index", "pool_kv", "mean_cache", "MeanCache", "Index", "Selection", "LaunchOptions",
           "check_errors",
           "workload", "with_cuda", "HEAD_DIMS", "CUDA_LIMITS", "CudaLimits", "__version__", "SELECTION_DEFAULTS"]

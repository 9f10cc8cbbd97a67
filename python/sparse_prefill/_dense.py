"""Dense attention: attention(), attention_path(), attention_workspace_bytes(), fp8_attention_support() (conventions:
sparse_prefill._api)."""

from __future__ import annotations

from typing import Optional, Tuple

from . import _C
from ._call import LaunchOptions, _Call, _as_bool, _as_int, _as_int32, _kv_arrays


def attention_workspace_bytes(head_dim: int = 128) -> int:
    """Bytes of the `workspace` that attention() may use on the current CUDA device (0 without a CUDA build or GPU).

    Args:
        head_dim: D of the calls the workspace serves (default 128).
    """
    return int(_C.attention_workspace_bytes(_as_int32("head_dim", head_dim)))


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
              softmax_scale: Optional[float] = None, window: Tuple[int, int] = (-1, -1), out=None,
              return_lse: bool = False, block_table=None, seqused_k=None, stream=None, workspace=None,
              options: Optional[LaunchOptions] = None, q_descale=None, k_descale=None, v_descale=None,
              qkv_dtype=None):
    """Dense varlen attention: out = softmax(q k^T * softmax_scale + mask) v, per sequence and query head.

    Args:
        q: [total_q, Hq, D] queries (float32, float16, bfloat16 or float8_e4m3fn; see q_descale and qkv_dtype).
        k, v: contiguous [total_k, Hkv, D] or, with `block_table`, paged [num_pages, page_size, Hkv, D]
            (any page_size >= 1; on CUDA pages of a multiple of 64 tokens load by TMA, other sizes such as 16 or 1 by
            a cp.async gather, see docs/design/dense_kernel.md). Query head h reads KV head h // (Hq // Hkv).
        cu_seqlens_q: [B+1] int32 offsets of the sequences in q.
        cu_seqlens_k: [B+1] int32 offsets in k/v; must be None with paged KV.
        max_seqlen_q, max_seqlen_k: upper bounds of the per-sequence lengths (checked on the CPU). On CUDA they also
            pick the kernel: short queries against longer keys (decode, small chunks; D = 128, no window, pages of a
            multiple of 64) run on PackGQA tiles with split-KV, whose float32 partials (~35 MB) live in `workspace`
            or, without it, in a stream-ordered temporary taken per call.
        causal: bottom-right aligned causal mask.
        softmax_scale: default 1/sqrt(D).
        window: sliding window (left, right) in the causal alignment; -1 = unbounded.
        out: optional [total_q, Hq, D] array of q's dtype (bfloat16 for FP8 inputs; uint16 bfloat16 bit patterns, or
            bfloat16, with qkv_dtype), written in place and returned.
        return_lse: also return lse [Hq, total_q] float32 (default False, like flash_attn_varlen_func).
        block_table: [B, max_pages] int32 page ids (paged KV).
        seqused_k: [B] int32 key lengths (paged KV).
        stream: CUDA stream (int handle, torch.cuda.Stream or cupy Stream); default: the caller library's current
            stream (torch.cuda.current_stream() for torch) for CUDA arrays.
        workspace: optional scratch array on q's device (CUDA; ignored on the CPU), contiguous, 1-D, any dtype, at
            least attention_workspace_bytes(D) bytes, 256-byte aligned (torch and cupy allocations are), e.g.
            torch.empty(sp.attention_workspace_bytes(128) // 4, dtype=torch.int32, device="cuda"). Allocate it once
            and pass it to every call on one stream: the launch path then allocates nothing.
        options: LaunchOptions (CUDA kernel choices for A/B runs; default: the measured best).
        q_descale, k_descale, v_descale: FP8 inputs (q, k, v all float8_e4m3fn, e.g. from quantize_fp8()): float32
            [B, Hkv] arrays of any strides (0 broadcasts a per-tensor scale), the factor each stored value is
            multiplied by (query head h uses column h // (Hq // Hkv), FA3's convention); None = 1. Refused for other
            dtypes. The same keywords exist on build_index, sparse_attention, sparse_prefill and chunked_prefill.
            FP8 runs on the CPU reference (the exact math on the dequantised values) and, on CUDA, on the FP8
            kernels for head dim 128 with contiguous KV or page_size % 64 == 0: dense here, block-sparse in
            sparse_attention, sparse_prefill and chunked_prefill (the CUDA index stage of build_index takes FP8 at
            head dim 128 with any page size); other CUDA FP8 combinations (head dim 64, other page sizes) raise
            NotImplementedError (docs/semantics.md, "FP8 inputs").
        qkv_dtype: None (default: q, k, v are what their dtype says) or 'float8_e4m3fn' (or torch.float8_e4m3fn):
            q, k and v are uint8 arrays of float8_e4m3fn bit patterns, for array libraries without float8 (numpy,
            cupy; sp.quantize_fp8 of a numpy array makes them). They are read as float8_e4m3fn without a copy, so
            the call equals the float8 call on the same bits; the output is then uint16 bfloat16 bit patterns
            (float32 values: (out.astype(np.uint32) << 16).view(np.float32)). Each of q, k, v must be uint8 (else a
            TypeError naming it). The same keyword exists on every function that takes q, k, v.

    Returns:
        out, or (out, lse) when return_lse is True. Outputs are arrays of q's library on q's device.
    """
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                            (q_descale, k_descale, v_descale)), out, qkv_dtype=qkv_dtype)
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, stream, options)
    return_lse = _as_bool("return_lse", return_lse)
    out_c, lse, out_ret = call.outputs(out, return_lse)
    _C.attention(inputs, call.c_out(out_c), call.c(lse), workspace=call.c(call.workspace(workspace)))
    return call.result(out_c, lse, out_ret, return_lse)


def fp8_attention_support(head_dim: int, page_size: Optional[int] = None) -> Optional[str]:
    """Whether the CUDA backend's FP8 (float8_e4m3fn) attention kernels, dense and block-sparse, are built for this
    head dim and KV layout: None when they are, else why not (the NotImplementedError message a call would raise; in
    a build without CUDA, that it has none). By dimensions alone, for engines that set a layer up before its first
    call. The CPU reference computes every FP8 configuration.

    Args:
        head_dim: D.
        page_size: the page size of a paged KV cache; None for contiguous KV.
    """
    page = 0 if page_size is None else _as_int("page_size", page_size)
    if page_size is not None and page < 1:
        raise ValueError(f"page_size: must be >= 1 (None: contiguous KV), got {page}")
    return _C.fp8_attention_support(_as_int32("head_dim", head_dim), page) or None


def attention_path(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                   window: Tuple[int, int] = (-1, -1), block_table=None, seqused_k=None,
                   options: Optional[LaunchOptions] = None, qkv_dtype=None) -> str:
    """Which kernel attention() runs for these arguments: 'dense' (one 128-row tile per query head) or 'split_kv'
    (PackGQA tiles with split-KV; CUDA only). For tests and benchmarks; reads shapes only.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, block_table, seqused_k,
            options, qkv_dtype: as in attention().
    """
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k), qkv_dtype=qkv_dtype)
    return str(_C.attention_path(call.inputs(max_seqlen_q, max_seqlen_k, causal, None, window, 0, options)))


"""FP8 (float8_e4m3fn) inputs: quantize_fp8() for callers whose q / KV cache is not FP8 yet.

The attention functions take FP8 q, k, v with float32 descales of shape [B, Hkv] (docs/semantics.md, "FP8"):
the value attended to is stored value * descale. quantize_fp8 picks the scale from the amax, per KV head (or per
tensor), so that the largest magnitude maps to 448, e4m3's largest finite value. For numpy (no float8 dtype) it
returns the uint8 bit patterns that the attention functions read with qkv_dtype='float8_e4m3fn'.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_F32_MAX = float(np.finfo(np.float32).max)
_NUMPY_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _e4m3_bits(x: Any) -> np.ndarray:
    """float8_e4m3fn bit patterns (uint8) of x cast to float32, as torch's float -> float8_e4m3fn cast: round to
    nearest, ties to even; finite magnitudes past 448 and infinities saturate to 448 (0x7E); NaN is 0x7F; the
    sign bit is kept (-0.0 -> 0x80)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.view(np.uint32)
    sign = ((b >> 24) & 0x80).astype(np.uint8)
    a = b & np.uint32(0x7FFFFFFF)                                    # |x| as float32 bits
    # |x| >= 2^-6 (e4m3 normals): the float32 exponent and mantissa rounded to 3 bits (a carry moves the exponent)
    normal = ((a + np.uint32(0x7FFFF) + ((a >> 20) & 1)) >> 20).astype(np.int64) - ((127 - 7) << 3)
    # |x| < 2^-6 (subnormals, multiples of 2^-9): exact scaling, then np.rint (ties to even); fmin keeps NaN and
    # large values out of the integer cast (they take the other branches)
    sub = np.rint(np.fmin(np.abs(x), np.float32(2.0 ** -6)) * np.float32(512)).astype(np.int64)
    code = np.minimum(np.where(a < 0x3C800000, sub, normal), 0x7E)  # 0x3C800000 = 2^-6; 0x7E = 448
    code = np.where(a > 0x7F800000, 0x7F, code)                      # NaN
    return code.astype(np.uint8) | sign


def quantize_fp8(x: Any, batch: int = 1, num_kv_heads: Optional[int] = None,
                 per_head: bool = True) -> Tuple[Any, Any]:
    """(x_fp8, descale): x cast to float8_e4m3fn after scaling, and the float32 [batch, Hkv] descale to pass as
    q_descale / k_descale / v_descale (x ~= x_fp8 * descale).

    Args:
        x: a torch tensor [tokens, H, D] (q, or contiguous k / v) or [num_pages, page_size, H, D] (a paged cache),
            float32, float16 or bfloat16; or a numpy array of those shapes (float16, float32, float64 or ml_dtypes'
            bfloat16): numpy has no float8 dtype, so x_fp8 is then a uint8 array of the float8_e4m3fn bit patterns,
            to pass with qkv_dtype='float8_e4m3fn', and descale a float32 numpy array. Both give the same bits and
            descales for the same values (the same float32 arithmetic; the cast rounds to nearest even, as torch's).
        batch: the number of sequences B of the calls the descale is for (the descale is broadcast over them:
            stride 0 along B).
        num_kv_heads: Hkv; for q, the number of KV heads (the Hq // Hkv query heads of a group share one descale,
            FA3's convention). Default: x's head count (k, v).
        per_head: one scale per KV head (default) or one for the whole tensor.

    The scale comes from amax over the tokens (and the heads of a group): no host synchronisation. An all-zero group
    gets zeros (and descale 1 / float32 max); NaN or inf in x make its descale NaN (and so the attention output).
    """
    is_numpy = isinstance(x, np.ndarray)
    torch = None
    if not is_numpy:
        import sys
        torch = sys.modules.get("torch")  # a torch tensor means torch is loaded
        if torch is None or not isinstance(x, torch.Tensor):
            raise TypeError(f"x: quantize_fp8 takes a torch tensor or a numpy array, got {type(x).__name__}")
    if x.ndim not in (3, 4):
        raise ValueError(f"x: expected [tokens, H, D] or [num_pages, page_size, H, D], got shape {tuple(x.shape)}")
    if is_numpy and x.dtype.name not in _NUMPY_FLOATS:
        raise TypeError(f"x: expected float16, float32, float64 or bfloat16, got {x.dtype}")
    if not is_numpy and (not x.is_floating_point() or x.dtype == torch.float8_e4m3fn):
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: must be an int >= 1, got {batch!r}")
    heads = x.shape[-2]
    hkv = heads if num_kv_heads is None else num_kv_heads
    if isinstance(hkv, bool) or not isinstance(hkv, int) or hkv < 1 or heads % hkv != 0:
        raise ValueError(f"num_kv_heads: must divide x's {heads} heads, got {num_kv_heads!r}")
    if is_numpy:
        return _quantize_numpy(x, batch, heads, hkv, per_head)
    xf = x.float()
    reduce = [d for d in range(x.dim()) if d != x.dim() - 2]
    amax = xf.abs().amax(dim=reduce)                        # [H]
    amax = amax.view(hkv, heads // hkv).amax(dim=1)         # [Hkv]: a group's query heads share a scale
    if not per_head:
        amax = amax.amax().expand(hkv)
    scale = FP8_MAX / amax.clamp_min(FP8_MAX / torch.finfo(torch.float32).max)  # finite, also for amax 0
    per_row_head = scale.repeat_interleave(heads // hkv)    # [H]
    shape = [1] * x.dim()
    shape[-2] = heads
    x8 = (xf * per_row_head.view(shape)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    descale = (1.0 / scale).view(1, hkv).expand(batch, hkv)
    return x8, descale


def _quantize_numpy(x: np.ndarray, batch: int, heads: int, hkv: int, per_head: bool) -> Tuple[np.ndarray, np.ndarray]:
    """quantize_fp8 for numpy, step by step as the torch code above (float32 throughout)."""
    xf = np.asarray(x, dtype=np.float32)
    reduce = tuple(d for d in range(x.ndim) if d != x.ndim - 2)
    amax = np.abs(xf).max(axis=reduce, initial=np.float32(0))       # [H]; NaN propagates
    amax = amax.reshape(hkv, heads // hkv).max(axis=1)              # [Hkv]: a group's query heads share a scale
    if not per_head:
        amax = np.full(hkv, amax.max(), np.float32)
    # torch computes `448 / t` as t.reciprocal() * 448: the same two float32 roundings here
    scale = (np.float32(1) / np.maximum(amax, np.float32(FP8_MAX / _F32_MAX))) * np.float32(FP8_MAX)
    shape = [1] * x.ndim
    shape[-2] = heads
    x8 = _e4m3_bits(np.clip(xf * np.repeat(scale, heads // hkv).reshape(shape), -FP8_MAX, FP8_MAX))
    descale = np.broadcast_to((np.float32(1) / scale).reshape(1, hkv), (batch, hkv))
    return x8, descale

"""FP8 (float8_e4m3fn) inputs: quantize_fp8() for callers whose q / KV cache is not FP8 yet.

The attention functions take FP8 q, k, v with float32 descales of shape [B, Hkv] (docs/semantics.md, "FP8"):
the value attended to is stored value * descale. quantize_fp8 picks the scale from the amax, per KV head (or per
tensor), so that the largest magnitude maps to 448, e4m3's largest finite value.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: Any, batch: int = 1, num_kv_heads: Optional[int] = None,
                 per_head: bool = True) -> Tuple[Any, Any]:
    """(x_fp8, descale): x cast to float8_e4m3fn after scaling, and the float32 [batch, Hkv] descale to pass as
    q_descale / k_descale / v_descale (x ~= x_fp8 * descale).

    Args:
        x: a torch tensor [tokens, H, D] (q, or contiguous k / v) or [num_pages, page_size, H, D] (a paged cache).
        batch: the number of sequences B of the calls the descale is for (the descale is broadcast over them:
            stride 0 along B).
        num_kv_heads: Hkv; for q, the number of KV heads (the Hq // Hkv query heads of a group share one descale,
            FA3's convention). Default: x's head count (k, v).
        per_head: one scale per KV head (default) or one for the whole tensor.

    The scale comes from amax over the tokens (and the heads of a group): no host synchronisation. An all-zero group
    gets zeros (and descale 1 / float32 max); NaN or inf in x make its descale NaN (and so the attention output).
    """
    import torch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: quantize_fp8 takes a torch tensor (numpy has no float8 dtype), got {type(x).__name__}")
    if x.dim() not in (3, 4):
        raise ValueError(f"x: expected [tokens, H, D] or [num_pages, page_size, H, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == torch.float8_e4m3fn:
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: must be an int >= 1, got {batch!r}")
    heads = x.shape[-2]
    hkv = heads if num_kv_heads is None else num_kv_heads
    if isinstance(hkv, bool) or not isinstance(hkv, int) or hkv < 1 or heads % hkv != 0:
        raise ValueError(f"num_kv_heads: must divide x's {heads} heads, got {num_kv_heads!r}")
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

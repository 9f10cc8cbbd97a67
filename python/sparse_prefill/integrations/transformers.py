"""Hugging Face transformers adapter: `attn_implementation="sparse_prefill"`.

    import sparse_prefill.integrations.transformers as spt_hf
    spt_hf.register()                                  # or register(alpha=0.05, dense_layers=2, ...)
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sparse_prefill", dtype=torch.bfloat16)

`register()` registers the attention function in `AttentionInterface` AND `masking_utils.flash_attention_mask` in
`AttentionMaskInterface` under the same name: with the first alone transformers builds no mask for an unknown name
and the function gets `attention_mask=None` even for a left-padded batch (padding silently lost).

What the attention function does with transformers' call (`[B, H, L, D]` in, `([B, Lq, Hq, D], None)` out):
- GQA from the shapes (Hq = query.shape[1], Hkv = key.shape[1]; the kernels read KV head h // (Hq // Hkv)).
- No mask: the batch is a uniform varlen batch (cu_seqlens = arange(B + 1) * L), bottom-right causal, so a generate
  step (q_len 1 against the whole cache) is exact.
- The 2-D mask of `flash_attention_mask` ([B, Lk], padding): each row's valid keys must be one contiguous range
  [s_b, e_b) (left padding, right padding, a StaticCache's unwritten tail; a mask with holes trips a device-side
  assert). Instead of gathering the valid rows (FA2's `_upad_input`, which synchronises the host), each row becomes
  three varlen sequences, [0, s_b), [s_b, e_b) and [e_b, Lk), over the same memory: no copy, no host sync. The
  queries are the last positions of the valid range (they end at e_b; at position i when Lq == Lk). Rows of the
  padding sequences attend among padding: their outputs are finite and meaningless, as with sdpa.
- Packed batches (`cu_seq_lens_q/k` and `max_length_q/k` kwargs, padding-free training-style packing): used as given.
- Sliding window (`sliding_window` kwarg): dense with window (sliding_window - 1, 0), transformers' FA convention.
- Unsupported by the kernels: head dim other than 64 and 128, float32 on CUDA, dropout > 0 or autograd, softcap,
  attention sinks (`s_aux`). With `fallback='sdpa'` (default) these calls run transformers' sdpa after a one-time
  warning; with `fallback='raise'` they raise NotImplementedError.
"""

from __future__ import annotations

from typing import Optional

from .. import CUDA_LIMITS, HEAD_DIMS
from .core import SparsePrefillConfig, VarlenDispatch, warn_once

__all__ = ["register", "attention_forward", "make_attention_forward", "varlen_layout"]

_DISPATCH: Optional[VarlenDispatch] = None


def register(name: str = "sparse_prefill", config: Optional[SparsePrefillConfig] = None, **kwargs) -> VarlenDispatch:
    """Register `name` with transformers (attention function and mask function) and return the dispatch it uses
    (its `config`, `calls` and `last_path` are there to inspect).

    Args:
        name: the attn_implementation name to register (default "sparse_prefill").
        config: a SparsePrefillConfig; default SparsePrefillConfig.load(**kwargs).
        **kwargs: settings for SparsePrefillConfig.load() (selection and engine fields) when config is None.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    global _DISPATCH
    dispatch = VarlenDispatch(config if config is not None else SparsePrefillConfig.load(**kwargs))
    if name == "sparse_prefill":
        _DISPATCH = dispatch
    AttentionInterface.register(name, make_attention_forward(dispatch))
    AttentionMaskInterface.register(name, flash_attention_mask)
    return dispatch


class _Layouts:
    """The varlen layout of the last mask seen, reused by every layer of one forward (the same mask object)."""

    def __init__(self):
        self.key = None
        self.mask = None
        self.value = None

    def get(self, attention_mask, B, Lq, Lk, device):
        key = (B, Lq, Lk, str(device))
        if self.key == key and self.mask is attention_mask and self.value is not None:
            return self.value
        value = varlen_layout(attention_mask, B, Lq, Lk, device)
        self.key, self.mask, self.value = key, attention_mask, value
        return value


def varlen_layout(attention_mask, B: int, Lq: int, Lk: int, device):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of the batch [B, Lq] queries against [B, Lk] keys laid
    out contiguously (row b's keys at rows b*Lk .. b*Lk + Lk of the flattened tensor). No mask: B sequences. A 2-D
    mask [B, Lm] (Lm <= Lk; columns past Lm are padding): 3B sequences, see the module docstring. Device ops only."""
    import torch
    i32 = dict(dtype=torch.int32, device=device)
    if attention_mask is None:
        return (torch.arange(B + 1, **i32) * Lq, torch.arange(B + 1, **i32) * Lk, Lq, Lk)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] > Lk:
        raise ValueError(f"attention_mask: expected the 2-D padding mask [B={B}, <= {Lk}] of flash_attention_mask, got "
                         f"shape {tuple(attention_mask.shape)} (register the mask function: register() does)")
    m = attention_mask.to(device=device, dtype=torch.int32)
    if m.shape[1] < Lk:
        m = torch.nn.functional.pad(m, (0, Lk - m.shape[1]))
    n = m.sum(1)
    first = m.argmax(1)
    last = Lk - 1 - m.flip(1).argmax(1)
    s = torch.where(n > 0, first, torch.full_like(first, Lk))
    e = s + n
    torch._assert_async(((n == 0) | (last + 1 == e)).all(),
                        "sparse_prefill: attention_mask rows must hold one contiguous range of valid keys")
    qoff = torch.clamp(e - Lq, min=0)
    q0 = torch.clamp(s - qoff, 0, Lq)
    q1 = torch.clamp(e - qoff, 0, Lq)
    rows = torch.arange(B, device=device, dtype=s.dtype)
    ko, qo = rows * Lk, rows * Lq
    cu_k = torch.stack([ko, ko + s, ko + e], 1).reshape(-1)
    cu_q = torch.stack([qo, qo + q0, qo + q1], 1).reshape(-1)
    end_k = torch.full((1,), B * Lk, dtype=s.dtype, device=device)
    end_q = torch.full((1,), B * Lq, dtype=s.dtype, device=device)
    return (torch.cat([cu_q, end_q]).to(torch.int32), torch.cat([cu_k, end_k]).to(torch.int32), Lq, Lk)


def _unsupported(query, dropout, kwargs) -> Optional[str]:
    import torch
    d = query.shape[-1]
    if d not in HEAD_DIMS:
        return f"head dim {d} (the kernels take {', '.join(map(str, HEAD_DIMS))})"
    if query.dtype.itemsize == 1:
        return f"dtype {query.dtype} (this adapter passes no FP8 descales)"
    if query.is_cuda and str(query.dtype).removeprefix("torch.") not in CUDA_LIMITS.dtypes:
        return f"dtype {query.dtype} on CUDA (the CUDA kernels take {', '.join(CUDA_LIMITS.dtypes)})"
    if dropout:
        return f"dropout {dropout}"
    if torch.is_grad_enabled() and query.requires_grad:
        return "autograd (the kernels are forward only)"
    if kwargs.get("softcap"):
        return "softcap"
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        return "attention sinks"
    return None


def _sdpa_fallback(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """transformers' sdpa with the 4-D mask it expects (we registered the flash-style 2-D padding mask): bottom-right
    causal and padding, so chunked prompts against a cache stay right too."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    B, Lq, Lk = query.shape[0], query.shape[2], key.shape[2]
    mask4 = None
    if Lq > 1 or attention_mask is not None:
        i = torch.arange(Lq, device=query.device)[:, None]
        j = torch.arange(Lk, device=query.device)[None, :]
        mask4 = (j <= i + (Lk - Lq))[None, None].expand(B, 1, Lq, Lk)
        if attention_mask is not None:
            pad = attention_mask.to(device=query.device, dtype=torch.bool)
            pad = torch.nn.functional.pad(pad, (0, Lk - pad.shape[1]))
            mask4 = mask4 & pad[:, None, None, :]
    kwargs = {k: v for k, v in kwargs.items() if k not in ("is_causal",)}
    return sdpa_attention_forward(module, query, key, value, mask4, scaling=scaling, dropout=dropout,
                                  is_causal=False, **kwargs)


def make_attention_forward(dispatch: VarlenDispatch):
    layouts = _Layouts()

    def sparse_prefill_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                         **kwargs):
        import torch
        why = _unsupported(query, dropout, kwargs)
        if why is not None:
            if dispatch.config.fallback == "raise":
                raise NotImplementedError(f"sparse_prefill: {why} is not supported (fallback='raise')")
            warn_once("hf:" + why, f"sparse_prefill: {why} is not supported by the kernels; running transformers' "
                      "sdpa for these calls (set fallback='raise' to make this an error)")
            return _sdpa_fallback(module, query, key, value, attention_mask, scaling, dropout, kwargs)
        B, Hq, Lq, D = query.shape
        Hkv, Lk = key.shape[1], key.shape[2]
        q = query.transpose(1, 2).reshape(B * Lq, Hq, D)
        k = key.transpose(1, 2).reshape(B * Lk, Hkv, D)
        v = value.transpose(1, 2).reshape(B * Lk, Hkv, value.shape[-1])
        if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
            cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
            cu_k = kwargs["cu_seq_lens_k"].to(torch.int32)
            max_q, max_k = int(kwargs.get("max_length_q") or Lq), int(kwargs.get("max_length_k") or Lk)
        else:
            cu_q, cu_k, max_q, max_k = layouts.get(attention_mask, B, Lq, Lk, query.device)
        sw = kwargs.get("sliding_window")
        window = (int(sw) - 1, 0) if sw else (-1, -1)
        out = torch.empty(B * Lq, Hq, v.shape[-1], dtype=query.dtype, device=query.device)
        dispatch(q, k, v, cu_q, cu_k, max_q, max_k, out=out, layer_idx=getattr(module, "layer_idx", None),
                 softmax_scale=scaling, window=window)
        return out.view(B, Lq, Hq, v.shape[-1]), None

    sparse_prefill_attention_forward.dispatch = dispatch
    return sparse_prefill_attention_forward


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function `register()` installs, with the dispatch of the last `register()` (a default one otherwise)."""
    global _DISPATCH
    if _DISPATCH is None:
        _DISPATCH = VarlenDispatch()
    return make_attention_forward(_DISPATCH)(module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)

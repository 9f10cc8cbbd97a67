"""torch.library operators for SparsePrefill: torch.compile, CUDA graphs and torch's allocator.

    import sparse_prefill.torch_ops as spt          # registers torch.ops.sparse_prefill.*
    out = spt.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = spt.sparse_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alpha=0.1)
    out = spt.chunked_prefill(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_chunk, max_cache,
                              final_chunk=False, mean_cache=means)

The wrappers take the arguments and defaults of sparse_prefill.attention / sparse_prefill / chunked_prefill (torch
tensors only; `selection=` or the selection keywords, as there; no `stream` (the current torch stream is used), no
`workspace` (see below), no `return_index`) and call these operators, each with a fake (meta) implementation for
tracing. The operators take the selection's fields as keyword-only arguments (rule as its int: 0 tile_energy,
1 row_max, 2 probe_row_max, 3 probe_row_mass, 4 key_max, 5 exact_max; max_kept_blocks -1 for None):

    torch.ops.sparse_prefill.attention(...)           -> (out, lse)
    torch.ops.sparse_prefill.attention_out(..., out)  -> lse          (out written in place; mutates_args=out)
    torch.ops.sparse_prefill.sparse_prefill(...)      -> (out, lse)   (mutates mean_k, mean_v: the mean cache)
    torch.ops.sparse_prefill.sparse_prefill_out(...)  -> lse
    torch.ops.sparse_prefill.chunked_prefill(...)     -> (out, lse)
    torch.ops.sparse_prefill.chunked_prefill_out(...) -> lse

out is [total_q, Hq, D] in q's dtype (bfloat16 for float8_e4m3fn inputs, which take q_descale, k_descale and
v_descale as the public functions do); lse is [Hq, total_q] float32 when return_lse is set, else an empty [0]
float32 tensor (an operator returns the same structure on every call). The mean cache travels as two optional
tensors (mean_k, mean_v) and the block size it was made for (mean_block_size, a MeanCache's; 0: not known) instead of
the pair `mean_cache`.

Workspace rule: on CUDA every operator takes the library's scratch memory from torch's caching allocator
(torch.empty on q's device, sized by the shape-only *_workspace_bytes functions) and passes it as `workspace`, so a
call allocates nothing outside torch and can be captured in a torch.cuda.CUDAGraph (the scratch then lives in the
graph's private pool). On the CPU no workspace is needed. The sizes are cached per shape in one dict (_ws_bytes). The
engine adapters (sparse_prefill.integrations: VarlenDispatch) run their calls through these operators, so they follow
the same rule and keep no buffer of their own.

Host cost: the operators are the launch path of engines (a chunked step at 128K takes ~55 us of GPU time), so their
Python side is kept short: the tensors go to the extension as DLPack capsules made by torch's C to_dlpack (~1.3 us
per array, against ~6 us when the extension calls Tensor.__dlpack__, on a CPU-only test machine), the generic
array-library detection of sparse_prefill._api is skipped (the schema already guarantees torch tensors, ints,
floats and bools; the extension validates shapes, dtypes and devices once in C++), the selection arguments find
their Selection in the library's one selection cache (sparse_prefill._selection), and workspace sizes are cached
per shape. The operators are registered through torch.library.Library (a CompositeExplicitAutograd kernel) and
torch.library.register_fake; torch.library.custom_op would add a Python autograd layer and an aliasing check to
every call (~8-10 us on the CPU-only machine; bench/bench_host_overhead.py --custom-op compares both on the GPU
machine). They are forward only: autograd passes through them, so their outputs never require grad.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Tuple

import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from . import HEAD_DIMS, _C
from . import _api
from ._call import make_inputs as _make_inputs
from ._selection import _TABLE as _SELECTION_TABLE
from ._selection import _op_fields as _fields_of_selection
from ._selection import _selection, _selection_of_op_fields, selection_keywords

__all__ = ["attention", "sparse_prefill", "chunked_prefill", "OPS"]

_NS = "sparse_prefill"
_F32 = torch.float32
_I32 = torch.int32
_CONTIGUOUS = torch.contiguous_format
_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1
# The selection: the operators' schemas list its fields keyword-only (_selection_schema(), from the library's one
# table, defaults the C++ SelectionParams{}'s), the kernels take them as **fields, and the wrappers take `selection=`
# or the selection keywords as the public functions do (checked by the same _selection(), with its <library default>
# sentinel: a keyword beside `selection=` raises) and pass the fields that differ from the defaults.


# ---------------------------------------------------------------------------------------------------------------------
# Per-call helpers (kept flat: every line here runs on each launch)
# ---------------------------------------------------------------------------------------------------------------------

def _out_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype  # FP8 inputs give bfloat16 outputs


def _dl(t: Optional[torch.Tensor]) -> Any:
    return None if t is None else _to_dlpack(t)


try:  # the raw cudaStream_t of torch's current stream, without building a torch.cuda.Stream object
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - CPU-only torch builds
    def _raw_stream(device_index: int) -> int:
        return int(torch.cuda.current_stream(device_index).cuda_stream)


# The workspace policy of the operators, and through them of the engine adapters (integrations.core): a call's scratch
# memory is a torch.empty from torch's caching allocator on q's device, sized by the shape-only *_workspace_bytes
# functions. Sizes depend on shapes and parameters only, never on values, so they are cached here, in the one dict of
# workspace sizes: (head_dim, device) for attention, a call's shapes and selection for the sparse operators (tuples of
# two and of 13 entries: the two kinds of key never meet).
_ws_bytes: dict = {}


def _remember_bytes(key: tuple, n: int) -> None:
    if len(_ws_bytes) >= 4096:  # engines step through many lengths: keep the cache bounded
        _ws_bytes.clear()
    _ws_bytes[key] = n


def _scratch(n: int, q: torch.Tensor) -> torch.Tensor:
    # int32 elements: the extension accepts float / int32 arrays only (not uint8); 256-byte alignment is guaranteed by
    # torch's allocator
    return torch.empty(((n + 3) // 4 or 1,), dtype=_I32, device=q.device)


def _attention_workspace(head_dim: int, q: torch.Tensor, device_index: int) -> Optional[torch.Tensor]:
    if head_dim not in HEAD_DIMS:
        return None  # the call itself raises, naming q's head dim
    key = (head_dim, device_index)
    n = _ws_bytes.get(key)
    if n is None:
        with torch.cuda.device(device_index):
            n = int(_api.attention_workspace_bytes(head_dim))
        _remember_bytes(key, n)
    return _scratch(n, q)


def _sparse_workspace(inputs, sel, sel_key, q, k, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q,
                      max_seqlen_k, causal, softmax_scale, device_index) -> torch.Tensor:
    key = (q.shape, k.shape, q.dtype, k.dtype, cu_seqlens_q.shape,
           None if cu_seqlens_k is None else cu_seqlens_k.shape, None if block_table is None else block_table.shape,
           max_seqlen_q, max_seqlen_k, causal, softmax_scale, sel_key, device_index)
    n = _ws_bytes.get(key)
    if n is None:
        with torch.cuda.device(device_index):
            n = int(_C.sparse_prefill_workspace_bytes(inputs, sel._params))
        _remember_bytes(key, n)
    return _scratch(n, q)


def _check_int32(name: str, value: int) -> None:
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise ValueError(f"{name}: {value} does not fit in int32")


def _window_pair(window: Sequence[int]) -> Tuple[int, int]:
    if len(window) != 2:
        raise ValueError(f"window: expected a pair (left, right) of ints, got {len(window)} entries")
    left, right = window
    _check_int32("window", left)
    _check_int32("window", right)
    return left, right


def _lse_for(q: torch.Tensor, return_lse: bool) -> torch.Tensor:
    if return_lse:
        return torch.empty((q.shape[1], q.shape[0]), dtype=_F32, device=q.device)
    return torch.empty((0,), dtype=_F32, device=q.device)


def _check_out(out: torch.Tensor) -> None:
    if out.requires_grad:
        raise TypeError("out: must not require grad (it is written in place)")
    _increment_version(out)


# The extension writes out / the mean cache through DLPack, behind autograd's back: bump their version counters
# as an in-place torch op would (a kernel registered through torch.library.Library gets no ADInplaceOrView step).
_increment_version = torch.autograd.graph.increment_version


# ---------------------------------------------------------------------------------------------------------------------
# Kernels (the real implementations behind the operators). The dispatcher leaves out trailing arguments equal to
# their schema defaults when it calls a Python kernel, so each kernel repeats the schema's defaults (checked by
# tests/python/test_torch_ops.py).
# ---------------------------------------------------------------------------------------------------------------------

def _run_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
                   return_lse, block_table, seqused_k, out, q_descale, k_descale, v_descale) -> torch.Tensor:
    left, right = _window_pair(window)
    dev = q.get_device()
    if dev >= 0:
        stream = _raw_stream(dev)
        ws = _attention_workspace(q.shape[-1], q, dev)
    else:
        stream, ws = 0, None
    lse = _lse_for(q, return_lse)
    inputs = _make_inputs(_to_dlpack(q), _to_dlpack(k), _to_dlpack(v), _to_dlpack(cu_seqlens_q), max_seqlen_q,
                          max_seqlen_k, _dl(cu_seqlens_k), _dl(block_table), _dl(seqused_k), causal, softmax_scale,
                          left, right, stream, None, _dl(q_descale), _dl(k_descale), _dl(v_descale))
    _C.attention(inputs, _to_dlpack(out), _to_dlpack(lse) if return_lse else None, workspace=_dl(ws))
    return lse


def _attention_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None,
                      window=(-1, -1), return_lse=False, block_table=None, seqused_k=None,
                      q_descale=None, k_descale=None, v_descale=None):
    out = torch.empty(q.shape, dtype=_out_dtype(q), device=q.device)
    lse = _run_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                         window, return_lse, block_table, seqused_k, out, q_descale, k_descale, v_descale)
    return out, lse


def _attention_out_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, causal=True,
                          softmax_scale=None, window=(-1, -1), return_lse=False, block_table=None, seqused_k=None,
                          q_descale=None, k_descale=None, v_descale=None):
    _check_out(out)
    return _run_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                          window, return_lse, block_table, seqused_k, out, q_descale, k_descale, v_descale)


def _run_sparse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse,
                block_table, seqused_k, mean_k, mean_v, out, q_descale, k_descale, v_descale, mean_block_size,
                fields) -> torch.Tensor:
    sel, sel_key = _selection_of_op_fields(fields)  # the library's one selection cache (_selection.py)
    dev = q.get_device()
    lse = _lse_for(q, return_lse)
    inputs = _make_inputs(_to_dlpack(q), _to_dlpack(k), _to_dlpack(v), _to_dlpack(cu_seqlens_q), max_seqlen_q,
                          max_seqlen_k, _dl(cu_seqlens_k), _dl(block_table), _dl(seqused_k), causal, softmax_scale,
                          -1, -1, _raw_stream(dev) if dev >= 0 else 0, None, _dl(q_descale), _dl(k_descale),
                          _dl(v_descale))
    lse_c = _to_dlpack(lse) if return_lse else None
    ws = None
    if dev >= 0:
        ws = _dl(_sparse_workspace(inputs, sel, sel_key, q, k, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q,
                                   max_seqlen_k, causal, softmax_scale, dev))
    _C.sparse_prefill(inputs, sel._params, _to_dlpack(out), lse_c, mean_k=_dl(mean_k), mean_v=_dl(mean_v),
                      workspace=ws, mean_block_size=mean_block_size)
    if mean_k is not None:
        _increment_version(mean_k)
        _increment_version(mean_v)
    return lse


# The selection arguments are keyword-only in the schemas (_SELECTION_SCHEMA): the kernels take them as **fields.
def _sparse_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None,
                   return_lse=False, block_table=None, seqused_k=None, mean_k=None, mean_v=None, q_descale=None,
                   k_descale=None, v_descale=None, mean_block_size=0, **fields):
    out = torch.empty(q.shape, dtype=_out_dtype(q), device=q.device)
    lse = _run_sparse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                      return_lse, block_table, seqused_k, mean_k, mean_v, out, q_descale, k_descale, v_descale,
                      mean_block_size, fields)
    return out, lse


def _sparse_out_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, causal=True,
                       softmax_scale=None, return_lse=False, block_table=None, seqused_k=None, mean_k=None,
                       mean_v=None, q_descale=None, k_descale=None, v_descale=None, mean_block_size=0, **fields):
    _check_out(out)
    return _run_sparse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                       return_lse, block_table, seqused_k, mean_k, mean_v, out, q_descale, k_descale, v_descale,
                       mean_block_size, fields)


def _check_chunks_on_host(cu_seqlens_q, seqused_k, max_seqlen_k) -> None:
    """chunked_prefill's checks for host arrays (sparse_prefill._api.chunked_prefill): each chunk fits in its cache
    and max_seqlen_k bounds the caches. CUDA inputs are trusted (reading them would synchronise)."""
    if cu_seqlens_q.dim() != 1 or seqused_k.dim() != 1 or cu_seqlens_q.shape[0] != seqused_k.shape[0] + 1:
        return  # shape errors are reported by the extension
    if cu_seqlens_q.dtype != _I32 or seqused_k.dtype != _I32:
        return
    chunk = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    short = torch.nonzero(chunk > seqused_k)
    if short.numel():
        b = int(short[0, 0])
        raise ValueError(f"seqused_k: sequence {b} holds {int(seqused_k[b])} tokens, fewer than its chunk of "
                         f"{int(chunk[b])} queries (append the chunk's K/V to the cache first)")
    if seqused_k.numel() and int(seqused_k.max()) > max_seqlen_k:
        raise ValueError(f"max_seqlen_k: {int(max_seqlen_k)} is below the longest cache "
                         f"(seqused_k has {int(seqused_k.max())})")


def _chunked_kernel(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k,
                    final_chunk, softmax_scale=None, return_lse=False, mean_k=None, mean_v=None, q_descale=None,
                    k_descale=None, v_descale=None, mean_block_size=0, **fields):
    if q.get_device() < 0:
        _check_chunks_on_host(cu_seqlens_q, seqused_k, max_seqlen_k)
    out = torch.empty(q.shape, dtype=_out_dtype(q), device=q.device)
    lse = _run_sparse(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, True, softmax_scale,
                      return_lse, block_table, seqused_k, mean_k, mean_v, out, q_descale, k_descale, v_descale,
                      mean_block_size, dict(fields, final_chunk=final_chunk))
    return out, lse


def _chunked_out_kernel(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k, out,
                        final_chunk, softmax_scale=None, return_lse=False, mean_k=None, mean_v=None, q_descale=None,
                        k_descale=None, v_descale=None, mean_block_size=0, **fields):
    _check_out(out)
    if q.get_device() < 0:
        _check_chunks_on_host(cu_seqlens_q, seqused_k, max_seqlen_k)
    return _run_sparse(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, True, softmax_scale,
                       return_lse, block_table, seqused_k, mean_k, mean_v, out, q_descale, k_descale, v_descale,
                       mean_block_size, dict(fields, final_chunk=final_chunk))


# ---------------------------------------------------------------------------------------------------------------------
# Fake (meta) implementations: shapes and dtypes only
# ---------------------------------------------------------------------------------------------------------------------

def _fake_lse(q, return_lse):
    if return_lse:
        return q.new_empty((q.shape[1], q.shape[0]), dtype=_F32)
    return q.new_empty((0,), dtype=_F32)


def _fake_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None,
                    window=(-1, -1), return_lse=False, block_table=None, seqused_k=None,
                    q_descale=None, k_descale=None, v_descale=None):
    return q.new_empty(q.shape, dtype=_out_dtype(q)), _fake_lse(q, return_lse)


def _fake_attention_out(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, causal=True,
                        softmax_scale=None, window=(-1, -1), return_lse=False, block_table=None, seqused_k=None,
                        q_descale=None, k_descale=None, v_descale=None):
    return _fake_lse(q, return_lse)


def _fake_sparse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None,
                 return_lse=False, block_table=None, seqused_k=None, mean_k=None, mean_v=None, q_descale=None,
                 k_descale=None, v_descale=None, mean_block_size=0, **fields):
    return q.new_empty(q.shape, dtype=_out_dtype(q)), _fake_lse(q, return_lse)


def _fake_sparse_out(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, causal=True,
                     softmax_scale=None, return_lse=False, block_table=None, seqused_k=None, mean_k=None, mean_v=None,
                     q_descale=None, k_descale=None, v_descale=None, mean_block_size=0, **fields):
    return _fake_lse(q, return_lse)


def _fake_chunked(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k, final_chunk,
                  softmax_scale=None, return_lse=False, mean_k=None, mean_v=None, q_descale=None, k_descale=None,
                  v_descale=None, mean_block_size=0, **fields):
    return q.new_empty(q.shape, dtype=_out_dtype(q)), _fake_lse(q, return_lse)


def _fake_chunked_out(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k, out,
                      final_chunk, softmax_scale=None, return_lse=False, mean_k=None, mean_v=None, q_descale=None,
                      k_descale=None, v_descale=None, mean_block_size=0, **fields):
    return _fake_lse(q, return_lse)


# ---------------------------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------------------------

_ATTN_ARGS = ("Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
              "SymInt max_seqlen_k")
_FP8_OPTS = "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None"
_ATTN_OPTS = ("bool causal=True, float? softmax_scale=None, int[2] window=[-1, -1], bool return_lse=False, "
              "Tensor? block_table=None, Tensor? seqused_k=None, " + _FP8_OPTS)


def _selection_schema(exclude=()) -> str:
    """The selection arguments of a schema, keyword-only, from the library's one table of fields (sp.Selection's,
    read from the C++ SelectionParams): `rule` as its int, `max_kept_blocks` -1 for None."""
    defaults = [(f.name, f.to_c(f.default)) for f in _SELECTION_TABLE if f.name not in exclude]
    return "*, " + ", ".join(f"{type(c).__name__} {name}={c!r}" for name, c in defaults)


_MEANS = "Tensor(a!)? mean_k=None, Tensor(b!)? mean_v=None"
# the block size a MeanCache was made for (the library then refuses a call selecting with another one); 0: not known.
# After the FP8 descales, so that the positions of the arguments before it stay as they were.
_MEAN_BLOCK = "int mean_block_size=0"
_SPARSE_OPTS = (f"bool causal=True, float? softmax_scale=None, bool return_lse=False, Tensor? block_table=None, "
                f"Tensor? seqused_k=None, {_MEANS}, {_FP8_OPTS}, {_MEAN_BLOCK}, {_selection_schema()}")
_CHUNK_ARGS = ("Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor block_table, Tensor seqused_k, "
               "SymInt max_seqlen_q, SymInt max_seqlen_k")
_CHUNK_OPTS = (f"bool final_chunk, float? softmax_scale=None, bool return_lse=False, {_MEANS}, {_FP8_OPTS}, "
               f"{_MEAN_BLOCK}, "
               f"{_selection_schema(exclude=('final_chunk',))}")

_SCHEMAS = {
    "attention": (f"{_ATTN_ARGS}, {_ATTN_OPTS}) -> (Tensor, Tensor)", _attention_kernel, _fake_attention),
    "attention_out": (f"{_ATTN_ARGS}, Tensor(o!) out, {_ATTN_OPTS}) -> Tensor", _attention_out_kernel,
                      _fake_attention_out),
    "sparse_prefill": (f"{_ATTN_ARGS}, {_SPARSE_OPTS}) -> (Tensor, Tensor)", _sparse_kernel, _fake_sparse),
    "sparse_prefill_out": (f"{_ATTN_ARGS}, Tensor(o!) out, {_SPARSE_OPTS}) -> Tensor", _sparse_out_kernel,
                           _fake_sparse_out),
    "chunked_prefill": (f"{_CHUNK_ARGS}, {_CHUNK_OPTS}) -> (Tensor, Tensor)", _chunked_kernel, _fake_chunked),
    "chunked_prefill_out": (f"{_CHUNK_ARGS}, Tensor(o!) out, {_CHUNK_OPTS}) -> Tensor", _chunked_out_kernel,
                            _fake_chunked_out),
}

_lib = torch.library.Library(_NS, "DEF")
for _name, (_schema, _kernel, _fake) in _SCHEMAS.items():
    _lib.define(f"{_name}({_schema}", tags=(torch.Tag.pt2_compliant_tag,))
    _lib.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{_NS}::{_name}", _fake, lib=_lib)
    # forward only: autograd passes through, so outputs never require grad (and backward through them is an error
    # rather than a silently wrong gradient)
    _lib.impl(_name, torch.library.fallthrough_kernel, "Autograd")
del _name, _schema, _kernel, _fake
# torch's dispatcher keeps the Python kernels registered above (and the closures register_fake wraps the fakes in)
# until the process ends, even once _lib is destroyed, and with them this module's globals. At exit the interpreter
# wipes the globals of the modules still alive after it empties sys.modules; a module nothing else holds is freed
# before that, and its globals, held from C++, then outlive the teardown unwiped: through the functions imported from
# sparse_prefill._selection, its _SELECTIONS (the selection cache), _PARAMS and _DEFAULT_SELECTION kept their
# _C.SelectionParams past nanobind's leak check ("nanobind: leaked N instances", printed at exit). The module holds
# itself, so that it is still alive then and its globals are wiped with the others'.
_THIS_MODULE = sys.modules[__name__]

_ops = getattr(torch.ops, _NS)
OPS = {name: getattr(_ops, name).default for name in _SCHEMAS}
"""The registered OpOverloads by name (torch.ops.sparse_prefill.<name>.default)."""

_attention_op = OPS["attention"]
_attention_out_op = OPS["attention_out"]
_sparse_op = OPS["sparse_prefill"]
_sparse_out_op = OPS["sparse_prefill_out"]
_chunked_op = OPS["chunked_prefill"]
_chunked_out_op = OPS["chunked_prefill_out"]


# ---------------------------------------------------------------------------------------------------------------------
# Python wrappers: the signatures and defaults of the public functions
# ---------------------------------------------------------------------------------------------------------------------

def _mean_pair(mean_cache) -> tuple:
    """(k_mean, v_mean, the block size the cache was made for or 0), as sparse_prefill._call._mean_cache_arrays."""
    if mean_cache is None:
        return None, None, 0
    if not isinstance(mean_cache, (tuple, list)) or len(mean_cache) != 2:
        raise TypeError(f"mean_cache: expected a pair (k_mean, v_mean) as returned by mean_cache(), got "
                        f"{type(mean_cache).__name__}")
    return mean_cache[0], mean_cache[1], int(getattr(mean_cache, "block_size", 0))


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
              softmax_scale: Optional[float] = None, window: Tuple[int, int] = (-1, -1), out=None,
              return_lse: bool = False, block_table=None, seqused_k=None,
              q_descale=None, k_descale=None, v_descale=None):
    """sparse_prefill.attention through torch.ops.sparse_prefill.attention(_out) (torch tensors; the current torch
    stream; the workspace from torch's allocator).

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, out,
            return_lse, block_table, seqused_k, q_descale, k_descale, v_descale: as in sparse_prefill.attention().

    Returns:
        out, or (out, lse) when return_lse is True.
    """
    if out is None:
        out, lse = _attention_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                 softmax_scale, window, return_lse, block_table, seqused_k,
                                 q_descale, k_descale, v_descale)
    else:
        lse = _attention_out_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, causal,
                                softmax_scale, window, return_lse, block_table, seqused_k,
                                q_descale, k_descale, v_descale)
    return (out, lse) if return_lse else out


def _op_fields(selection, keywords: dict) -> dict:
    """The operator's selection arguments for a wrapper's `selection=` or selection keywords (as the public
    functions take them, checked the same way: _selection): the fields that differ from the defaults, rule as its int,
    max_kept_blocks -1 for None (kept on the Selection; the keywords' Selections are cached by _selection)."""
    return _fields_of_selection(_selection(selection, keywords))


@selection_keywords
def sparse_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                   softmax_scale: Optional[float] = None, out=None, return_lse: bool = False, block_table=None,
                   seqused_k=None, mean_cache=None, q_descale=None, k_descale=None, v_descale=None, selection=None,
                   **selection_keywords):
    """sparse_prefill.sparse_prefill (without return_index) through torch.ops.sparse_prefill.sparse_prefill(_out).

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, out, return_lse,
            block_table, seqused_k, mean_cache, q_descale, k_descale, v_descale: as in sparse_prefill.sparse_prefill().
        selection, or the selection keywords: as in sparse_prefill.sparse_prefill(), not both (see build_index(),
            "Selection arguments").

    Returns:
        out, or (out, lse) when return_lse is True.
    """
    fields = _op_fields(selection, selection_keywords)
    mean_k, mean_v, mean_bs = _mean_pair(mean_cache)
    if out is None:
        out, lse = _sparse_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                              return_lse, block_table, seqused_k, mean_k, mean_v, q_descale, k_descale, v_descale,
                              mean_bs, **fields)
    else:
        lse = _sparse_out_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, causal,
                             softmax_scale, return_lse, block_table, seqused_k, mean_k, mean_v, q_descale, k_descale,
                             v_descale, mean_bs, **fields)
    return (out, lse) if return_lse else out


@selection_keywords
def chunked_prefill(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q: int, max_seqlen_k: int,
                    *, final_chunk: bool, softmax_scale: Optional[float] = None, out=None, return_lse: bool = False,
                    mean_cache=None, q_descale=None, k_descale=None, v_descale=None, selection=None,
                    **selection_keywords):
    """sparse_prefill.chunked_prefill through torch.ops.sparse_prefill.chunked_prefill(_out).

    Args:
        q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k, final_chunk,
            softmax_scale, out, return_lse, mean_cache, q_descale, k_descale, v_descale: as in
            sparse_prefill.chunked_prefill() (final_chunk is the step's, whatever a `selection` says).
        selection, or the selection keywords: as in sparse_prefill.chunked_prefill(), not both (see build_index(),
            "Selection arguments").

    Returns:
        out, or (out, lse) when return_lse is True.
    """
    fields = _op_fields(selection, selection_keywords)
    if "final_chunk" in fields:  # the step's final_chunk wins over a Selection's (not in the chunked schemas)
        fields = {n: v for n, v in fields.items() if n != "final_chunk"}
    mean_k, mean_v, mean_bs = _mean_pair(mean_cache)
    if out is None:
        out, lse = _chunked_op(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k,
                               final_chunk, softmax_scale, return_lse, mean_k, mean_v, q_descale, k_descale,
                               v_descale, mean_bs, **fields)
    else:
        lse = _chunked_out_op(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k,
                              out, final_chunk, softmax_scale, return_lse, mean_k, mean_v, q_descale, k_descale,
                              v_descale, mean_bs, **fields)
    return (out, lse) if return_lse else out

"""The public functions of sparse_prefill: dense attention, block-sparse prefill, block union, KV pooling.

Vocabulary and argument names follow flash_attn_varlen_func so that adopting SparsePrefill is a one-line change.
Every array argument may come from numpy, torch, cupy or jax (any DLPack producer); all arrays of one call must come
from one array library, and outputs are allocated in it, on the device of `q`.

Shapes (B sequences, Hq query heads, Hkv KV heads, head dim D in {64, 128}; Hq % Hkv == 0):
    q                   [total_q, Hq, D]           float32 / float16 / bfloat16
    k, v (contiguous)   [total_k, Hkv, D]          with cu_seqlens_k [B+1] int32
    k, v (paged)        [num_pages, page_size, Hkv, D]  with block_table [B, max_pages] int32, seqused_k [B] int32,
                                                        and cu_seqlens_k=None
    cu_seqlens_q        [B+1] int32, monotone, cu_seqlens_q[-1] == total_q
    out                 [total_q, Hq, D]           q's dtype
    lse                 [Hq, total_q]              float32, natural log; -inf for rows that see no key

Masking: causal is aligned bottom-right (query i of a sequence with Lq queries and Lk keys sees key j iff
j <= i + Lk - Lq); `window=(left, right)` bounds the keys to [diag - left, diag + right] (-1 = unbounded).
A row that sees no key outputs zeros and lse = -inf.

Errors: bad arguments raise ValueError (values, shapes) or TypeError (types, dtypes, devices, array libraries);
the message starts with the argument's name and the exception carries it as `.argument` when raised by the library.
A valid call that a backend does not implement (e.g. a CUDA path not built yet) raises NotImplementedError.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any, Optional, Tuple

import numpy as np

from . import _C
from ._arrays import ArrayLib, library_of, resolve_stream, to_numpy
from ._arrays import _dtype_name, normalize_dtypes

__all__ = ["attention", "build_index", "sparse_attention", "sparse_prefill", "chunked_prefill", "mean_cache",
           "MeanCache", "check_errors",
           "union_index", "pool_kv", "Index", "LaunchOptions", "attention_path", "attention_workspace_bytes",
           "index_workspace_bytes", "sparse_attention_workspace_bytes", "sparse_prefill_workspace_bytes", "chunked_prefill_workspace_bytes"]


# Selection rules (SelectionRule in sparse.h): keyword value -> the int the extension takes.
_RULES = {"tile_energy": 0, "row_max": 1, "probe_row_max": 2}
_C_DEFAULTS = dict(_C.selection_defaults())
SELECTION_DEFAULTS = dict(_C_DEFAULTS, alpha=round(_C_DEFAULTS["alpha"], 7),  # the float32 0.1f as 0.1
                          rule={v: k for k, v in _RULES.items()}[_C_DEFAULTS["rule"]])
"""The selection's defaults, read from the C++ SelectionParams{} (the one place they are set): alpha, rule,
block_size, sink, window, last_n, correction, head_subgroups. Every function's keyword defaults are these."""
_D = SELECTION_DEFAULTS
_to_dlpack = None


def _torch_to_dlpack(x: Any) -> Any:
    global _to_dlpack
    if _to_dlpack is None:  # torch is loaded whenever a torch tensor reaches here
        from torch.utils.dlpack import to_dlpack
        _to_dlpack = to_dlpack
    return _to_dlpack(x)


# ---------------------------------------------------------------------------------------------------------------------
# Argument checks done in Python (the rest happens once, in C++)
# ---------------------------------------------------------------------------------------------------------------------

def _as_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


_INT32_MAX = 2**31 - 1


def _as_int32(name: str, value: Any) -> int:
    v = _as_int(name, value)
    if not -_INT32_MAX - 1 <= v <= _INT32_MAX:
        raise ValueError(f"{name}: {v} does not fit in int32")
    return v


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    return float(value)


def _as_window(window: Any) -> Tuple[int, int]:
    if not isinstance(window, (tuple, list)):
        raise TypeError(f"window: expected a pair (left, right) of ints, got {type(window).__name__}")
    if len(window) != 2:
        raise ValueError(f"window: expected a pair (left, right) of ints, got {len(window)} entries")
    left, right = (_as_int32("window", w) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"window: entries must be >= -1 (-1 = unbounded), got ({left}, {right})")
    return left, right


class LaunchOptions:
    """CUDA kernel choices the library otherwise makes from the shapes, for A/B benchmarks and tests (the defaults are
    the measured best, bench/NOTES.md). Pass as `options=` to any compute function; ignored on the CPU.

    dense_path: 'auto' (the dense kernel, except short queries against long keys: PackGQA tiles with split-KV below
        half a wave of dense tiles), 'dense' (always the dense kernel) or 'split_kv' (PackGQA tiles with split-KV
        wherever that path applies: head dim 128, no window, more keys than queries, pages of a multiple of 64).
    split_kv: sparse launches of chunk shapes (max_seqlen_k > max_seqlen_q) split tiles heavier than an SM's share
        into split-KV units (default True); False runs one unit per tile.
    checked: debugging and tests (default False). CUDA calls copy the device-resident index values (cu_seqlens_q/k,
        seqused_k, block_table, and a caller's index arrays) to the host and validate them as CPU arrays are
        validated before the launch, and call check_errors() after it: a bad value raises at once, naming the
        argument. It synchronises the stream (never use it inside CUDA-graph capture or an engine's hot path). Off,
        the kernels still never read or write out of bounds; they record a bad value for check_errors().
    """

    _PATHS = {"auto": 0, "dense": 1, "split_kv": 2}
    __slots__ = ("dense_path", "split_kv", "checked")

    def __init__(self, dense_path: str = "auto", split_kv: bool = True, checked: bool = False):
        if dense_path not in self._PATHS:
            raise ValueError(f"dense_path: expected one of {sorted(self._PATHS)}, got {dense_path!r}")
        self.dense_path = dense_path
        self.split_kv = _as_bool("split_kv", split_kv)
        self.checked = _as_bool("checked", checked)

    def _codes(self) -> tuple:
        return (self._PATHS[self.dense_path], self.split_kv, self.checked)

    def __repr__(self) -> str:
        return f"LaunchOptions(dense_path={self.dense_path!r}, split_kv={self.split_kv}, checked={self.checked})"


_DEFAULT_CODES = (0, True, False)


def check_errors(stream=None) -> None:
    """Raises the first bad device value a CUDA kernel met since the last call, and clears it.

    The CUDA kernels never read or write outside the arrays they are given, whatever the values of cu_seqlens_q/k,
    seqused_k, block_table or an index hold; reading those values on the host would synchronise every call, so they
    are checked on the device instead: a sequence whose values are out of range is skipped and its rows of out (and
    lse) come out NaN, a bad page or block id makes its tile's rows NaN, and the first violation is recorded in a
    small error word on the device (one per device: no allocation, safe inside CUDA graphs). check_errors()
    synchronises `stream` (default: the current torch stream, as for the compute functions; an int handle, a
    torch.cuda.Stream or a cupy Stream also work) on the current device, and raises ValueError naming the argument,
    e.g. "seqused_k: seqused_k[0] = 5000 exceeds the 16 rows that block_table row 0's pages hold (detected on the
    device)", with `.argument` set. It reports violations from every stream of the device. A no-op without CUDA.
    """
    if not bool(_C.with_cuda):
        return
    if stream is None:
        from ._arrays import _module
        torch = _module("torch")
        handle = int(torch.cuda.current_stream().cuda_stream) if torch is not None and torch.cuda.is_available() else 0
    else:
        handle = resolve_stream(stream, ArrayLib("numpy", np.zeros(0)))
    _C.check_errors(handle)


def _option_codes(options: Any) -> tuple:
    if options is None:
        return _DEFAULT_CODES
    if not isinstance(options, LaunchOptions):
        raise TypeError(f"options: expected a sparse_prefill.LaunchOptions, got {type(options).__name__}")
    return options._codes()


class _Call:
    """One call's arrays, checked for kind and array library, converted for the extension.

    `ref` names the array whose library and device the call uses (q, or k for pool_kv).
    """

    _REQUIRED = ("q", "k", "v", "cu_seqlens_q")

    def __init__(self, arrays: dict, out: Any = None, ref: str = "q"):
        first = arrays[ref]
        name = library_of(first)
        if name is None:
            raise TypeError(f"{ref}: expected an array (numpy, torch, cupy, jax or any DLPack producer), got "
                            f"{type(first).__name__}")
        for key, x in arrays.items():
            if x is None:
                if key in self._REQUIRED:
                    raise TypeError(f"{key}: is required, got None")
                continue
            other = library_of(x)
            if other is None:
                raise TypeError(f"{key}: expected an array (numpy, torch, cupy, jax or any DLPack producer), got "
                                f"{type(x).__name__}")
            if other != name:
                raise TypeError(f"{key}: is a {other} array but {ref} is a {name} array; pass every array of a "
                                "call from one array library")
        self.lib = ArrayLib(name, first)
        if out is not None:
            if name == "jax":
                raise TypeError("out: jax arrays are immutable, so out= is not supported for jax inputs")
            other = library_of(out)
            if other != name:
                raise TypeError(f"out: is a {other or type(out).__name__} array but {ref} is a {name} array")
        self.arrays = {k: self._wrap(x) for k, x in arrays.items()}
        self.arrays = normalize_dtypes(self.arrays, self.lib)  # numpy defaults: int64 / float64 rule (_arrays.py)
        if "q" in self.arrays:
            qw = self.arrays["q"]
            if len(qw.shape) != 3:
                raise ValueError(f"q: expected a 3-dimensional array [total_q, Hq, D], got shape {tuple(qw.shape)}")

    def _wrap(self, x: Any) -> Any:
        x = self.lib.wrap_in(x)
        if self.lib.compute == "torch" and x is not None and x.requires_grad:
            x = x.detach()  # forward only; DLPack refuses tensors that require grad
        return x

    def inputs(self, max_seqlen_q: Any, max_seqlen_k: Any, causal: Any, softmax_scale: Any,
               window: Any = (-1, -1), stream: Any = None, options: Any = None) -> tuple:
        a = self.arrays
        max_q = _as_int("max_seqlen_q", max_seqlen_q)
        max_k = _as_int("max_seqlen_k", max_seqlen_k)
        if max_q < 0:
            raise ValueError(f"max_seqlen_q: must be >= 0, got {max_q}")
        if max_k < 0:
            raise ValueError(f"max_seqlen_k: must be >= 0, got {max_k}")
        if max(max_q, max_k) >= 2**62:
            raise ValueError("max_seqlen_q: too large" if max_q >= 2**62 else "max_seqlen_k: too large")
        scale = None if softmax_scale is None else _as_float("softmax_scale", softmax_scale)
        left, right = _as_window(window)
        c = self.c
        return (c(a["q"]), c(a["k"]), c(a["v"]), c(a["cu_seqlens_q"]), c(a.get("cu_seqlens_k")),
                c(a.get("block_table")), c(a.get("seqused_k")), max_q, max_k, _as_bool("causal", causal), scale, left, right,
                resolve_stream(stream, self.lib)) + _option_codes(options) + tuple(c(a.get(n)) for n in _DESCALES)

    def c(self, x: Any) -> Any:
        """An array as handed to the extension: torch tensors as DLPack capsules made by torch's C++ exporter
        (~1-3 us an array against ~5 us when the extension calls Tensor.__dlpack__; a call passes up to 11)."""
        if x is None or self.lib.compute != "torch":
            return x
        return _torch_to_dlpack(x)

    def workspace(self, workspace: Any) -> Any:
        """The caller's workspace as the extension takes it (same array library as q)."""
        if workspace is None:
            return None
        other = library_of(workspace)
        if other is None:
            raise TypeError(f"workspace: expected an array, got {type(workspace).__name__}")
        if other != self.lib.name:
            raise TypeError(f"workspace: is a {other} array but q is a {self.lib.name} array")
        return self._wrap(workspace)

    def outputs(self, out: Any, return_lse: bool):
        """(out for C++, lse for C++ or None, out to return)."""
        q = self.arrays["q"]
        if out is None:  # q's dtype; bfloat16 for FP8 inputs
            out_c = self.lib.empty(q.shape, "bfloat16" if _dtype_name(q) in _FP8 else q.dtype)
            out_ret = None
        else:
            out_c = out
            if self.lib.compute == "torch" and out.requires_grad:
                raise TypeError("out: must not require grad (it is written in place)")
            out_ret = out
        lse = self.lib.empty((q.shape[1], q.shape[0]), "float32") if return_lse else None
        return out_c, lse, out_ret

    def result(self, out_c: Any, lse: Any, out_ret: Any, return_lse: bool):
        out_r = out_ret if out_ret is not None else self.lib.wrap_out(out_c)
        if return_lse:
            return out_r, self.lib.wrap_out(lse)
        return out_r


def _kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, descales=(None, None, None)) -> dict:
    arrays = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
              "block_table": block_table, "seqused_k": seqused_k}
    for name, d in zip(_DESCALES, descales):
        if d is not None:
            arrays[name] = d
    return arrays


_DESCALES = ("q_descale", "k_descale", "v_descale")
_FP8 = ("float8_e4m3fn",)


# ---------------------------------------------------------------------------------------------------------------------
# Dense attention
# ---------------------------------------------------------------------------------------------------------------------

def attention_workspace_bytes(head_dim: int = 128) -> int:
    """Bytes of the `workspace` that attention() may use on the current CUDA device (0 without a CUDA build or GPU)."""
    return int(_C.attention_workspace_bytes(_as_int32("head_dim", head_dim)))


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
              softmax_scale: Optional[float] = None, window: Tuple[int, int] = (-1, -1), out=None,
              return_lse: bool = False, block_table=None, seqused_k=None, stream=None, workspace=None,
              options: Optional[LaunchOptions] = None, q_descale=None, k_descale=None, v_descale=None):
    """Dense varlen attention: out = softmax(q k^T * softmax_scale + mask) v, per sequence and query head.

    Args:
        q: [total_q, Hq, D] queries (float32, float16, bfloat16 or float8_e4m3fn; see q_descale).
        k, v: contiguous [total_k, Hkv, D] or, with `block_table`, paged [num_pages, page_size, Hkv, D]
            (any page_size >= 1; on CUDA pages of a multiple of 64 tokens load by TMA, other sizes such as 16 or 1 by
            a cp.async gather, see bench/NOTES.md). Query head h reads KV head h // (Hq // Hkv).
        cu_seqlens_q: [B+1] int32 offsets of the sequences in q.
        cu_seqlens_k: [B+1] int32 offsets in k/v; must be None with paged KV.
        max_seqlen_q, max_seqlen_k: upper bounds of the per-sequence lengths (checked on the CPU). On CUDA they also
            pick the kernel: short queries against longer keys (decode, small chunks; D = 128, no window, pages of a
            multiple of 64) run on PackGQA tiles with split-KV, whose float32 partials (~35 MB) live in `workspace`
            or, without it, in a stream-ordered temporary taken per call.
        causal: bottom-right aligned causal mask.
        softmax_scale: default 1/sqrt(D).
        window: sliding window (left, right) in the causal alignment; -1 = unbounded.
        out: optional [total_q, Hq, D] array of q's dtype (bfloat16 for FP8 inputs), written in place and returned.
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
            FP8 runs on the CPU reference today (the exact math on the dequantised values); the CUDA FP8 kernels
            are not built yet and raise NotImplementedError.

    Returns:
        out, or (out, lse) when return_lse is True. Outputs are arrays of q's library on q's device.
    """
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                            (q_descale, k_descale, v_descale)), out)
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, stream, options)
    return_lse = _as_bool("return_lse", return_lse)
    out_c, lse, out_ret = call.outputs(out, return_lse)
    _C.attention(inputs, call.c(out_c), call.c(lse), call.c(call.workspace(workspace)))
    return call.result(out_c, lse, out_ret, return_lse)


def attention_path(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                   window: Tuple[int, int] = (-1, -1), block_table=None, seqused_k=None,
                   options: Optional[LaunchOptions] = None) -> str:
    """Which kernel attention() runs for these arguments: 'dense' (one 128-row tile per query head) or 'split_kv'
    (PackGQA tiles with split-KV; CUDA only). For tests and benchmarks; reads shapes only."""
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k))
    return str(_C.attention_path(call.inputs(max_seqlen_q, max_seqlen_k, causal, None, window, 0, options)))


# ---------------------------------------------------------------------------------------------------------------------
# The block index
# ---------------------------------------------------------------------------------------------------------------------

class Index:
    """A block-sparse selection (CSR over segments), produced by build_index() or union_index().

    A segment is one (sequence b, KV head, query tile); a tile is 128 PackGQA rows (row r <-> position r // g of query
    head kv_head * g + r % g, g = group_size). Segments are ordered by sequence, then KV head, then tile:
    id = segment_offsets[b] + kv_head * tiles[b] + tile. Segment s lists the kept block ids (per sequence, ascending)
    block_ids[segment_start[s]:segment_end[s]]; in union mode all tiles of a (sequence, KV head) share one list.

    Head sub-groups (head_subgroups = S > 1): the KV heads of the index are Hkv * S virtual heads; virtual head v holds
    query heads [v * g, (v + 1) * g) with g = group_size = (Hq // Hkv) // S and reads K/V head v // S, so
    num_kv_heads, group_size, kv_head in segment()/segment_id() and the head axis of k_mean/v_mean are all virtual
    (the means of virtual head v are those of K/V head v // S).

    Where it lives. An index built from CUDA arrays stays on the device (`on_device` is True): its CSR, pooled means
    and launch state live in one workspace array (`workspace`, in q's library, or the caller's `workspace=`), written
    and read on the stream without a host synchronisation; `to_host()` copies it to the host for inspection (it
    synchronises). An index built from CPU arrays, or returned by to_host() or union_index(), is a host index whose
    arrays are numpy arrays (`host`), copied once to another device when passed with arrays there.

    What it is bound to. `binding` records what the index was built for (mask, softmax scale, head geometry, length
    bounds, dtype, device, and the arrays it was built from); sparse_attention() rejects a call that differs, naming
    the argument, unless reuse_index=True is passed to apply the selection to other arrays of the same problem.

    Attributes:
        density: kept_blocks / visible_blocks (1.0 when nothing is visible); reading them on a device index
        synchronises its stream once.
        block_size, group_size, num_kv_heads, head_subgroups, head_dim, correction, mode ('tile' or 'union'),
        on_device, binding.
        Host indexes also: segment_start, segment_end: [S] int32; block_ids: [N] int32; cu_blocks: [B+1] int32
        (block offsets); k_mean, v_mean: [total_blocks, num_kv_heads, D] float32 pooled block means (a tail block
        averages its valid keys), in the library of the inputs it was built from (numpy for to_host()); `host`
        holds them as a dict of numpy arrays.
    """

    _ARRAYS = ("segment_start", "segment_end", "block_ids", "cu_blocks", "k_mean", "v_mean")

    def __init__(self, d: dict, lib: ArrayLib, cu_seqlens_q: Any, mode: str):
        """A host index from the dict the extension returns."""
        self._init_common(d["binding"], lib, cu_seqlens_q, mode, int(d["block_size"]), bool(d["correction"]),
                          int(d["head_subgroups"]))
        self.on_device = False
        self._counts = (int(d["kept_blocks"]), int(d["visible_blocks"]))
        self.host = {name: d[name] for name in self._ARRAYS}
        self._cache = {}
        for name in self._ARRAYS:  # in the inputs' library (zero copy on the CPU)
            setattr(self, name, lib.from_numpy(self.host[name]))

    def _init_common(self, binding, lib, cu_seqlens_q, mode, block_size, correction, head_subgroups):
        self.binding = binding
        self.block_size = block_size
        self.correction = correction
        self.head_subgroups = head_subgroups
        self.num_kv_heads = _C.geometry.virtual_kv_heads(binding.num_kv_heads, head_subgroups)
        self.group_size = _C.geometry.virtual_group_size(binding.num_q_heads // binding.num_kv_heads, head_subgroups)
        self.head_dim = binding.head_dim
        self.mode = mode
        self._lib = lib
        self._cu_seqlens_q = cu_seqlens_q  # read lazily (may be a device array)
        self._tiles = None

    @classmethod
    def _device(cls, workspace: Any, selection: tuple, binding, lib: ArrayLib, stream: int, cu_seqlens_q: Any,
                mode: str) -> "Index":
        self = cls.__new__(cls)
        self._init_common(binding, lib, cu_seqlens_q, mode, selection[1], selection[5], selection[8])
        self.on_device = True
        self.workspace = workspace
        self._selection = selection
        self._stream = stream
        self._counts = None
        return self

    def __getattr__(self, name: str):
        # only reached for attributes that are not set: the host arrays of a device index
        if name in Index._ARRAYS or name == "host":
            raise AttributeError(f"{name}: this index lives on the device; call index.to_host() for its arrays")
        raise AttributeError(name)

    def to_host(self) -> "Index":
        """A host copy of this index (numpy arrays). Synchronises the stream the index was built on."""
        if not self.on_device:
            return self
        d = _C.device_index_to_host(self.workspace, self._selection, self.binding, self._stream)
        return Index(d, ArrayLib("numpy", np.zeros(0)), self._cu_seqlens_q, self.mode)

    # -- geometry ---------------------------------------------------------------------------------------------------
    def _read_counts(self) -> tuple:
        if self._counts is None:
            self._counts = tuple(int(c) for c in _C.device_index_counts(self.workspace, self._selection, self.binding,
                                                                          self._stream))
        return self._counts

    @property
    def kept_blocks(self) -> int:
        return self._read_counts()[0]

    @property
    def visible_blocks(self) -> int:
        return self._read_counts()[1]

    @property
    def density(self) -> float:
        kept, visible = self._read_counts()
        return kept / visible if visible else 1.0

    @property
    def batch(self) -> int:
        return int(self.binding.batch)

    @property
    def num_segments(self) -> int:
        return int(self.tiles.sum()) * self.num_kv_heads

    @property
    def tiles(self) -> np.ndarray:
        """[B] number of query tiles of each sequence: ceil(Lq_b * group_size / 128)."""
        if self._tiles is None:
            cu = to_numpy(self._cu_seqlens_q).astype(np.int64)
            self._tiles = np.asarray(_C.geometry.num_tiles(np.diff(cu).tolist(), self.group_size), dtype=np.int64)
        return self._tiles

    @property
    def segment_offsets(self) -> np.ndarray:
        """[B+1] first segment id of each sequence."""
        return np.concatenate([[0], np.cumsum(self.tiles * self.num_kv_heads)]).astype(np.int64)

    def segment_id(self, b: int, kv_head: int, tile: int) -> int:
        b, kv_head, tile = (_as_int(n, x) for n, x in (("b", b), ("kv_head", kv_head), ("tile", tile)))
        tiles = self.tiles
        if not 0 <= b < len(tiles):
            raise ValueError(f"b: sequence {b} out of range [0, {len(tiles)})")
        if not 0 <= kv_head < self.num_kv_heads:
            raise ValueError(f"kv_head: {kv_head} out of range [0, {self.num_kv_heads})")
        if not 0 <= tile < tiles[b]:
            raise ValueError(f"tile: {tile} out of range [0, {int(tiles[b])}) for sequence {b}")
        return int(self.segment_offsets[b] + kv_head * tiles[b] + tile)

    def segment(self, b: int, kv_head: int, tile: int) -> np.ndarray:
        """The kept block ids (ascending, per-sequence numbering) of sequence b, KV head kv_head, query tile tile."""
        s = self.segment_id(b, kv_head, tile)
        h = self.host
        lo, hi = int(h["segment_start"][s]), int(h["segment_end"][s])
        return h["block_ids"][lo:hi].copy()

    def __repr__(self) -> str:
        where = "device" if self.on_device else f"host, density={self.density:.4f}"   # no sync on the host
        return (f"Index(mode={self.mode!r}, on the {where}, block_size={self.block_size}, "
                f"group_size={self.group_size}, num_kv_heads={self.num_kv_heads}, "
                f"head_subgroups={self.head_subgroups}, correction={self.correction})")

    # -- placement --------------------------------------------------------------------------------------------------
    def _arrays_for(self, lib: ArrayLib) -> tuple:
        """The host index arrays in the compute library and on the device of `lib` (copied once, then cached)."""
        if not lib.cuda and lib.compute == self._lib.compute:
            return tuple(getattr(self, n) for n in self._ARRAYS)
        key = (lib.compute, lib.cuda, lib.device_id if lib.cuda else 0,
               str(getattr(lib.ref, "device", "")) if lib.compute == "torch" else "")
        if key not in self._cache:
            self._cache[key] = tuple(lib.from_numpy(self.host[n]) for n in self._ARRAYS)
        return self._cache[key]

    def _view_tuple(self, lib: ArrayLib) -> tuple:
        return (self.block_size, self.correction, self.head_subgroups) + self._arrays_for(lib) + (self.binding,)

    def _host_tuple(self) -> tuple:
        h = self.host
        return (self.block_size, self.group_size, self.num_kv_heads, self.correction, h["segment_start"],
                h["segment_end"], h["block_ids"], h["cu_blocks"], h["k_mean"], h["v_mean"], self.kept_blocks,
                self.visible_blocks, self.head_subgroups, self.binding)


def _as_head_subgroups(value: Any) -> int:
    s = _as_int32("head_subgroups", value)
    if s < 1:
        raise ValueError(f"head_subgroups: must be >= 1 (and divide Hq // Hkv), got {s}")
    return s


def _as_rule(value: Any) -> int:
    if not isinstance(value, str) or value not in _RULES:
        raise ValueError(f"rule: must be one of {', '.join(repr(r) for r in _RULES)}, got {value!r}")
    return _RULES[value]


def _selection_args(alpha, block_size, sink, window, last_n, correction, final_chunk=True, union=False,
                    head_subgroups=1, rule=_D["rule"]) -> tuple:
    """The selection tuple of the extension; whether head_subgroups divides Hq // Hkv is checked in C++ (it knows
    the shapes)."""
    return (_as_float("alpha", alpha), _as_int32("block_size", block_size), _as_int32("sink", sink),
            _as_int32("window", window), _as_int32("last_n", last_n), _as_bool("correction", correction),
            _as_bool("final_chunk", final_chunk), _as_bool("union", union), _as_head_subgroups(head_subgroups),
            _as_rule(rule))


def build_index(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, alpha: float = _D["alpha"],
                block_size: int = _D["block_size"], sink: int = _D["sink"], window: int = _D["window"],
                last_n: int = _D["last_n"], correction: bool = _D["correction"],
                causal: bool = True, softmax_scale: Optional[float] = None, block_table=None, seqused_k=None,
                stream=None, final_chunk: bool = True, union: bool = False, head_subgroups: int = 1,
                workspace=None, mean_cache=None, options: Optional[LaunchOptions] = None,
                rule: str = _D["rule"], q_descale=None, k_descale=None, v_descale=None) -> Index:
    """The block selection: pooled block means, per-row scores, a threshold per tile, CSR index.

    Every packed row r of a (sequence, KV head, 128-row PackGQA query tile) scores each key block J it sees as
    s_rJ = scale * q_r . kmean_J. rule (how the scores are thresholded):
      'row_max' (default): with m_r = max_J s_rJ over the blocks row r sees, keep J iff max over the rows r that see
          J of (s_rJ - m_r) >= ln(alpha), i.e. J scores within a factor alpha of the top block of at least one row;
      'tile_energy' (FlashPrefill V2): keep J iff E_IJ = sum_r exp(s_rJ - M_I) >= alpha * max_J E_IJ, M_I the
          tile's maximum score. It loses 47 points of copy top-1 at 8K on a real LM (SmolLM2-135M), row_max 2
          (bench/accuracy/NOTES.md): a block that only a few rows need, with low scores of their own, drowns in the
          tile-wide sum.
      'probe_row_max' (CUDA: a correctness-first kernel, ~1/8 of dense attention's QK^T on CUDA cores): the
          row_max test on the exact
          softmax log-mass of each block for the probe rows (every 8th query of the sequence and its last one, all
          heads), plus the pooled-means row_max test at 0.5 for the other rows (SelectionRule::kProbeRowMax,
          docs/semantics.md). Sees the one strong key of a block that pooled means dilute 128x.
    Always kept under either rule: the blocks of the first `sink` tokens, the blocks meeting the `window` tokens
    before each query, and every visible block for the last `last_n` tiles of each sequence. alpha=0 keeps every
    visible block (sparse_attention then equals attention). The defaults are SELECTION_DEFAULTS.

    KV arguments are those of attention() (contiguous, or paged with block_table/seqused_k and cu_seqlens_k=None).
    `window` here is the selection's local window in tokens (an int), not attention()'s (left, right) mask.
    block_size must be a positive multiple of 64. `correction` (default off) is recorded in the index:
    sparse_attention then adds, for every dropped block fully visible to the whole tile, one virtual key kmean_J with
    value vmean_J and weight |B_J|. It halves the error on the structured workload but changed nothing measurable on
    SmolLM2 (the mean logit underestimates a peaked block's mass) and costs +30 % (32K) to +66 % (128K) of the sparse
    attention time, hence off by default.

    Chunked prefill (queries = the last C positions of each sequence, k/v = its whole cache): `final_chunk=False`
    for a chunk that does not end its prompt (the last_n dense tail tiles are for the prompt's final queries only);
    `union=True` returns one list per (sequence, KV head), the union of its tiles' lists (CompactAttention; mode
    'union'), built in the same call.

    head_subgroups (S, default 1; must divide g = Hq // Hkv): splits each GQA group into S sub-groups of g // S query
    heads, each selected on its own, as if the model had Hkv * S KV heads (virtual KV head v holds query heads
    [v * g // S, (v + 1) * g // S) and reads K/V head v // S; the index's num_kv_heads, group_size, segments and means
    are over these virtual heads). In union mode the union is then per sub-group rather than over the whole group.

    CUDA inputs: the index stays on the device (Index.on_device), in `workspace` when given (a 1-D array of q's
    library on q's device of at least index_workspace_bytes(...) bytes, 256-byte aligned: the call then allocates
    nothing and can be captured in a CUDA graph; the index lives there until the buffer is reused) or else in a
    workspace array allocated in q's library. mean_cache (paged KV): as for chunked_prefill().

    Returns:
        Index (see its docstring); `index.density` is kept / visible blocks.
    """
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                            (q_descale, k_descale, v_descale)))
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), stream, options)
    sel = _selection_args(alpha, block_size, sink, window, last_n, correction, final_chunk, union, head_subgroups,
                          rule)
    mode = "union" if sel[7] else "tile"
    mean_k, mean_v, mean_bs = _mean_cache_arrays(mean_cache, call)
    if not call.lib.cuda:
        if mean_cache is not None:
            raise ValueError("mean_cache: build_index() takes a mean cache on CUDA only (the CPU reference pools "
                             "every block)")
        return Index(_C.build_index(inputs, sel), call.lib, call.arrays["cu_seqlens_q"], mode)
    ws = call.workspace(workspace)
    if ws is None:
        ws = call.lib.empty((max(int(_C.index_workspace_bytes(inputs, sel)), 1),), "uint8")
        # torch arrays travel as DLPack capsules, which the extension consumes once: fresh ones for the build
        inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), stream, options)
    binding = _C.build_index_device(inputs, sel, call.c(ws), call.c(mean_k), call.c(mean_v), mean_bs)
    return Index._device(ws, sel, binding, call.lib, inputs[13], call.arrays["cu_seqlens_q"], mode)


def index_workspace_bytes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                          block_size: int = _D["block_size"], block_table=None, seqused_k=None, union: bool = False,
                          head_subgroups: int = 1, causal: bool = True, softmax_scale: Optional[float] = None,
                          options: Optional[LaunchOptions] = None, **selection) -> int:
    """Bytes of the `workspace` of build_index() on these arrays (read for their shapes only: no device access);
    0 for CPU arrays. Takes build_index()'s arguments; the ones that do not change the size may be left out."""
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k))
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), 0, options)
    sel = _selection_args(selection.get("alpha", _D["alpha"]), block_size, selection.get("sink", _D["sink"]),
                          selection.get("window", _D["window"]), selection.get("last_n", _D["last_n"]),
                          selection.get("correction", _D["correction"]), selection.get("final_chunk", True), union,
                          head_subgroups, selection.get("rule", _D["rule"]))
    return int(_C.index_workspace_bytes(inputs, sel))


def sparse_prefill_workspace_bytes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                   block_size: int = _D["block_size"], block_table=None, seqused_k=None, union: bool = False,
                                   head_subgroups: int = 1, causal: bool = True,
                                   softmax_scale: Optional[float] = None, options: Optional[LaunchOptions] = None,
                                   **selection) -> int:
    """Bytes of the `workspace` of sparse_prefill() (the index and its launch state); 0 for CPU arrays."""
    return index_workspace_bytes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 block_size=block_size, block_table=block_table, seqused_k=seqused_k, union=union,
                                 head_subgroups=head_subgroups, causal=causal, softmax_scale=softmax_scale,
                                 options=options, **selection)


def chunked_prefill_workspace_bytes(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q: int,
                                    max_seqlen_k: int, block_size: int = _D["block_size"], union: bool = False,
                                    head_subgroups: int = 1, options: Optional[LaunchOptions] = None,
                                    **selection) -> int:
    """Bytes of the `workspace` of chunked_prefill(); 0 for CPU arrays."""
    return index_workspace_bytes(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k,
                                 block_size=block_size, block_table=block_table, seqused_k=seqused_k, union=union,
                                 head_subgroups=head_subgroups, options=options, **selection)


def sparse_attention_workspace_bytes(q, k, v, index: Index, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                                     max_seqlen_k: int, block_table=None, seqused_k=None, causal: bool = True,
                                     softmax_scale: Optional[float] = None,
                                     options: Optional[LaunchOptions] = None) -> int:
    """Bytes of the `workspace` of sparse_attention() over a host index with CUDA arrays (0 for a device index, which
    carries its own, and for CPU arrays)."""
    _check_index(index)
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k))
    if index.on_device or not call.lib.cuda:
        return 0
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), 0, options)
    return int(_C.sparse_attention_workspace_bytes(inputs, index._view_tuple(call.lib)))


def _check_index(index: Any) -> None:
    if not isinstance(index, Index):
        raise TypeError(f"index: expected a sparse_prefill.Index (from build_index or union_index), got "
                        f"{type(index).__name__}")


def sparse_attention(q, k, v, index: Index, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     causal: bool = True, softmax_scale: Optional[float] = None, out=None, return_lse: bool = False,
                     block_table=None, seqused_k=None, stream=None, workspace=None, reuse_index: bool = False,
                     options: Optional[LaunchOptions] = None, q_descale=None, k_descale=None, v_descale=None):
    """Attention over the blocks listed in `index` (token-level causal masking still applies), plus the mean
    correction for the dropped, fully visible blocks when index.correction is set.

    The KV arguments are those of attention(). `index` must come from build_index() or union_index() on these very
    arrays (its binding is checked: a different mask, scale, shape, length bound or array raises an error naming the
    argument); reuse_index=True applies it to other arrays of the same problem (e.g. another layer's K/V).
    A device index is read in place; a host index with CUDA arrays is copied to the device once (cached) and
    prepared in `workspace` (sparse_attention_workspace_bytes(...)) or a stream-ordered temporary.
    Returns out, or (out, lse) when return_lse is True.
    """
    _check_index(index)
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                            (q_descale, k_descale, v_descale)), out)
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), stream, options)
    return_lse = _as_bool("return_lse", return_lse)
    reuse_index = _as_bool("reuse_index", reuse_index)
    out_c, lse, out_ret = call.outputs(out, return_lse)
    if index.on_device:
        if workspace is not None:
            raise ValueError("workspace: a device index carries its own workspace; pass workspace= to build_index()")
        lib_ws = library_of(index.workspace)
        if lib_ws != call.lib.compute or not call.lib.cuda:
            raise TypeError(f"index: lives on the device in a {lib_ws} array; pass {lib_ws} CUDA arrays (or use "
                            "index.to_host())")
        _C.sparse_attention_device(inputs, call.c(index.workspace), index._selection, index.binding, call.c(out_c),
                                   call.c(lse), reuse_index)
    else:
        _C.sparse_attention(inputs, index._view_tuple(call.lib), call.c(out_c), call.c(lse),
                            call.c(call.workspace(workspace)), reuse_index)
    return call.result(out_c, lse, out_ret, return_lse)


def sparse_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, alpha: float = _D["alpha"],
                   block_size: int = _D["block_size"], sink: int = _D["sink"], window: int = _D["window"],
                   last_n: int = _D["last_n"], correction: bool = _D["correction"], causal: bool = True, softmax_scale: Optional[float] = None, out=None,
                   return_lse: bool = False, return_index: bool = False, block_table=None, seqused_k=None,
                   stream=None, final_chunk: bool = True, union: bool = False, mean_cache=None,
                   head_subgroups: int = 1, workspace=None, options: Optional[LaunchOptions] = None,
                   rule: str = _D["rule"], q_descale=None, k_descale=None, v_descale=None):
    """build_index() + sparse_attention() in one call (same arguments as the two; rule as in build_index()).

    final_chunk, union and head_subgroups as in build_index() (chunked prefill; head_subgroups splits each GQA group
    into sub-groups selected, and in union mode unioned, on their own). mean_cache: the pooled-means cache of a paged KV
    cache (see mean_cache() and chunked_prefill()), read for the blocks before each chunk and written for the blocks
    the chunk completes. On CUDA the index never leaves the device: it lives in `workspace` (at least
    sparse_prefill_workspace_bytes(...) bytes, 256-byte aligned; the call then allocates nothing and can be captured
    in a CUDA graph) or else in a stream-ordered temporary; no host synchronisation either way. return_index=True
    returns the index as well (build_index() + sparse_attention(); on CUDA a device index).

    Returns out; (out, lse) with return_lse; (out, index) with return_index; (out, lse, index) with both.
    """
    sel = _selection_args(alpha, block_size, sink, window, last_n, correction, final_chunk, union, head_subgroups,
                          rule)
    if not _as_bool("return_index", return_index):
        call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                                (q_descale, k_descale, v_descale)), out)
        mean_k, mean_v, mean_bs = _mean_cache_arrays(mean_cache, call)
        inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), stream, options)
        return_lse = _as_bool("return_lse", return_lse)
        out_c, lse, out_ret = call.outputs(out, return_lse)
        _C.sparse_prefill(inputs, sel, call.c(out_c), call.c(lse), call.c(mean_k), call.c(mean_v),
                          call.c(call.workspace(workspace)), mean_bs)
        return call.result(out_c, lse, out_ret, return_lse)
    if mean_cache is not None and library_of(q) is not None and not _Call(
            _kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                       (q_descale, k_descale, v_descale))).lib.cuda:
        raise ValueError("mean_cache: not supported with return_index=True on the CPU (that path builds the index "
                         "with the reference, which pools every block)")
    index = build_index(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alpha=alpha,
                        block_size=block_size, sink=sink, window=window, last_n=last_n, correction=correction,
                        causal=causal, softmax_scale=softmax_scale, block_table=block_table, seqused_k=seqused_k,
                        stream=stream, final_chunk=final_chunk, union=union, head_subgroups=head_subgroups,
                        workspace=workspace, mean_cache=mean_cache, options=options, rule=rule,
                        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    res = sparse_attention(q, k, v, index, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                           softmax_scale=softmax_scale, out=out, return_lse=return_lse, block_table=block_table,
                           seqused_k=seqused_k, stream=stream, options=options, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale)
    return (res + (index,)) if isinstance(res, tuple) else (res, index)


class MeanCache(tuple):
    """The pair (k_mean, v_mean) that mean_cache() returns, which remembers the block size it was made for (a step
    with another block size raises a ValueError naming mean_cache, also when the slot counts coincide)."""

    block_size: int

    def __new__(cls, k_mean, v_mean, block_size: int):
        self = super().__new__(cls, (k_mean, v_mean))
        self.block_size = int(block_size)
        return self

    def __getnewargs__(self):
        return (self[0], self[1], self.block_size)


def _mean_cache_arrays(mean_cache, call: "_Call") -> tuple:
    """(k_mean, v_mean, the block size the cache was made for or 0); the library rejects a call selecting with
    another block size (MeanCache::block_size)."""
    if mean_cache is None:
        return None, None, 0
    if not isinstance(mean_cache, (tuple, list)) or len(mean_cache) != 2:
        raise TypeError(f"mean_cache: expected a pair (k_mean, v_mean) as returned by mean_cache(), got "
                        f"{type(mean_cache).__name__}")
    for name, x in (("mean_cache.k_mean", mean_cache[0]), ("mean_cache.v_mean", mean_cache[1])):
        if library_of(x) != call.lib.name:
            raise TypeError(f"{name}: is a {library_of(x) or type(x).__name__} array but q is a {call.lib.name} "
                            "array; pass every array of a call from one array library")
        if call.lib.name == "jax":
            raise TypeError(f"{name}: jax arrays are immutable; the mean cache is written in place")
    return mean_cache[0], mean_cache[1], int(getattr(mean_cache, "block_size", 0))


def mean_cache(k_cache, block_size: int = 128):
    """A pooled-means cache for the paged KV cache `k_cache` [num_pages, page_size, Hkv, D]: the pair
    (k_mean, v_mean) of zeroed float32 arrays [mean_cache_slots, Hkv, D] in k_cache's library, on its device.

    Pass it to every chunked_prefill() step of the prompts that use these pages (from their first chunk on): each
    step then reads the means of the blocks earlier chunks completed and pools only the blocks its own chunk completes
    plus each sequence's tail block, instead of re-pooling the whole cache. A complete block's means live in the slot
    of the page holding its last key (page * (page_size // block_size) + offset when pages hold whole blocks), so
    pages shared between sequences (prefix caching) share their slots, and a page reused for new tokens has its slot
    rewritten by the step that completes its block. page_size and block_size must divide one another. The cache
    holds the real KV heads (Hkv), whatever head_subgroups the steps use.
    """
    if library_of(k_cache) is None:
        raise TypeError(f"k_cache: expected an array, got {type(k_cache).__name__}")
    if library_of(k_cache) == "jax":
        raise TypeError("k_cache: jax arrays are immutable; the mean cache is written in place (use torch or cupy)")
    shape = tuple(int(s) for s in k_cache.shape)
    if len(shape) != 4:
        raise ValueError(f"k_cache: expected a paged cache [num_pages, page_size, Hkv, D], got shape {shape}")
    block_size = _as_int("block_size", block_size)
    num_pages, page_size, hkv, d = shape
    if block_size <= 0 or block_size % 64 != 0:
        raise ValueError(f"block_size: must be a positive multiple of 64, got {block_size}")
    if page_size % block_size != 0 and block_size % page_size != 0:
        raise ValueError(f"block_size: page_size ({page_size}) and block_size ({block_size}) must divide one another")
    lib = ArrayLib(library_of(k_cache), k_cache)
    slots = int(_C.mean_cache_slots(num_pages, page_size, block_size))
    return MeanCache(lib.zeros((slots, hkv, d), "float32"), lib.zeros((slots, hkv, d), "float32"), block_size)


def chunked_prefill(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q: int, max_seqlen_k: int,
                    *, final_chunk: bool, union: bool = False, alpha: float = _D["alpha"],
                    block_size: int = _D["block_size"], sink: int = _D["sink"], window: int = _D["window"],
                    last_n: int = _D["last_n"], correction: bool = _D["correction"],
                    softmax_scale: Optional[float] = None, out=None, return_lse: bool = False, stream=None,
                    mean_cache=None, head_subgroups: int = 1, workspace=None,
                    options: Optional[LaunchOptions] = None, rule: str = _D["rule"], q_descale=None,
                    k_descale=None, v_descale=None):
    """One chunked-prefill step over a paged KV cache: for each sequence b, its chunk of queries
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] (the last positions of what the cache holds: the chunk's own K/V must already
    be appended) against its whole cache of seqused_k[b] tokens, causal bottom-right, block-sparse.

    final_chunk (required): whether these chunks end their prompts. Only then do the last `last_n` query tiles run
    dense (they serve the prompt's final queries); mid-prompt chunks skip that tail. union: one block list per
    (sequence, KV head), the union of its tiles' lists (CompactAttention), else per-tile lists (FlashPrefill V2;
    faster on all 36 measured steps of bench/results/chunked_h200.json, hence the default). head_subgroups (S, dividing Hq // Hkv): each GQA group
    is split into S sub-groups of query heads selected on their own, so in union mode the union is per (sequence,
    sub-group) instead of over the whole group (CompactAttention's option for large groups; on the topic workload
    at 128K it lowered the union density by a few % only, bench/results/chunked_subgroups_h200.json). rule: as in
    build_index() ('row_max', the default, or 'tile_energy'). Everything else is sparse_prefill()'s.

    mean_cache: the pair from mean_cache(k_cache, block_size), passed to every step of the prompt from its first
    chunk on: the step reads the means of the blocks before its chunk from it and writes the blocks its chunk
    completes, so selection costs O(chunk + cache / block_size) instead of re-pooling the whole cache.

    workspace (CUDA): at least chunked_prefill_workspace_bytes(...) bytes, allocated once and passed to every step on
    one stream: the step then allocates nothing, never synchronises and can be captured in a CUDA graph.

    Checks beyond attention()'s: for host arrays, every chunk fits in its cache (chunk length <= seqused_k[b]) and
    max_seqlen_k bounds the cache lengths. Device arrays are trusted, as cu_seqlens are (reading them would
    synchronise).
    """
    final_chunk = _as_bool("final_chunk", final_chunk)
    union = _as_bool("union", union)
    if block_table is None or seqused_k is None:
        raise ValueError("block_table: chunked_prefill runs over a paged KV cache; pass block_table and seqused_k")
    call = _Call(_kv_arrays(q, k_cache, v_cache, cu_seqlens_q, None, block_table, seqused_k,
                            (q_descale, k_descale, v_descale)), out)
    if not call.lib.cuda:
        cu = to_numpy(cu_seqlens_q).astype(np.int64).reshape(-1)
        used = to_numpy(seqused_k).astype(np.int64).reshape(-1)
        if cu.shape[0] == used.shape[0] + 1:
            chunk = np.diff(cu)
            short = np.nonzero(chunk > used)[0]
            if short.size:
                b = int(short[0])
                raise ValueError(f"seqused_k: sequence {b} holds {int(used[b])} tokens, fewer than its chunk of "
                                 f"{int(chunk[b])} queries (append the chunk's K/V to the cache first)")
            if used.size and int(used.max()) > _as_int("max_seqlen_k", max_seqlen_k):
                raise ValueError(f"max_seqlen_k: {int(max_seqlen_k)} is below the longest cache "
                                 f"(seqused_k has {int(used.max())})")
    return sparse_prefill(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, alpha=alpha,
                          block_size=block_size, sink=sink, window=window, last_n=last_n, correction=correction,
                          causal=True, softmax_scale=softmax_scale, out=out, return_lse=return_lse,
                          block_table=block_table, seqused_k=seqused_k, stream=stream, final_chunk=final_chunk,
                          union=union, mean_cache=mean_cache, head_subgroups=head_subgroups, workspace=workspace,
                          options=options, rule=rule, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def union_index(index: Index, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                causal: bool = True, softmax_scale: Optional[float] = None, block_table=None, seqused_k=None,
                stream=None) -> Index:
    """Chunked-prefill lowering: one ascending block list per (sequence, KV head), the union of the lists of all
    its tiles (always-kept blocks included); every tile's segment points at the shared list (mode 'union'). With
    index.head_subgroups > 1 the KV heads are the index's virtual heads: one list per sub-group.

    Pass the inputs `index` was built from (the shapes and lengths are needed to lay the segments out).
    """
    if not isinstance(index, Index):
        raise TypeError(f"index: expected a sparse_prefill.Index, got {type(index).__name__}")
    index = index.to_host()
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k))
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), stream)
    d = _C.union_index(inputs, index._host_tuple())
    return Index(d, call.lib, call.arrays["cu_seqlens_q"], "union")


def pool_kv(k, v, cu_seqlens_k, block_size: int = 128, max_seqlen_k: Optional[int] = None, block_table=None,
            seqused_k=None, stream=None):
    """Pooled block means of K and V: block J of sequence b averages its keys (a tail block its valid keys).

    Contiguous (k, v [total_k, Hkv, D] + cu_seqlens_k) or paged (k, v [num_pages, page_size, Hkv, D] + block_table +
    seqused_k, cu_seqlens_k=None) KV. max_seqlen_k defaults to the longest sequence (read from the host).

    Returns:
        (k_mean, v_mean, cu_blocks): [total_blocks, Hkv, D] float32 twice and [B+1] int32 block offsets, in k's
        array library and device.
    """
    block_size = _as_int32("block_size", block_size)
    call = _Call({"k": k, "v": v, "cu_seqlens_k": cu_seqlens_k, "block_table": block_table,
                  "seqused_k": seqused_k}, ref="k")
    a = call.arrays
    paged = block_table is not None
    kv_rank = 4 if paged else 3
    if len(a["k"].shape) != kv_rank:
        raise ValueError(f"k: expected a {kv_rank}-dimensional array "
                         f"{'[num_pages, page_size, Hkv, D]' if paged else '[total_k, Hkv, D]'}, got shape "
                         f"{tuple(a['k'].shape)}")
    if paged:
        bt = a["block_table"]
        if len(bt.shape) != 2 or bt.shape[0] < 1:
            raise ValueError(f"block_table: expected a 2-dimensional array [B, max_pages] with B >= 1, got shape "
                             f"{tuple(bt.shape)}")
        batch = int(bt.shape[0])
    else:
        cu = a["cu_seqlens_k"]
        if cu is None:
            raise ValueError("cu_seqlens_k: is required with contiguous KV (or pass block_table and seqused_k)")
        if len(cu.shape) != 1 or cu.shape[0] < 2:
            raise ValueError(f"cu_seqlens_k: expected a 1-dimensional array of B+1 >= 2 entries, got shape "
                             f"{tuple(cu.shape)}")
        batch = int(cu.shape[0]) - 1
    if max_seqlen_k is None:
        if paged:
            used = to_numpy(a["seqused_k"]) if a["seqused_k"] is not None else np.zeros(0)
            max_seqlen_k = int(used.max()) if used.size else 0
        else:
            max_seqlen_k = int(np.diff(to_numpy(a["cu_seqlens_k"]).astype(np.int64)).max())
    # The C++ entry point takes full attention inputs; q is a zero-row stand-in (group size 1) used for shapes only.
    kw = a["k"]
    a["q"] = call.lib.empty((0, kw.shape[-2], kw.shape[-1]), kw.dtype)
    a["cu_seqlens_q"] = call.lib.zeros((batch + 1,), "int32")
    inputs = call.inputs(0, max_seqlen_k, True, None, (-1, -1), stream)
    try:
        d = _C.pool_kv(inputs, block_size)
    except (ValueError, TypeError) as e:
        if getattr(e, "argument", None) != "q":
            raise
        # the stand-in q mirrors k's head count and head dim: report its problems against k
        err = type(e)("k" + str(e)[1:])
        err.argument = "k"
        raise err from None
    return tuple(call.lib.wrap_out(call.lib.from_numpy(d[n])) for n in ("k_mean", "v_mean", "cu_blocks"))

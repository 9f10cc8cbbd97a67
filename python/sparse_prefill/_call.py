"""One call's arguments: the Python-side checks and conversions every public function shares (see sparse_prefill._api
for the shapes and conventions): the scalar coercions (_as_int, _as_int32, _as_bool, _as_float, _as_window),
LaunchOptions, check_errors, _Call (one call's arrays, checked and converted for the extension into one _C.Inputs;
qkv_dtype= bit patterns, _as_qkv_dtype), _kv_arrays and the mean-cache argument (_mean_cache_arrays)."""

from __future__ import annotations

import numbers
import operator
from typing import Any, Tuple

import numpy as np

from . import _C
from ._arrays import ArrayLib, library_of, resolve_stream
from ._arrays import DATA_ARRAYS, _dtype_name, normalize_dtypes

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


def make_inputs(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, cu_seqlens_k, block_table, seqused_k, causal,
                softmax_scale, window_left, window_right, stream, options, q_descale, k_descale, v_descale) -> Any:
    """The one place a call's _C.Inputs is made (the public functions through _Call.inputs, the torch operators
    directly): arrays as the extension takes them (DLPack capsules or None), scalars already checked."""
    return _C.Inputs(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, cu_seqlens_k=cu_seqlens_k,
                     block_table=block_table, seqused_k=seqused_k, causal=causal, softmax_scale=softmax_scale,
                     window_left=window_left, window_right=window_right, stream=stream, options=options,
                     q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


class LaunchOptions:
    """CUDA kernel choices the library otherwise makes from the shapes, for A/B benchmarks and tests (the defaults are
    the measured best, docs/design/dense_kernel.md). Pass as `options=` to any compute function; ignored on the CPU.

    Args:
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
        if not isinstance(dense_path, str) or dense_path not in self._PATHS:
            raise ValueError(f"dense_path: expected one of {sorted(self._PATHS)}, got {dense_path!r}")
        self.dense_path = dense_path
        self.split_kv = _as_bool("split_kv", split_kv)
        self.checked = _as_bool("checked", checked)

    def _native(self):
        """The extension's LaunchOptions (made per call: the attributes may have changed since construction)."""
        return _C.LaunchOptions(dense_path=self._PATHS[self.dense_path], split_kv=self.split_kv, checked=self.checked)

    def __repr__(self) -> str:
        return f"LaunchOptions(dense_path={self.dense_path!r}, split_kv={self.split_kv}, checked={self.checked})"


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

    Args:
        stream: the stream to synchronise: None (the current torch stream), an int handle, a torch.cuda.Stream or a
            cupy Stream.
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


def _launch_options(options: Any) -> Any:
    """The extension's LaunchOptions of `options`; None: the library's defaults."""
    if options is None:
        return None
    if not isinstance(options, LaunchOptions):
        raise TypeError(f"options: expected a sparse_prefill.LaunchOptions, got {type(options).__name__}")
    return options._native()


def _type_error(name: str, message: str) -> TypeError:
    err = TypeError(f"{name}: {message}")
    err.argument = name
    return err


_QKV_DTYPES = ("float8_e4m3fn",)


def _as_qkv_dtype(value: Any) -> Any:
    """None, or the name of the dtype whose bit patterns uint8 q, k, v hold ('float8_e4m3fn'). Takes the name or a
    dtype object that spells it (torch.float8_e4m3fn, an ml_dtypes / jax float8_e4m3fn dtype or scalar type)."""
    if value is None:
        return None
    if isinstance(value, str):
        name = value
    elif isinstance(value, type):
        name = getattr(value, "__name__", "")
    else:
        name = str(value).replace("torch.", "")
    if name not in _QKV_DTYPES:
        raise ValueError(f"qkv_dtype: expected None or 'float8_e4m3fn' (q, k and v given as uint8 arrays of "
                         f"float8_e4m3fn bit patterns), got {value!r}")
    return name


class _Call:
    """One call's arrays, checked for kind and array library, converted for the extension.

    `ref` names the array whose library and device the call uses (q, or k for pool_kv). `qkv_dtype`
    ('float8_e4m3fn' or None, _as_qkv_dtype): q, k and v are uint8 arrays of float8_e4m3fn bit patterns, read as
    float8_e4m3fn where they enter the extension (inputs(); torch: Tensor.view, other libraries: _C.bit_view, zero
    copy); `out` is then bfloat16 bit patterns in uint16 (allocated so; a caller's out may be uint16 or bfloat16).
    """

    _REQUIRED = ("q", "k", "v", "cu_seqlens_q")

    def __init__(self, arrays: dict, out: Any = None, ref: str = "q", qkv_dtype: Any = None):
        self.bits = _as_qkv_dtype(qkv_dtype)
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
        self._check_bits()
        if "q" in self.arrays:
            qw = self.arrays["q"]
            if len(qw.shape) != 3:
                raise ValueError(f"q: expected a 3-dimensional array [total_q, Hq, D], got shape {tuple(qw.shape)}")

    def _check_bits(self) -> None:
        """With qkv_dtype, every data array is uint8; without it, a uint8 q gets a pointer to qkv_dtype (the error
        is the extension's, which also refuses uint8 k or v against another q)."""
        if self.bits is None:
            q = self.arrays.get("q")
            if q is not None and _dtype_name(q) == "uint8":
                raise _type_error("q", "dtype must be float16, bfloat16, float32 or float8_e4m3fn, got uint8 (for "
                                       "uint8 arrays of float8_e4m3fn bit patterns pass qkv_dtype='float8_e4m3fn')")
            return
        for name in DATA_ARRAYS:
            x = self.arrays.get(name)
            if x is None:
                continue  # pool_kv: q is made later, in k's dtype
            dt = _dtype_name(x)
            if dt != "uint8":
                hint = " (a float8_e4m3fn array needs no qkv_dtype)" if dt in _FP8 else ""
                raise _type_error(name, f"dtype {dt} is not uint8: qkv_dtype={self.bits!r} takes q, k and v as "
                                        f"uint8 arrays of {self.bits} bit patterns{hint}")

    def _data(self, name: str, x: Any) -> Any:
        """q, k or v as handed to the extension: uint8 bit patterns read as float8_e4m3fn with qkv_dtype."""
        if self.bits is None or x is None:
            return self.c(x)
        if self.lib.compute == "torch":
            import torch
            return self.c(x.view(torch.float8_e4m3fn))
        return _C.bit_view(x, self.bits, False, name)

    def c_out(self, out: Any) -> Any:
        """out as handed to the extension: with qkv_dtype, a uint16 out is read as bfloat16."""
        if self.bits is None or _dtype_name(out) != "uint16":
            return self.c(out)
        if self.lib.compute == "torch":
            import torch
            return self.c(out.view(torch.bfloat16))
        return _C.bit_view(out, "bfloat16", True, "out")

    def _wrap(self, x: Any) -> Any:
        x = self.lib.wrap_in(x)
        if self.lib.compute == "torch" and x is not None and x.requires_grad:
            x = x.detach()  # forward only; DLPack refuses tensors that require grad
        return x

    def inputs(self, max_seqlen_q: Any, max_seqlen_k: Any, causal: Any, softmax_scale: Any,
               window: Any = (-1, -1), stream: Any = None, options: Any = None) -> Any:
        """The call's _C.Inputs: made once, it holds the arrays, so every extension call of this call shares it."""
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
        d = self._data
        return make_inputs(d("q", a["q"]), d("k", a["k"]), d("v", a["v"]), c(a["cu_seqlens_q"]), max_q, max_k,
                           c(a.get("cu_seqlens_k")), c(a.get("block_table")), c(a.get("seqused_k")),
                           _as_bool("causal", causal), scale, left, right, resolve_stream(stream, self.lib),
                           _launch_options(options), c(a.get("q_descale")), c(a.get("k_descale")),
                           c(a.get("v_descale")))

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
        if out is None:  # q's dtype; bfloat16 for FP8 inputs, as uint16 bit patterns for qkv_dtype
            dtype = "uint16" if self.bits else "bfloat16" if _dtype_name(q) in _FP8 else q.dtype
            out_c = self.lib.empty(q.shape, dtype)
            out_ret = None
        else:
            out_c = out
            if self.lib.compute == "torch" and out.requires_grad:
                raise TypeError("out: must not require grad (it is written in place)")
            if self.bits and _dtype_name(out) not in ("uint16", "bfloat16"):
                raise _type_error("out", f"dtype {_dtype_name(out)} must be uint16 (bfloat16 bit patterns) or "
                                         f"bfloat16 for qkv_dtype={self.bits!r} inputs")
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


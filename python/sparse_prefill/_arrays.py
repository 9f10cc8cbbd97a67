"""Array-library plumbing: recognise the caller's array library, allocate outputs in it, resolve the CUDA stream.

The compute itself never depends on a library: the extension takes any DLPack array. What depends on the library is
(a) allocating `out`/`lse` (and the index arrays) where the caller expects them, and (b) the default CUDA stream.

Supported libraries
    numpy  CPU. bfloat16 through ml_dtypes when it is installed (numpy itself has no bfloat16).
    torch  CPU and CUDA; outputs on the device of `q`; stream = torch.cuda.current_stream(device).
    cupy   CUDA; stream = cupy's current stream.
    jax    CPU arrays are computed through numpy views and the results converted back to jax arrays; CUDA arrays
           go through cupy (zero copy, needs cupy installed). jax arrays are immutable, so `out=` is rejected.
Any other DLPack producer on the CPU is read through numpy.from_dlpack and gets numpy outputs.
torch, cupy and jax are never imported by this package: a library is only recognised when the caller already
imported it (it is found in sys.modules).

dtypes (normalize_dtypes, applied to every call's inputs before the extension sees them)
    q, k, v       float64 is refused (TypeError naming the argument, saying to pass float32 (CPU), float16 or
                  bfloat16): silently halving the precision of the caller's data would hide a mistake.
    cu_seqlens_q, cu_seqlens_k, block_table, seqused_k
                  int32. numpy's default int64 is accepted on the host (numpy, torch CPU, jax CPU, other DLPack)
                  and converted to int32 when every value fits (a host copy of a few bytes per sequence or page);
                  a value outside int32 is a ValueError. On CUDA an int64 index array is refused (TypeError: pass
                  int32, e.g. x.to(torch.int32)): a conversion there would allocate and launch on the caller's stream.
    uint8 q, k, v  float8_e4m3fn bit patterns when the call says so (qkv_dtype='float8_e4m3fn', _call._Call); without
                  it they are refused (uint8 is for workspaces).
    Other dtypes go to the extension, which names the argument and lists the supported dtypes.
"""

from __future__ import annotations

import operator
import sys
from typing import Any, Optional, Sequence, Tuple

import numpy as np

__all__ = ["library_of", "is_cuda", "ArrayLib", "resolve_stream", "normalize_dtypes"]

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _module(name: str):
    return sys.modules.get(name)


def library_of(x: Any) -> Optional[str]:
    """'numpy', 'torch', 'cupy', 'jax', 'dlpack' (another DLPack producer) or None (not an array)."""
    if isinstance(x, np.ndarray):
        return "numpy"
    torch = _module("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    cupy = _module("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    jax = _module("jax")
    if jax is not None and isinstance(x, getattr(jax, "Array", ())):
        return "jax"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return "dlpack"
    return None


def dlpack_device(x: Any) -> Tuple[int, int]:
    if isinstance(x, np.ndarray):
        return (_DL_CPU, 0)
    dev = x.__dlpack_device__()
    return (int(dev[0]), int(dev[1]))


def is_cuda(x: Any) -> bool:
    return dlpack_device(x)[0] in (_DL_CUDA, _DL_CUDA_MANAGED)


def _numpy_dtype(dtype: Any):
    """numpy dtype for a dtype name; bfloat16 needs ml_dtypes."""
    if dtype == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401  (optional)
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise TypeError("q: bfloat16 numpy arrays need the ml_dtypes package; use torch for bfloat16") from e
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


class ArrayLib:
    """Allocation in one array library, on the device of a reference array (q).

    `wrap_in` converts an input of this library into what the extension receives (identity except for jax);
    `wrap_out` converts a result back (identity except for jax).
    """

    def __init__(self, name: str, ref: Any):
        self.name = name
        self.ref = ref
        self.cuda = is_cuda(ref)
        self.device_id = dlpack_device(ref)[1]
        # jax goes through numpy (CPU) or cupy (CUDA)
        self.compute = name
        if name == "jax":
            self.compute = "cupy" if self.cuda else "numpy"
            if self.cuda and _module("cupy") is None:
                try:
                    import cupy  # noqa: F401
                except ImportError as e:
                    raise TypeError("q: jax arrays on CUDA need cupy installed (used for zero-copy outputs)") from e
        elif name == "dlpack":
            if self.cuda:
                raise TypeError(f"q: CUDA arrays of type {type(ref).__name__} are not supported for allocating "
                                "outputs; use torch, cupy or jax arrays")
            self.compute = "numpy"

    # -- conversion of inputs / results -------------------------------------------------------------------------
    def wrap_in(self, x: Any) -> Any:
        if x is None:
            return None
        if self.name == "jax":
            if self.compute == "numpy":
                return np.asarray(x)
            import cupy
            return cupy.from_dlpack(x)
        if self.name == "dlpack":
            return np.from_dlpack(x)
        return x

    def wrap_out(self, x: Any) -> Any:
        if self.name == "jax" and x is not None:
            import jax
            import jax.numpy as jnp
            if self.compute == "numpy":
                return jnp.asarray(x)
            return jax.dlpack.from_dlpack(x)
        return x

    # -- allocation ---------------------------------------------------------------------------------------------
    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """An uninitialised array; `dtype` is a native dtype of the compute library or a name ('float32', 'int32')."""
        shape = tuple(int(s) for s in shape)
        c = self.compute
        if c == "numpy":
            return np.empty(shape, dtype=_numpy_dtype(dtype) if isinstance(dtype, str) else dtype)
        if c == "torch":
            import torch
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
            return torch.empty(shape, dtype=dtype, device=self.ref.device)
        if c == "cupy":
            import cupy
            with cupy.cuda.Device(self.device_id):
                return cupy.empty(shape, dtype=dtype)
        raise AssertionError(c)

    def zeros(self, shape: Sequence[int], dtype: Any) -> Any:
        c = self.compute
        if c == "numpy":
            return np.zeros(tuple(shape), dtype=dtype)
        if c == "torch":
            import torch
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
            return torch.zeros(tuple(shape), dtype=dtype, device=self.ref.device)
        import cupy
        with cupy.cuda.Device(self.device_id):
            return cupy.zeros(tuple(shape), dtype=dtype)

    def from_numpy(self, a: np.ndarray) -> Any:
        """A host numpy array moved to this library/device (numpy arrays stay as they are)."""
        c = self.compute
        if c == "numpy":
            return a
        if c == "torch":
            import torch
            t = torch.from_numpy(np.ascontiguousarray(a))
            return t.to(self.ref.device) if self.cuda else t
        import cupy
        with cupy.cuda.Device(self.device_id):
            return cupy.asarray(a)


def to_numpy(x: Any) -> np.ndarray:
    """A host numpy copy/view of any supported array."""
    if isinstance(x, np.ndarray):
        return x
    lib = library_of(x)
    if lib == "torch":
        return x.detach().cpu().numpy()
    if lib == "cupy":
        return x.get()
    if lib == "jax":
        return np.asarray(x)
    return np.from_dlpack(x)


def resolve_stream(stream: Any, lib: ArrayLib) -> int:
    """The CUDA stream handle (an int) passed to C++.

    None -> the current stream of the caller's library when the arrays are CUDA (torch: torch.cuda.current_stream;
    cupy: cupy.cuda.get_current_stream; jax: torch's current stream when torch is loaded, else 0), 0 on the CPU.
    Also accepts an int, a torch.cuda.Stream (.cuda_stream) or a cupy Stream (.ptr).
    """
    if stream is None:
        if not lib.cuda:
            return 0
        if lib.name == "torch" or (lib.name != "cupy" and _module("torch") is not None):
            torch = _module("torch")
            if torch is not None and torch.cuda.is_available():
                return int(torch.cuda.current_stream(lib.device_id).cuda_stream)
            return 0
        if lib.compute == "cupy":
            import cupy
            return int(cupy.cuda.get_current_stream().ptr)
        return 0
    if isinstance(stream, bool):
        raise TypeError("stream: expected an int, a torch.cuda.Stream or a cupy Stream, got bool")
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    if hasattr(stream, "ptr") and not isinstance(stream, (int, np.integer)):
        return int(stream.ptr)
    try:
        value = operator.index(stream)
    except TypeError:
        raise TypeError("stream: expected an int, a torch.cuda.Stream or a cupy Stream, got "
                        f"{type(stream).__name__}") from None
    if not 0 <= value < 2**64:
        raise ValueError(f"stream: must be a non-negative 64-bit handle, got {value}")
    return value


# ---------------------------------------------------------------------------------------------------------------------
# numpy defaults (int64 index arrays, float64 data): the rule in the module docstring
# ---------------------------------------------------------------------------------------------------------------------

INDEX_ARRAYS = ("cu_seqlens_q", "cu_seqlens_k", "block_table", "seqused_k")
DATA_ARRAYS = ("q", "k", "v")
_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1


def _dtype_name(x: Any) -> str:
    """'int64', 'float64', ... for numpy, torch and cupy arrays ('' when unknown)."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        return ""
    return str(dt).replace("torch.", "")


def _cast_hint(name: str, lib: ArrayLib, dtype: str) -> str:
    if lib.compute == "torch":
        return f"{name}.to(torch.{dtype})"
    if lib.compute == "cupy":
        return f"{name}.astype(cupy.{dtype})"
    return f"{name}.astype(np.{dtype})"


def _host_int64_to_int32(name: str, x: Any, lib: ArrayLib) -> Any:
    if lib.compute == "torch":
        lo, hi = (int(x.min()), int(x.max())) if x.numel() else (0, 0)
    else:
        a = np.asarray(x)
        lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    if lo < _INT32_MIN or hi > _INT32_MAX:
        bad = hi if hi > _INT32_MAX else lo
        raise ValueError(f"{name}: int64 value {bad} does not fit in int32 (index arrays are int32); pass int32 "
                         f"values, e.g. {_cast_hint(name, lib, 'int32')}")
    if lib.compute == "torch":
        import torch
        return x.to(torch.int32)
    return np.asarray(x).astype(np.int32)


def normalize_dtypes(arrays: dict, lib: ArrayLib) -> dict:
    """The call's input arrays (already through ArrayLib.wrap_in) with the dtype rule applied: host int64 index
    arrays converted to int32, float64 data and CUDA int64 index arrays refused. Other arrays are returned as
    they are (the extension checks them)."""
    out = dict(arrays)
    for name in DATA_ARRAYS:
        x = out.get(name)
        if x is not None and _dtype_name(x) == "float64":
            hint = _cast_hint(name, lib, "bfloat16" if lib.cuda else "float32")
            raise TypeError(f"{name}: float64 is not supported; pass float16 or bfloat16 (CPU and CUDA) or float32 "
                            f"(CPU), e.g. {hint}")
    for name in INDEX_ARRAYS:
        x = out.get(name)
        if x is None or _dtype_name(x) != "int64":
            continue
        if is_cuda(x):
            raise TypeError(f"{name}: int64 is not supported on CUDA; pass int32 (e.g. "
                            f"{_cast_hint(name, lib, 'int32')})")
        out[name] = _host_int64_to_int32(name, x, lib)
    return out

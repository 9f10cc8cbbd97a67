"""When a build of this tree compiles the CUDA backend without CUTLASS headers of its own, and so needs the
nvidia-cutlass wheel as a build requirement (sparse_prefill_build.py lists the cases). Kept apart from
the backend so that tests import it without scikit-build-core (tests/python/test_build_backend.py)."""

from __future__ import annotations

import os
import shutil
from typing import Callable, Mapping, Optional

CUTLASS_REQUIREMENT = "nvidia-cutlass==4.2.0.0"


def _define(config_settings: Optional[Mapping], name: str) -> Optional[str]:
    """The value of `-C cmake.define.<name>=...`, or None."""
    value = (config_settings or {}).get(f"cmake.define.{name}")
    if isinstance(value, list):  # pip passes a repeated setting as a list: the last one wins, as in CMake
        value = value[-1] if value else None
    return value


def needs_cutlass(config_settings: Optional[Mapping] = None, environ: Mapping[str, str] = os.environ,
                  which: Callable[[str], Optional[str]] = shutil.which) -> bool:
    """Whether this build compiles the CUDA backend without headers of its own (see sparse_prefill_build.py)."""
    if _define(config_settings, "SP_CUTLASS_ROOT"):
        return False
    mode = _define(config_settings, "SPARSE_PREFILL_CUDA") or "AUTO"
    if mode != "AUTO":
        return mode == "ON"  # OFF; CMakeLists.txt refuses any other value, naming SPARSE_PREFILL_CUDA
    if _define(config_settings, "CMAKE_CUDA_COMPILER") or environ.get("CUDACXX"):
        return True
    cuda_path = environ.get("CUDA_PATH")
    return bool(which("nvcc")) or bool(cuda_path and os.path.isfile(os.path.join(cuda_path, "bin", "nvcc")))

"""The build backend of `pip install .`: scikit-build-core, plus the CUTLASS/CuTe headers when they are needed.

A CUDA build compiles against the CUTLASS/CuTe headers, which come from the PyPI wheel nvidia-cutlass (its
cutlass_library/source/include and tools/util/include). pip builds in an isolated environment that holds only the
build requirements, so the headers must be one of them; a CPU-only build does not need them (nor the wheel's
dependencies, ~350 MB with scipy and cuda-python), so they are asked for only when CMake will compile CUDA:

  - `-C cmake.define.SPARSE_PREFILL_CUDA=OFF`                  no CUTLASS (CPU backend only);
  - `-C cmake.define.SP_CUTLASS_ROOT=<dir>`                    no CUTLASS wheel (the given headers are used);
  - `-C cmake.define.SPARSE_PREFILL_CUDA=ON`                   the wheel;
  - otherwise (AUTO, the default)                              the wheel where CMake will find nvcc, i.e. where
    `-C cmake.define.CMAKE_CUDA_COMPILER=...` is given, the CUDACXX variable is set, `nvcc` is on PATH or
    $CUDA_PATH/bin/nvcc exists (CMake's own search for the CUDA compiler, check_language(CUDA)).

CMakeLists.txt then finds the headers through the build's Python (`cutlass_library` in the isolated environment).
With --no-build-isolation pip asks no backend for requirements: the headers then come from SP_CUTLASS_ROOT, the
environment's own nvidia-cutlass or .deps/cutlass (see CMakeLists.txt).

Everything else is scikit-build-core's backend, unchanged.
"""

from __future__ import annotations

from scikit_build_core import build as _skbuild
from scikit_build_core.build import *  # noqa: F401,F403  (the PEP 517 hooks: build_wheel, build_sdist, ...)

from sparse_prefill_build_rules import CUTLASS_REQUIREMENT, needs_cutlass  # this folder is the backend-path (pyproject.toml)


def get_requires_for_build_wheel(config_settings=None):
    extra = [CUTLASS_REQUIREMENT] if needs_cutlass(config_settings) else []
    return _skbuild.get_requires_for_build_wheel(config_settings) + extra


def get_requires_for_build_editable(config_settings=None):
    extra = [CUTLASS_REQUIREMENT] if needs_cutlass(config_settings) else []
    return _skbuild.get_requires_for_build_editable(config_settings) + extra

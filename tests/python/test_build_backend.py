"""The build backend's one rule (python/build_backend): `pip install .` asks for the CUTLASS wheel exactly when the
build compiles the CUDA backend without headers of its own, mirroring CMakeLists.txt's SPARSE_PREFILL_CUDA logic."""

import importlib.util
import os

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RULES = os.path.join(_REPO, "python", "build_backend", "sparse_prefill_build_rules.py")
if not os.path.exists(_RULES):
    pytest.skip("no source tree beside the tests", allow_module_level=True)
_spec = importlib.util.spec_from_file_location("sparse_prefill_build_rules", _RULES)
rules = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rules)

NVCC = lambda name: "/opt/cuda/bin/nvcc" if name == "nvcc" else None  # noqa: E731
NO_NVCC = lambda name: None  # noqa: E731


def needs(settings=None, environ=None, which=NO_NVCC):
    return rules.needs_cutlass(settings, environ or {}, which)


def test_auto_follows_nvcc_on_path():
    assert needs(which=NVCC)
    assert not needs(which=NO_NVCC)


def test_auto_follows_cmakes_other_ways_to_find_nvcc(tmp_path):
    assert needs(environ={"CUDACXX": "/somewhere/nvcc"})
    assert needs({"cmake.define.CMAKE_CUDA_COMPILER": "/somewhere/nvcc"})
    (tmp_path / "bin").mkdir()
    assert not needs(environ={"CUDA_PATH": str(tmp_path)})
    (tmp_path / "bin" / "nvcc").write_text("")
    assert needs(environ={"CUDA_PATH": str(tmp_path)})


def test_explicit_settings_win():
    assert not needs({"cmake.define.SPARSE_PREFILL_CUDA": "OFF"}, which=NVCC)
    assert needs({"cmake.define.SPARSE_PREFILL_CUDA": "ON"}, which=NO_NVCC)
    assert needs({"cmake.define.SPARSE_PREFILL_CUDA": "AUTO"}, which=NVCC)
    # headers of its own: no wheel, whatever the mode
    assert not needs({"cmake.define.SP_CUTLASS_ROOT": "/x/cutlass", "cmake.define.SPARSE_PREFILL_CUDA": "ON"})
    assert not needs({"cmake.define.SP_CUTLASS_ROOT": "/x/cutlass"}, which=NVCC)
    # a repeated -C setting arrives as a list: the last one wins
    assert not needs({"cmake.define.SPARSE_PREFILL_CUDA": ["ON", "OFF"]}, which=NVCC)


def test_the_requirement_is_the_pinned_wheel():
    assert rules.CUTLASS_REQUIREMENT == "nvidia-cutlass==4.2.0.0"
    with open(os.path.join(_REPO, "CMakeLists.txt")) as f:
        assert rules.CUTLASS_REQUIREMENT in f.read()   # the error message names the same pin

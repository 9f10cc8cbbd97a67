"""The optional-dependency extras state the range the tests cover, and CI tests its lower end (issue 43: '.[torch]'
installed an unpinned torch, 2.15 that day, while the tests pinned 2.11). Pure Python: pyproject.toml,
scripts/test.sh and scripts/extra_pins.py of the source tree (skipped without one)."""

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PYPROJECT = os.path.join(_REPO, "pyproject.toml")
_TEST_SH = os.path.join(_REPO, "scripts", "test.sh")
_PINS = os.path.join(_REPO, "scripts", "extra_pins.py")
# the extras that install what the torch-dependent tests need, and the one scripts/test.sh installs (it holds both)
_RANGED = ("torch", "hf")
_TESTED = "hf"

if not all(os.path.exists(p) for p in (_PYPROJECT, _TEST_SH, _PINS)):
    pytest.skip("no source tree beside the tests", allow_module_level=True)


def _extras() -> dict:
    with open(_PYPROJECT, "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _helper():
    spec = importlib.util.spec_from_file_location("extra_pins", _PINS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _release(version: str) -> tuple:
    """The release segment of a version as ints ('2.11.0+cu130' -> (2, 11, 0)), padded as PEP 440 compares."""
    parts = tuple(int(x) for x in re.match(r"\d+(?:\.\d+)*", version).group(0).split("."))
    return parts + (0,) * (4 - len(parts))


def test_extras_state_a_lower_and_an_upper_bound():
    extras, pins = _extras(), _helper()
    for extra in _RANGED:
        assert extras[extra], extra
        for req in extras[extra]:
            name, lower, upper = pins.bounds(req)  # raises naming the requirement without both bounds
            assert _release(lower) < _release(upper), req
    # torch's range is one range: the same in both extras
    torch_specs = {req for extra in _RANGED for req in extras[extra] if pins.bounds(req)[0] == "torch"}
    assert len(torch_specs) == 1, torch_specs
    # hf holds everything torch does (scripts/test.sh installs hf's lower bounds for both)
    assert set(extras["torch"]) <= set(extras[_TESTED])


def test_unbounded_requirements_are_refused():
    pins = _helper()
    for req in ("torch", "torch>=2.11.0", "torch<2.12", "transformers>=4.48"):
        with pytest.raises(ValueError, match=f"^{re.escape(req)}: state the tested range"):
            pins.bounds(req)
    with pytest.raises(ValueError, match="only >= and < bounds"):
        pins.bounds("torch~=2.11.0")


def test_the_helper_reads_pyproject_as_toml_does():
    """scripts/extra_pins.py reads pyproject.toml with a pattern (it runs on Python 3.9 too): the same lists as
    tomllib, for every extra."""
    pins = _helper()
    with open(_PYPROJECT) as f:
        text = f.read()
    for extra, reqs in _extras().items():
        assert pins.extra_requirements(text, extra) == reqs, extra


def test_ci_installs_the_lower_bounds_read_from_pyproject():
    """scripts/test.sh's TORCH_REQS are scripts/extra_pins.py's output for the tested extra (no restated pins), and
    that output is the extras' lower bounds."""
    with open(_TEST_SH) as f:
        script = f.read()
    assert re.search(r'^pins=\$\("\$PY" scripts/extra_pins\.py ' + _TESTED + r'\)$', script, re.M), \
        "scripts/test.sh: TORCH_REQS must come from scripts/extra_pins.py " + _TESTED
    assert re.search(r"^TORCH_REQS=\(\$pins\)$", script, re.M)
    assert not re.search(r"(torch|transformers)==\d", script), "scripts/test.sh restates a pin"
    out = subprocess.run([sys.executable, _PINS, _TESTED], check=True, capture_output=True, text=True).stdout.split()
    pins = _helper()
    want = [f"{name}=={lower}" for name, lower, _ in map(pins.bounds, _extras()[_TESTED])]
    assert out == want and {p.split("==")[0] for p in out} == {"torch", "transformers"}, out


@pytest.mark.parametrize("name", ["torch", "transformers"])
def test_the_installed_version_is_in_the_stated_range(name):
    """Where the tests run with torch / transformers, they run a version the extras allow."""
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{name} not installed")
    pins = _helper()
    (lower, upper), = {pins.bounds(r)[1:] for e in _RANGED for r in _extras()[e] if pins.bounds(r)[0] == name}
    assert _release(lower) <= _release(version) < _release(upper), (name, version, lower, upper)

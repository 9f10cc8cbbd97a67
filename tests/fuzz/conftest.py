"""pytest options of the fuzzer (tests/fuzz/test_fuzz.py): how many cases, which seed, which devices, a time bound,
and where to write the summary (scripts/gpu.sh's fuzz phase turns it into bench/results/fuzz_h200.json)."""

import json
import os
import sys
import time

import importlib.util

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.join(os.path.dirname(_HERE), "python")
_PKG = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "python")
# The import rule of tests/python/conftest.py: SP_TEST_INSTALLED=1 tests the installed package, else the in-tree build.
if os.environ.get("SP_TEST_INSTALLED") == "1":
    _spec = importlib.util.find_spec("sparse_prefill")
    assert _spec is not None, "SP_TEST_INSTALLED=1 but sparse_prefill is not installed (pip install .)"
    assert not os.path.realpath(_spec.origin).startswith(os.path.realpath(_PKG) + os.sep), \
        "SP_TEST_INSTALLED=1 but sparse_prefill resolves to the source tree"
elif _PKG not in sys.path:
    sys.path.insert(0, _PKG)
if _TESTS not in sys.path:
    sys.path.append(_TESTS)  # sp_naive (the numpy reference)

from fuzz_summary import SUMMARY, density_summary  # noqa: E402  (shared with test_fuzz.py)


def pytest_addoption(parser):
    g = parser.getgroup("fuzz")
    g.addoption("--fuzz-cases", type=int, default=int(os.environ.get("SP_FUZZ_CASES", "300")),
                help="number of generated cases per device (default 300, env SP_FUZZ_CASES)")
    g.addoption("--fuzz-seed", type=int, default=int(os.environ.get("SP_FUZZ_SEED", "19")),
                help="seed of the case generator (case i uses (seed, device, i))")
    g.addoption("--fuzz-device", default=os.environ.get("SP_FUZZ_DEVICE", "auto"),
                choices=("auto", "cpu", "cuda", "both"),
                help="auto: CPU, plus CUDA when a GPU and a CUDA build are there")
    g.addoption("--fuzz-time", type=float, default=float(os.environ.get("SP_FUZZ_TIME", "110")),
                help="seconds; cases past the bound are skipped (counted as skipped_for_time)")
    g.addoption("--fuzz-report", default=os.environ.get("SP_FUZZ_REPORT", ""),
                help="write the JSON summary here")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and a CUDA build (skipped elsewhere)")
    config._fuzz_start = time.time()


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--fuzz-report")
    if path:
        SUMMARY["seed"] = session.config.getoption("--fuzz-seed")
        SUMMARY["seconds"] = round(time.time() - session.config._fuzz_start, 1)
        SUMMARY["exitstatus"] = int(exitstatus)
        SUMMARY["density"] = density_summary(SUMMARY.pop("densities", {}))
        SUMMARY["density_selective"] = density_summary(SUMMARY.pop("densities_selective", {}))
        with open(path, "w") as f:
            json.dump(SUMMARY, f, indent=1, sort_keys=True)

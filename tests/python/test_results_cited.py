"""bench/results holds the results the README, bench/README.md, the docs and the code that reads them cite (at most
60 files); experiments' records live in bench/lab/results. Every results path the documentation names exists."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")
if not os.path.isdir(RESULTS):
    pytest.skip("needs the source tree (bench/results)", allow_module_level=True)


def _files(top, suffixes):
    out = []
    for d, _, names in os.walk(os.path.join(ROOT, top)):
        if "__pycache__" in d or os.sep + "results" in d[len(ROOT):]:
            continue
        out += [os.path.join(d, n) for n in names if n.endswith(suffixes)]
    return out


def _docs():
    return [os.path.join(ROOT, "README.md")] + sum((_files(t, (".md",)) for t in ("docs", "bench", "tests", "python",
                                                                                   "examples")), [])


def test_every_cited_results_path_exists():
    missing = []
    for path in _docs():
        text = open(path, encoding="utf-8").read()
        for m in re.finditer(r"bench/(?:lab/)?results/[\w./*-]*[\w*]", text):
            if not glob.glob(os.path.join(ROOT, m.group(0))):
                missing.append(f"{os.path.relpath(path, ROOT)}: {m.group(0)}")
    assert not missing, "\n".join(missing)


def test_results_are_cited_and_few():
    names = sorted(n for n in os.listdir(RESULTS) if os.path.isfile(os.path.join(RESULTS, n)))
    assert len(names) <= 60, f"bench/results holds {len(names)} files; move what nothing cites to bench/lab/results"
    citing = [p for p in _docs() if "NOTES" not in os.path.basename(p)]
    citing += _files("python", (".py",)) + _files("scripts", (".sh", ".py")) + _files("tests", (".py",))
    citing += _files("src", (".h", ".cpp", ".cu", ".cuh")) + _files("bench", (".py",))
    text = "\n".join(open(p, encoding="utf-8").read() for p in citing)
    uncited = [n for n in names if n not in text]
    assert not uncited, f"cited nowhere but in lab notes (move them to bench/lab/results): {uncited}"

"""The lower bounds of an optional-dependency extra of pyproject.toml as exact pins, for the tests to install:

    python scripts/extra_pins.py hf     ->  torch==2.11.0 transformers==5.17.0

scripts/test.sh installs these, so CI tests the oldest versions the extras allow and its pins cannot drift from the
stated ranges. Every requirement of the extra must state a lower (>=) and an upper (<) bound; anything else exits 1
with a message naming the requirement. Plain Python 3.9 (scripts/test.sh runs it before its venv exists, with
whatever python3 the machine has: no tomllib before 3.11), so pyproject.toml is read with a pattern for the one-line
arrays of [project.optional-dependencies]; tests/python/test_packaging.py checks it against tomllib's reading."""

from __future__ import annotations

import os
import re
import sys
from typing import Optional

_PYPROJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pyproject.toml")


def extra_requirements(text: str, extra: str) -> list:
    """The requirement strings of `extra` in [project.optional-dependencies] of pyproject.toml's text."""
    table = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", text + "\n[", re.M | re.S)
    if table is None:
        raise ValueError("pyproject.toml: no [project.optional-dependencies] table")
    line = re.search(rf"^{re.escape(extra)}\s*=\s*\[(.*?)\]\s*$", table.group(1), re.M)
    if line is None:
        raise ValueError(f"{extra}: no such extra in [project.optional-dependencies] (on one line)")
    return re.findall(r'"([^"]+)"', line.group(1))


def bounds(requirement: str) -> tuple:
    """(name, lower, upper) of 'name>=lower,<upper' (either order); ValueError naming it without both."""
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)", requirement)
    name, spec = m.group(1), m.group(2)
    lower = upper = None
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        c = re.fullmatch(r"(>=|<)\s*([0-9][0-9A-Za-z.]*)", clause)
        if c is None:
            raise ValueError(f"{requirement}: only >= and < bounds are read here, got {clause!r}")
        if c.group(1) == ">=":
            lower = c.group(2)
        else:
            upper = c.group(2)
    if lower is None or upper is None:
        raise ValueError(f"{requirement}: state the tested range, a lower (>=) and an upper (<) bound")
    return name, lower, upper


def pins(extra: str, text: Optional[str] = None) -> list:
    """'name==lower' for every requirement of `extra`."""
    if text is None:
        with open(_PYPROJECT) as f:
            text = f.read()
    return [f"{name}=={lower}" for name, lower, _ in map(bounds, extra_requirements(text, extra))]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/extra_pins.py EXTRA")
    try:
        print(" ".join(pins(sys.argv[1])))
    except ValueError as e:
        sys.exit(f"scripts/extra_pins.py: {e}")

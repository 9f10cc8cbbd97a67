"""The docstrings of the public API: every public function documents each of its arguments in an Args section (the
selection arguments may point to the one place that documents them, build_index()'s "Selection arguments"), and the
defaults written there are the library's, sp.SELECTION_DEFAULTS, read at test time."""

import ast
import inspect
import re

import pytest

import sparse_prefill as sp

SELECTION_SECTION = "Selection arguments"
# the arguments documented in build_index()'s "Selection arguments" (SELECTION_DEFAULTS' keys and the chunked ones)
SELECTION_ARGS = set(sp.SELECTION_DEFAULTS) | {"final_chunk", "union", "max_kept_blocks"}


def _selection_section() -> str:
    doc = inspect.getdoc(sp.build_index)
    assert SELECTION_SECTION in doc
    return doc[doc.index(SELECTION_SECTION + "."):doc.index("Returns:")]


def _public_functions():
    """(name, function) of the public API: sp.*, sp.workload.*, the Index methods, the engine entry points and, where
    torch imports, sparse_prefill.torch_ops.*."""
    fns = [(f"sp.{n}", getattr(sp, n)) for n in sp.__all__ if inspect.isfunction(getattr(sp, n))]
    fns += [(f"sp.workload.{n}", getattr(sp.workload, n)) for n in sp.workload.__all__]
    fns += [(f"sp.Index.{n}", getattr(sp.Index, n)) for n in ("segment_id", "segment", "to_host")]
    fns += [("sp.LaunchOptions", sp.LaunchOptions)]
    try:
        import sparse_prefill.torch_ops as spt
        fns += [(f"sparse_prefill.torch_ops.{n}", getattr(spt, n)) for n in spt.__all__ if inspect.isfunction(getattr(spt, n))]
        from sparse_prefill.integrations import SparsePrefillConfig
        from sparse_prefill.integrations import transformers as sp_hf
        fns += [("SparsePrefillConfig.load", SparsePrefillConfig.load), ("integrations.transformers.register", sp_hf.register)]
    except ImportError:
        pass
    return fns


@pytest.mark.parametrize("name,fn", _public_functions(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_argument_is_documented(name, fn):
    doc = inspect.getdoc(fn) or ""
    params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
    if not params:
        return
    assert "Args:" in doc, f"{name}: no Args section"
    args = doc[doc.index("Args:"):]
    args = args[:args.index("Returns:")] if "Returns:" in args else args
    points_to_selection = SELECTION_SECTION in args
    for p in params:
        if p in SELECTION_ARGS and points_to_selection:
            continue
        assert re.search(rf"(?<![\w.]){re.escape(p)}\b", args), f"{name}: argument {p!r} is not in its Args section"


def test_documented_selection_defaults_are_the_librarys():
    """Each argument of build_index()'s "Selection arguments" reads `name (default VALUE)`; VALUE must be
    sp.SELECTION_DEFAULTS[name] for every key of that table (and the signature's default for the others)."""
    section = _selection_section()
    documented = {m.group(1): m.group(2) for m in re.finditer(r"^\s+(\w+) \(default ([^;)]+)[;)]", section, re.M)}
    assert set(sp.SELECTION_DEFAULTS) <= set(documented), set(sp.SELECTION_DEFAULTS) - set(documented)
    for key, value in sp.SELECTION_DEFAULTS.items():
        assert ast.literal_eval(documented[key]) == value, (key, documented[key], value)
    params = inspect.signature(sp.build_index).parameters
    for key in SELECTION_ARGS - set(sp.SELECTION_DEFAULTS):
        assert ast.literal_eval(documented[key]) == params[key].default, (key, documented[key])


def test_the_selection_is_documented_in_one_place():
    """The other functions point to build_index()'s section instead of restating what the arguments mean."""
    pointers = [sp.sparse_prefill, sp.chunked_prefill]
    for fn in pointers:
        doc = inspect.getdoc(fn)
        assert "build_index(), \"Selection arguments\"" in doc, fn.__name__
        assert "(default " not in doc, fn.__name__


def test_rules_documented_are_the_rules_accepted():
    section = _selection_section()
    documented = set(re.findall(r"^\s+'(\w+)'", section, re.M))
    assert documented == set(sp._api._RULES), documented

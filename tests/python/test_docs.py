"""The docstrings of the public API: every public function documents each of its arguments in an Args section (the
selection arguments may point to the one place that documents them, build_index()'s "Selection arguments"), and the
defaults written there are the library's, sp.SELECTION_DEFAULTS, read at test time."""

import ast
import inspect
import os
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
    library = sp.Selection()  # the signatures show <library default>; the values are Selection()'s
    for key in SELECTION_ARGS - set(sp.SELECTION_DEFAULTS):
        assert ast.literal_eval(documented[key]) == getattr(library, key), (key, documented[key])


# What a call given both selection= and a selection keyword does, said in the same words wherever it is described
# (issue 43: the README, sparse_prefill's docstring and Selection's said it three different ways, none of them right)
SELECTION_RULE = ("Pass the selection either as selection= or as the selection keywords (a keyword left out is the "
                  "library default, sp.SELECTION_DEFAULTS), never both: any selection keyword passed together with "
                  "selection= is a ValueError naming the keyword, whatever its value (the default's value too).")


def _plain(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def test_selection_rule_is_said_the_same_everywhere():
    texts = {"sp.sparse_prefill": inspect.getdoc(sp.sparse_prefill), "sp.Selection": inspect.getdoc(sp.Selection),
             "sp.build_index": inspect.getdoc(sp.build_index)}
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    if os.path.exists(readme):  # the source tree beside the tests
        with open(readme) as f:
            texts["README.md"] = f.read()
    for where, text in texts.items():
        assert SELECTION_RULE in _plain(text), where
        # no other wording of the rule left beside it
        for stale in ("must be left out", "contradicts", "other than its default", "at its default is no conflict"):
            assert stale not in _plain(text), (where, stale)


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

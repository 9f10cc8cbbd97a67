"""The block selection's parameters: Selection (frozen, validated once), SELECTION_DEFAULTS (from the C++
SelectionParams{}), and _selection(), which turns a call's `selection=` or its selection keywords into one Selection."""

from __future__ import annotations

import inspect
from typing import Any

from . import _C
from ._call import _as_bool, _as_float, _as_int, _as_int32

# Selection rules (SelectionRule in sparse.h): keyword value -> the int the extension takes.
_RULES = {"tile_energy": 0, "row_max": 1, "probe_row_max": 2, "probe_row_mass": 3, "key_max": 4, "exact_max": 5}
_RULE_NAMES = {v: k for k, v in _RULES.items()}


def _as_rule(value: Any) -> int:
    if not isinstance(value, str) or value not in _RULES:
        raise ValueError(f"rule: must be one of {', '.join(repr(r) for r in _RULES)}, got {value!r}")
    return _RULES[value]


def _rule_name(code: int) -> str:
    """The extension's rule int -> the keyword's name (ValueError naming `rule` for an int that is no rule)."""
    name = _RULE_NAMES.get(code)
    if name is None:
        known = ", ".join(f"{i} ({n!r})" for i, n in sorted(_RULE_NAMES.items()))
        raise ValueError(f"rule: must be one of {known}, got {code}")
    return name


def _as_head_subgroups(value: Any) -> int:
    s = _as_int32("head_subgroups", value)
    if s < 0:
        raise ValueError(f"head_subgroups: must be 0 (one selection per query head) or >= 1 dividing Hq // Hkv, "
                         f"got {s}")
    return s


def _as_max_kept_blocks(value: Any) -> int:
    """None -> -1 (the causal bound, SelectionParams::max_kept_blocks); else a budget in [0, 2^31 - 1]."""
    if value is None:
        return -1
    n = _as_int("max_kept_blocks", value)
    if not 0 <= n <= 2**31 - 1:
        raise ValueError(f"max_kept_blocks: must be None (the causal bound) or a budget in [0, 2^31 - 1] block ids "
                         f"(int32 offsets), got {n}")
    return n


class _Field:
    """One selection field as Python sees it: its keyword, the binding's attribute, its default (Python's spelling),
    `to_c(value)`, which checks the value's type and returns what SelectionParams holds (the spelling the torch
    operators take too), and `to_py(c)`, back to the keyword's spelling."""

    __slots__ = ("name", "c_name", "default", "to_c", "to_py")

    def __init__(self, c_name: str):
        c_default = getattr(_PARAMS, c_name)
        self.c_name = c_name
        self.name = _PY_NAMES.get(c_name, c_name)
        self.to_py = lambda c: c                              # the binding's value -> the keyword's
        if c_name in _SPECIAL:
            self.to_c, self.to_py = _SPECIAL[c_name]
        elif isinstance(c_default, bool):
            self.to_c = lambda v, n=self.name: _as_bool(n, v)
        elif isinstance(c_default, int):
            self.to_c = lambda v, n=self.name: _as_int32(n, v)
        else:
            self.to_c = lambda v, n=self.name: _as_float(n, v)
            c_default = round(c_default, 7)  # a C++ float's default as the decimal it was written as (0.003f)
        self.default = self.to_py(c_default)


# SelectionParams{} read field by field (the binding's SELECTION_FIELDS, from core/selection_fields.h: the one list of
# the fields and the one place their defaults are set). Python spells three of them its own way: `union` (C++
# union_lists, a keyword of C++), `rule` by name, `max_kept_blocks` None for the causal bound (-1).
_PARAMS = _C.SelectionParams()
_PY_NAMES = {"union_lists": "union"}
_SPECIAL = {"rule": (_as_rule, _rule_name),
            "head_subgroups": (_as_head_subgroups, lambda c: c),
            "max_kept_blocks": (_as_max_kept_blocks, lambda c: None if c == -1 else c)}
_TABLE = tuple(_Field(c) for c in _C.SELECTION_FIELDS)
del _PARAMS  # read once; an extension object kept in a module global outlives the extension at exit under pytest
_FIELD_OF = {f.name: f for f in _TABLE}
_FIELDS = tuple(f.name for f in _TABLE)
_FIELD_SET = frozenset(_FIELDS)
_DEFAULTS = {f.name: f.default for f in _TABLE}
# The fields a call sets for itself rather than a tuning (a chunk's final_chunk, union mode, the id budget): not in
# SELECTION_DEFAULTS, so that **SELECTION_DEFAULTS beside them (chunked_prefill's required final_chunk) never collides.
_PER_CALL = ("final_chunk", "union", "max_kept_blocks")
SELECTION_DEFAULTS = {n: d for n, d in _DEFAULTS.items() if n not in _PER_CALL}
"""The selection's tuning defaults, read from the C++ SelectionParams{} (the one place they are set): every field of
sp.Selection but the per-call final_chunk (True), union (False) and max_kept_blocks (None), whose defaults are
Selection()'s. Every function's selection keywords and Selection's default to these; what each argument means:
build_index(), "Selection arguments"."""
_D = SELECTION_DEFAULTS


class _LibraryDefault:
    """The default of the functions' selection keywords: "the library default" (the field's value in
    SELECTION_DEFAULTS, or Selection()'s). A sentinel rather than the value itself, so that a keyword passed with its
    default value is told apart from one left out: beside `selection=` any passed keyword is an error."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<library default>"

    def __reduce__(self) -> str:
        return "_LIBRARY_DEFAULT"  # one object, also through copy and pickle (identity is what is tested)


_LIBRARY_DEFAULT = _LibraryDefault()


class Selection:
    """The block selection of build_index(), sparse_prefill() and chunked_prefill(): one immutable, validated value.

        sel = sp.Selection(alpha=0.01, rule="probe_row_mass")
        out = sp.sparse_prefill(q, k, v, cu_q, cu_k, max_q, max_k, selection=sel)
        sel2 = sel.replace(block_size=256)

    Every field is a keyword, defaulting to sp.SELECTION_DEFAULTS (the C++ SelectionParams{}, whose list of fields
    is the one declaration: the signature shows them); what each one means: build_index(), "Selection arguments".
    Types and every range that
    needs no shapes are checked here, once (TypeError / ValueError naming the field); the call checks what needs them
    (head_subgroups dividing Hq // Hkv; key_rank <= the head dim). The functions' selection keywords are a shorthand
    that builds one. Pass the selection either as `selection=` or as the selection keywords (a keyword left out is
    the library default, sp.SELECTION_DEFAULTS), never both: any selection keyword passed together with `selection=`
    is a ValueError naming the keyword, whatever its value (the default's value too). chunked_prefill()'s required
    `final_chunk=` is the step's, not a selection keyword: it overrides the Selection's.
    """

    __slots__ = _FIELDS + ("_params", "_flipped", "_op")

    def __init__(self, **fields: Any):
        unknown = fields.keys() - _FIELD_SET
        if unknown:
            name = sorted(unknown)[0]
            raise TypeError(f"{name}: not a field of Selection (fields: {', '.join(_FIELDS)})")
        c_values = {}
        for f in _TABLE:
            value = fields.get(f.name, f.default)
            c_values[f.c_name] = f.to_c(value)     # TypeError / ValueError naming the field
            object.__setattr__(self, f.name, f.to_py(c_values[f.c_name]))
        params = _C.SelectionParams(**c_values)
        params.check()  # the library's shape-free checks (ValueError naming the field)
        object.__setattr__(self, "_params", params)
        object.__setattr__(self, "_flipped", None)  # the copy with the other final_chunk, made on first use
        object.__setattr__(self, "_op", None)       # the torch operators' arguments (_op_fields), made on first use

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{name}: a Selection is immutable; use selection.replace({name}=...)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{name}: a Selection is immutable")

    def replace(self, **changes: Any) -> "Selection":
        """A copy with `changes` (field=value), validated as a new Selection."""
        unknown = set(changes) - set(_FIELDS)
        if unknown:
            name = sorted(unknown)[0]
            raise TypeError(f"{name}: not a field of Selection (fields: {', '.join(_FIELDS)})")
        return Selection(**{**self.as_dict(), **changes})

    def as_dict(self) -> dict:
        """The fields as a dict (keyword -> value)."""
        return {name: getattr(self, name) for name in _FIELDS}

    def _with_final_chunk(self, final_chunk: bool) -> "Selection":
        if final_chunk == self.final_chunk:
            return self
        if self._flipped is None:
            object.__setattr__(self, "_flipped", self.replace(final_chunk=final_chunk))
        return self._flipped

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Selection):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in _FIELDS)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n in _FIELDS))

    def __repr__(self) -> str:
        return "Selection(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in _FIELDS) + ")"

    def __reduce__(self):
        return (_rebuild, (self.as_dict(),))


def _rebuild(fields: dict) -> Selection:
    return Selection(**fields)


_DEFAULT_SELECTION = Selection()
# The one cache of Selections made from field values, so that each distinct selection is converted and validated once:
# keyed by a tuple for a call's selection keywords (_selection) and by a frozenset for the torch operators' arguments
# (_selection_of_op_fields); a tuple never equals a frozenset, so the two spellings share the dict without a tag.
_SELECTIONS: dict = {}


def _remember(key: Any, sel: Selection) -> None:
    if len(_SELECTIONS) >= 1024:  # bounded: a caller sweeping values never grows it without end
        _SELECTIONS.clear()
    _SELECTIONS[key] = sel


def _selection(selection: Any, keywords: dict) -> Selection:
    """The call's Selection: `selection` when given (`keywords`, the selection keywords the call passed, must then be
    empty), else the one the keywords build, those left out at their defaults (the defaults' own Selection when none
    is passed). A keyword that is not a field is a TypeError naming it."""
    if selection is None:
        if not keywords:  # every keyword left out
            return _DEFAULT_SELECTION
        # The keywords' Selection, made once per distinct value: the key holds the types too, so that 1, 1.0 and
        # True (equal, one hash) do not share a Selection that validated only one of them
        try:
            key = tuple((n, v, type(v)) for n, v in keywords.items())
            sel = _SELECTIONS.get(key)
        except TypeError:  # an unhashable value: Selection() names it
            key = sel = None
        if sel is None:
            _check_keywords(keywords)
            sel = Selection(**keywords)
            if key is not None:
                _remember(key, sel)
        return sel
    if not isinstance(selection, Selection):
        raise TypeError(f"selection: expected a sparse_prefill.Selection, got {type(selection).__name__}")
    _check_keywords(keywords)
    for name, value in keywords.items():
        # any passed keyword, even one equal to the default or to the Selection's field: which one was meant is a guess
        raise ValueError(f"{name}: given both as a keyword ({value!r}) and through selection= "
                         f"({getattr(selection, name)!r}); pass one or the other, whatever the keyword's value "
                         f"(to change the Selection: selection.replace({name}=...))")
    return selection


def _selection_of_op_fields(fields: dict) -> tuple:
    """The Selection of a torch operator call's selection arguments (`fields`: those the dispatcher passed, i.e. the
    ones that differ from the schema's defaults, in the binding's spelling: rule as its int, max_kept_blocks -1 for
    None), from the cache above (the schema fixes each argument's type, so equal keys are equal selections); with its
    key, which the operators' workspace-size cache reuses."""
    key = frozenset(fields.items())
    sel = _SELECTIONS.get(key)
    if sel is None:
        sel = Selection(**{n: _FIELD_OF[n].to_py(v) for n, v in fields.items()})
        _remember(key, sel)
    return sel, key


def _op_fields(sel: Selection) -> dict:
    """A Selection as the torch operators' selection arguments: the fields that differ from the defaults, in the
    binding's spelling (rule as its int, max_kept_blocks -1 for None). Made once per Selection and kept on it (callers
    pass it as **fields and never change it)."""
    fields = sel._op
    if fields is None:
        fields = {f.name: f.to_c(getattr(sel, f.name)) for f in _TABLE if getattr(sel, f.name) != f.default}
        object.__setattr__(sel, "_op", fields)
    return fields


def _check_keywords(keywords: dict) -> None:
    unknown = keywords.keys() - _FIELD_SET
    if unknown:
        name = sorted(unknown)[0]
        raise TypeError(f"{name}: unexpected keyword argument (neither a parameter of the function nor a selection "
                        f"argument: {', '.join(_FIELDS)})")


def selection_keywords(fn):
    """Decorates a function that takes the selection as `selection=None, **selection_keywords`: its signature (help(),
    inspect) then lists every selection field it does not name itself as a keyword-only parameter whose default is
    <library default>, so that the functions show the keywords without restating them."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    named = {p.name for p in params}
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_LIBRARY_DEFAULT)
               for f in _TABLE if f.name not in named]
    fn.__signature__ = sig.replace(parameters=params)
    return fn


Selection.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]
    + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default) for f in _TABLE])

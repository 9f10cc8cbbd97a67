"""The block selection's parameters: Selection (frozen, validated once), SELECTION_DEFAULTS (from the C++
SelectionParams{}), and _selection(), which turns a call's `selection=` or its selection keywords into one Selection."""

from __future__ import annotations

from typing import Any, Optional

from . import _C
from ._call import _as_bool, _as_float, _as_int, _as_int32

# Selection rules (SelectionRule in sparse.h): keyword value -> the int the extension takes.
_RULES = {"tile_energy": 0, "row_max": 1, "probe_row_max": 2, "probe_row_mass": 3, "key_max": 4}
_RULE_NAMES = {v: k for k, v in _RULES.items()}
# SelectionParams{} read field by field: its fields are the binding's, so no second list of defaults exists in C++
_PARAMS = _C.SelectionParams()
_C_DEFAULTS = {name: getattr(_PARAMS, name) for name in (
    "alpha", "mean_alpha", "key_rank", "rule", "block_size", "sink", "window", "last_n", "correction",
    "head_subgroups", "dense_fraction")}
SELECTION_DEFAULTS = dict(_C_DEFAULTS, alpha=round(_C_DEFAULTS["alpha"], 7),  # the float32 0.1f as 0.1
                          mean_alpha=round(_C_DEFAULTS["mean_alpha"], 7),
                          dense_fraction=round(_C_DEFAULTS["dense_fraction"], 7),
                          rule=_RULE_NAMES[_C_DEFAULTS["rule"]])
"""The selection's defaults, read from the C++ SelectionParams{} (the one place they are set): alpha, mean_alpha,
key_rank, rule, block_size, sink, window, last_n, correction, head_subgroups, dense_fraction. Every function's keyword
defaults and Selection's are these; what each argument means: build_index(), "Selection arguments"."""
_D = SELECTION_DEFAULTS


def _as_rule(value: Any) -> int:
    if not isinstance(value, str) or value not in _RULES:
        raise ValueError(f"rule: must be one of {', '.join(repr(r) for r in _RULES)}, got {value!r}")
    return _RULES[value]


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


# The fields in the order of the selection keywords, with their defaults (union, final_chunk and max_kept_blocks are
# not in SELECTION_DEFAULTS; theirs are SelectionParams{}'s too, max_kept_blocks -1 as None).
_FIELDS = ("alpha", "rule", "mean_alpha", "key_rank", "block_size", "sink", "window", "last_n", "correction",
           "head_subgroups", "dense_fraction", "final_chunk", "union", "max_kept_blocks")
_DEFAULTS = dict(_D, final_chunk=_PARAMS.final_chunk, union=_PARAMS.union_lists,
                 max_kept_blocks=None if _PARAMS.max_kept_blocks == -1 else _PARAMS.max_kept_blocks)


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

    Every field is a keyword, defaulting to sp.SELECTION_DEFAULTS (the C++ SelectionParams{}); what each one means:
    build_index(), "Selection arguments": alpha, rule, mean_alpha, key_rank, block_size, sink, window, last_n,
    correction, head_subgroups, dense_fraction, final_chunk, union, max_kept_blocks. Types and every range that
    needs no shapes are checked here, once (TypeError / ValueError naming the field); the call checks what needs them
    (head_subgroups dividing Hq // Hkv; key_rank <= the head dim). The functions' selection keywords are a shorthand
    that builds one. Pass the selection either as `selection=` or as the selection keywords (a keyword left out is
    the library default, sp.SELECTION_DEFAULTS), never both: any selection keyword passed together with `selection=`
    is a ValueError naming the keyword, whatever its value (the default's value too). chunked_prefill()'s required
    `final_chunk=` is the step's, not a selection keyword: it overrides the Selection's.
    """

    __slots__ = _FIELDS + ("_params", "_flipped")

    def __init__(self, *, alpha: float = _D["alpha"], rule: str = _D["rule"], mean_alpha: float = _D["mean_alpha"],
                 key_rank: int = _D["key_rank"], block_size: int = _D["block_size"], sink: int = _D["sink"],
                 window: int = _D["window"], last_n: int = _D["last_n"], correction: bool = _D["correction"],
                 head_subgroups: int = _D["head_subgroups"], dense_fraction: float = _D["dense_fraction"],
                 final_chunk: bool = True, union: bool = False, max_kept_blocks: Optional[int] = None):
        s = object.__setattr__
        s(self, "alpha", _as_float("alpha", alpha))
        rule_code = _as_rule(rule)
        s(self, "rule", rule)
        s(self, "mean_alpha", _as_float("mean_alpha", mean_alpha))
        s(self, "key_rank", _as_int32("key_rank", key_rank))
        s(self, "block_size", _as_int32("block_size", block_size))
        s(self, "sink", _as_int32("sink", sink))
        s(self, "window", _as_int32("window", window))
        s(self, "last_n", _as_int32("last_n", last_n))
        s(self, "correction", _as_bool("correction", correction))
        s(self, "head_subgroups", _as_head_subgroups(head_subgroups))
        s(self, "dense_fraction", _as_float("dense_fraction", dense_fraction))
        s(self, "final_chunk", _as_bool("final_chunk", final_chunk))
        s(self, "union", _as_bool("union", union))
        budget = _as_max_kept_blocks(max_kept_blocks)
        s(self, "max_kept_blocks", None if budget < 0 else budget)
        params = _C.SelectionParams(alpha=self.alpha, mean_alpha=self.mean_alpha, key_rank=self.key_rank,
                                    rule=rule_code, block_size=self.block_size, sink=self.sink, window=self.window,
                                    last_n=self.last_n, correction=self.correction, final_chunk=self.final_chunk,
                                    union_lists=self.union, head_subgroups=self.head_subgroups,
                                    dense_fraction=self.dense_fraction, max_kept_blocks=budget)
        params.check()  # the library's shape-free checks (ValueError naming the field)
        s(self, "_params", params)
        s(self, "_flipped", None)  # the copy with the other final_chunk, made on first use (chunked_prefill)

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
_KEYWORD_SELECTIONS: dict = {}


def _selection(selection: Any, alpha=_LIBRARY_DEFAULT, block_size=_LIBRARY_DEFAULT, sink=_LIBRARY_DEFAULT,
               window=_LIBRARY_DEFAULT, last_n=_LIBRARY_DEFAULT, correction=_LIBRARY_DEFAULT,
               final_chunk=_LIBRARY_DEFAULT, union=_LIBRARY_DEFAULT, head_subgroups=_LIBRARY_DEFAULT,
               rule=_LIBRARY_DEFAULT, max_kept_blocks=_LIBRARY_DEFAULT, mean_alpha=_LIBRARY_DEFAULT,
               dense_fraction=_LIBRARY_DEFAULT, key_rank=_LIBRARY_DEFAULT) -> Selection:
    """The call's Selection: `selection` when given (every selection keyword must then be left out: _LIBRARY_DEFAULT),
    else one built from the keywords, those left out at their defaults (the defaults' own Selection when all are)."""
    kw = (alpha, block_size, sink, window, last_n, correction, final_chunk, union, head_subgroups, rule,
          max_kept_blocks, mean_alpha, dense_fraction, key_rank)
    if selection is None:
        if all(a is _LIBRARY_DEFAULT for a in kw):  # every keyword left out
            return _DEFAULT_SELECTION
        # The keywords' Selection, made once per distinct value: the key holds the types too, so that 1, 1.0 and
        # True (equal, one hash) do not share a Selection that validated only one of them (keywords left out are
        # the sentinel in the key: resolved only when the Selection is made)
        try:
            key = kw + tuple(map(type, kw))
            sel = _KEYWORD_SELECTIONS.get(key)
        except TypeError:  # an unhashable value: Selection() names it
            key = sel = None
        if sel is None:
            sel = Selection(**{name: d if a is _LIBRARY_DEFAULT else a
                               for name, a, d in zip(_KEYWORD_NAMES, kw, _KEYWORD_DEFAULTS)})
            if key is not None:
                if len(_KEYWORD_SELECTIONS) >= 256:
                    _KEYWORD_SELECTIONS.clear()
                _KEYWORD_SELECTIONS[key] = sel
        return sel
    if not isinstance(selection, Selection):
        raise TypeError(f"selection: expected a sparse_prefill.Selection, got {type(selection).__name__}")
    for name, value in zip(_KEYWORD_NAMES, kw):
        # any passed keyword, even one equal to the default or to the Selection's field: which one was meant is a guess
        if value is not _LIBRARY_DEFAULT:
            raise ValueError(f"{name}: given both as a keyword ({value!r}) and through selection= "
                             f"({getattr(selection, name)!r}); pass one or the other, whatever the keyword's value "
                             f"(to change the Selection: selection.replace({name}=...))")
    return selection


_KEYWORD_NAMES = ("alpha", "block_size", "sink", "window", "last_n", "correction", "final_chunk", "union",
                  "head_subgroups", "rule", "max_kept_blocks", "mean_alpha", "dense_fraction", "key_rank")
_KEYWORD_DEFAULTS = tuple(_DEFAULTS[n] for n in _KEYWORD_NAMES)

"""Configuration names of the accuracy harness (SmolLM2 run.py and the retrieval model retrieval.py) -> a Route:
what computes the attention of a sparse layer.

  dense              the reference (the library's sp.attention on the sp backend, torch sdpa elsewhere)
  dense_torch        the oracle's code path keeping every block (torch float32, chunked): the numeric floor of
                     the oracle rows against `dense`
  default            the library's shipped default: sp.build_index with no selection keyword at all (whatever
                     sp.SELECTION_DEFAULTS is at the measured commit); the emulator's RULE_DEFAULTS on --backend emulate
  oracle_<F>         the exact oracle (emulate.oracle_attention): per query head (head sub-groups = g), per row the
                     fewest blocks holding fraction F of its softmax mass, union over each 128-row tile, sink / window
                     / last tiles kept, renormalised. oracle_tile_<F>: the same per PackGQA tile (sub-groups 1)
  <name>             a registered candidate (CONFIGS: its emulator rule and library arguments)
  sp:k=v;k=v         library keyword arguments, e.g. 'sp:rule=row_max;alpha=0.03;head_subgroups=g'
  emu:k=v;k=v | k=v  emulator rule parameters (emulate.py), e.g. 'emu:score=probe;probe=8;agg=rowmass;alpha=0.05'
The value 'g' of head_subgroups (library) or subgroups (emulator) means the subject's query heads per KV head (one
selection per query head): SmolLM2 3, the retrieval model 4, the topic workload of the index timing 4 - so one
configuration string means the same selection on every subject.
"""
import re

# Registered candidates: (emulator rule, library kwargs); None where one side does not exist. Only names whose
# selection is spelt out: the library's default is the config 'default' (no keyword), never a copy of its values.
CONFIGS = {
    # FlashPrefill V2's rule (the library's default before issue 13), with and without the mean correction
    "fpv2": (dict(agg="sum", correction=True), dict(rule="tile_energy", correction=True)),
    "fpv2_nocorr": (dict(agg="sum", correction=False), dict(rule="tile_energy", correction=False)),
    "s3_a001": (dict(agg="sum", correction=True, subgroups=3, alpha=0.01),
                dict(rule="tile_energy", correction=True, alpha=0.01, head_subgroups=3)),
    "s3_a003": (dict(agg="sum", correction=True, subgroups=3, alpha=0.03),
                dict(rule="tile_energy", correction=True, alpha=0.03, head_subgroups=3)),
    "rowmax_a03": (dict(agg="rowmax", alpha=0.3), dict(rule="row_max", alpha=0.3)),
    # issue 37's most accurate library setting measured so far: row max alpha 0.03, one selection per query head
    "rowmax_a003_head": (dict(agg="rowmax", alpha=0.03, subgroups="g"),
                         dict(rule="row_max", alpha=0.03, head_subgroups="g")),
    # the README's opt-in accurate rule (probe rows against their whole mass), per query head
    "probe_mass_head": (dict(score="probe", probe=8, agg="rowmass", alpha=0.05, union_mean=0.8, subgroups="g"),
                        dict(rule="probe_row_mass", alpha=0.05, mean_alpha=0.8, head_subgroups="g")),
    # exact scores of probe rows (every 8th position, all heads of the tile), row-max rule: emulation only (issue 13)
    "probe8": (dict(score="probe", probe=8, agg="rowmax"), None),
    # the library's rule='probe_row_max' (probe 8 + the pooled-means row max at 0.5)
    "probe": (dict(score="probe", probe=8, union_mean=0.5, agg="rowmax"), dict(rule="probe_row_max")),
    "probe_a02": (dict(score="probe", probe=8, union_mean=0.5, alpha=0.2, agg="rowmax"),
                  dict(rule="probe_row_max", alpha=0.2)),
    "probe4_a02": (dict(score="probe", probe=4, alpha=0.2, agg="rowmax"), None),
    "probe8_um05": (dict(score="probe", probe=8, union_mean=0.5, agg="rowmax"), None),
    # issue 44's per-key block maxima on a rank-16 residual, one pass from the diagonal started from the pooled-means
    # bound and the sink keys' exact maximum: the emulator's score 'resid' with the library's basis is the library's
    # rule='key_max' (test_accuracy_emulator)
    "keymax_a01": (dict(score="resid", rank=16, onepass=2, sinkref=1, alpha=0.1, subgroups="g"),
                   dict(rule="key_max", key_rank=16, alpha=0.1, head_subgroups="g")),
}

ORACLE = re.compile(r"^oracle_(tile_)?([0-9]*\.?[0-9]+)$")


class Route:
    """kind: 'dense' | 'sp' (args: library kwargs) | 'emulate' (args: emulator rule) | 'oracle' (args: frac,
    subgroups: None = one per query head)."""

    def __init__(self, name, kind, args=None):
        self.name, self.kind, self.args = name, kind, dict(args or {})

    @property
    def library_args(self):
        """The library kwargs of this configuration (its index can be timed), or None."""
        return self.args if self.kind == "sp" else None

    def __repr__(self):
        return f"Route({self.name!r}, {self.kind!r}, {self.args!r})"


def parse_kv(s):
    """'k=v;k=v' -> dict, values as bool, int, float or str."""
    out = {}
    for item in s.split(";"):
        if not item:
            continue
        key, val = item.split("=", 1)
        if val in ("True", "False"):
            val = val == "True"
        else:
            for cast in (int, float):
                try:
                    val = cast(val)
                    break
                except ValueError:
                    pass
        out[key] = val
    return out


def parse(name, backend="sp"):
    """A configuration name -> Route, or None when it has nothing to run on this backend (a library-only name on
    the emulator). Raises ValueError on an unknown name."""
    if name == "dense":
        return Route(name, "dense")
    if name == "dense_torch":
        return Route(name, "oracle", dict(frac=None, subgroups=1))
    if name == "default":
        return Route(name, "sp" if backend == "sp" else "emulate", {})
    m = ORACLE.match(name)
    if m:
        frac = float(m.group(2))
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"{name}: the mass fraction must be in (0, 1]")
        return Route(name, "oracle", dict(frac=frac, subgroups=1 if m.group(1) else None))
    if name.startswith("sp:"):
        return Route(name, "sp", parse_kv(name[3:]))
    if name.startswith("emu:"):
        rest = name[4:]
        if rest == "default":
            return Route(name, "emulate", {})
        if rest in CONFIGS:
            if CONFIGS[rest][0] is None:
                raise ValueError(f"{name}: {rest} has no emulator rule")
            return Route(name, "emulate", CONFIGS[rest][0])
        return Route(name, "emulate", parse_kv(rest))
    if name in CONFIGS:
        emu, lib = CONFIGS[name]
        if backend == "sp" and lib is not None:
            return Route(name, "sp", lib)
        if emu is not None:
            return Route(name, "emulate", emu)
        return None
    if "=" in name:
        return Route(name, "emulate", parse_kv(name))
    raise ValueError(f"unknown configuration {name!r} (registered: {', '.join(CONFIGS)}; or oracle_F, "
                     "oracle_tile_F, sp:k=v;..., emu:k=v;...)")


def resolve_g(args, g):
    """Replace the value 'g' of head_subgroups / subgroups by the subject's group size g."""
    out = dict(args)
    for key in ("head_subgroups", "subgroups"):
        if out.get(key) == "g":
            out[key] = g
    return out

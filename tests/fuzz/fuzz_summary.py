"""The fuzzer's running summary (written by tests/fuzz/conftest.py at the end of the session)."""

SUMMARY = {"cases": 0, "cpu_calls": 0, "cuda_calls": 0, "valid": 0, "invalid_host": 0, "invalid_device": 0,
           "flagged_by_check_errors": 0, "raised_in_checked_mode": 0, "unsupported": 0, "crashes": 0,
           "failures": 0, "skipped_for_time": 0, "kinds": {}, "mutations": {}, "layouts": {}, "failed_cases": []}


DENSITY_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def density_summary(densities):
    """Per kind: how many valid cases, min / median / max density, how many below 0.6, and a histogram over
    DENSITY_BINS (the last bin is [0.8, 1.0], density 1 included)."""
    out = {}
    for kind, d in sorted(densities.items()):
        d = sorted(d)
        counts = [sum(1 for x in d if lo <= x < hi or (hi == 1.0 and x == 1.0))
                  for lo, hi in zip(DENSITY_BINS, DENSITY_BINS[1:])]
        out[kind] = {"cases": len(d), "min": d[0], "median": d[len(d) // 2], "max": d[-1],
                     "below_0.6": sum(1 for x in d if x < 0.6),
                     "histogram": {f"{lo:.1f}-{hi:.1f}": n
                                   for lo, hi, n in zip(DENSITY_BINS, DENSITY_BINS[1:], counts)}}
    return out

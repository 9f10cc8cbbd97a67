"""bench/accuracy/report.py on synthetic results: the merge of several runs, the per-configuration summary with issue
37's pass / fail (top-1 within 1 point, NLL within 0.5 %, density <= 1.2 x oracle_0.5), the markdown table and the
frontier plot (when matplotlib is installed). No torch needed."""
import importlib.util
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from accuracy import report  # noqa: E402

TASKS = [("copy", None, None), ("ppl", None, None)] + [("kv", lay, fmt) for lay in ("together", "spread", "depth")
                                                      for fmt in ("code", "record")]


def doc(model, tasks, lengths, configs, dense_ms=250.0):
    """configs: {name: (density, top-1 diff in points or NLL diff in %, {(task, layout): override}, index_ms)}."""
    rows = []
    for L in lengths:
        for t, lay, fmt in tasks:
            nll = t == "ppl"
            dm = 1.75 if nll else 0.9
            base = dict(model=model, task=t, layout=lay, format=fmt, L=L, metric_name="nll" if nll else "top1",
                        dense_metric=dm)
            rows.append(dict(base, config="dense", density=1.0, metric=dm, diff=0.0, ci_low=0.0, ci_high=0.0,
                             index_ms_128k=None))
            for c, (dens, d, over, ims) in configs.items():
                d = over.get((t, lay, L), d)
                diff = d * dm / 100 if nll else d / 100
                rows.append(dict(base, config=c, density=dens, metric=dm + diff, diff=diff,
                                 ci_low=diff - 0.004, ci_high=diff + 0.004, index_ms_128k=ims))
    return dict(commit="c0ffee", date="2026-12-04T10:00:00", device="NVIDIA H200", command="x",
                through_package=True, dense_ms_128k=dense_ms, rows=rows)


def test_summary_pass_fail_and_markdown(tmp_path):
    configs = {
        "oracle_0.5": (0.40, 0.0, {}, None),
        "oracle_0.9": (0.60, 0.1, {}, None),
        "default": (0.46, 0.0, {}, 2.0),                                     # meets everything (ratio 1.15)
        "dense_heavy": (0.60, 0.0, {}, 3.0),                                 # accurate, ratio 1.5: fails density
        "lossy_kv": (0.42, 0.0, {("kv", "depth", 8192): -1.6}, 1.0),         # one kv layout 1.6 points down
        "nll_drift": (0.42, 0.0, {("ppl", None, 8192): 0.8}, 1.0),           # NLL +0.8 %
        "ci_edge": (0.42, -0.8, {}, 1.0),                                    # -0.8 point, interval down to -1.2
    }
    d = doc("SmolLM2", TASKS, [4096, 8192], configs)
    s = {e["config"]: e for e in report.summarize(d)}
    assert "dense" not in s
    assert s["default"]["pass"] and s["default"]["ci_pass"]
    assert s["default"]["density_ratio"] == pytest.approx(0.46 / 0.40)
    assert s["default"]["index_share_of_dense_128k"] == pytest.approx(2.0 / 250.0) and s["default"]["index_ok"]
    assert not s["dense_heavy"]["pass"] and not s["dense_heavy"]["density_ok"] and s["dense_heavy"]["top1_ok"]
    assert not s["lossy_kv"]["pass"] and s["lossy_kv"]["top1_worst_pt"] == pytest.approx(-1.6)
    assert s["lossy_kv"]["top1_worst_at"] == "kv depth/code L=8192"
    assert not s["nll_drift"]["nll_ok"] and s["nll_drift"]["nll_worst_pct"] == pytest.approx(0.8)
    assert s["ci_edge"]["pass"] and not s["ci_edge"]["ci_pass"]  # point estimate inside, interval not
    assert s["ci_edge"]["top1_worst_ci_pt"][0] == pytest.approx(-1.2)
    assert "index_ms_128k" not in s["oracle_0.5"] and s["oracle_0.5"]["density_ratio"] == pytest.approx(1.0)
    md = report.markdown(report.summarize(d), d)
    table, dense = md.split("Dense (")
    lines = [ln for ln in table.splitlines() if ln.startswith("| SmolLM2 |")]
    assert sum(ln.startswith("| SmolLM2 |") for ln in dense.splitlines()) == 2 * len(TASKS)  # dense per task and L
    assert len(lines) == len(configs)
    assert any(ln.startswith("| SmolLM2 | default |") and ln.rstrip().endswith("| pass | pass |") for ln in lines)
    assert any(ln.startswith("| SmolLM2 | lossy_kv |") and "| fail |" in ln for ln in lines)


def test_merge_and_cli(tmp_path):
    cfg = {"oracle_0.5": (0.3, 0.0, {}, None), "default": (0.5, -0.2, {}, 2.5)}
    a = doc("SmolLM2", TASKS[:3], [4096], cfg)
    b = doc("retrieval-seed1", [("kv_recall", "mqar", "tokens")], [16384, 32768], cfg)
    b["date"] = "2026-12-05T10:00:00"
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    png, md, merged = tmp_path / "f.png", tmp_path / "f.md", tmp_path / "m.json"
    out, summary = report.main([str(pa), str(pb), "--merged", str(merged), "--png", str(png), "--summary", str(md)])
    m = json.loads(merged.read_text())
    assert len(m["rows"]) == len(a["rows"]) + len(b["rows"]) and len(m["runs"]) == 2
    assert m["commit"] == "c0ffee" and m["dense_ms_128k"] == 250.0 and m["date"] == "2026-12-05T10:00:00"
    assert {e["model"] for e in summary} == {"SmolLM2", "retrieval-seed1"}
    js = json.loads((tmp_path / "f.json").read_text())
    assert js["targets"]["density_ratio"] == 1.2 and len(js["configs"]) == 4
    assert "retrieval-seed1 | default" in md.read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 10_000
    # disagreeing inputs: the shared keys become lists
    b["commit"], b["dense_ms_128k"] = "other", 260.0
    pb.write_text(json.dumps(b))
    m = report.merge(report.load([str(pa), str(pb)]))
    assert m["commit"] == ["c0ffee", "other"] and m["dense_ms_128k"] == 250.0
    assert [r["dense_ms_128k"] for r in m["runs"]] == [250.0, 260.0]

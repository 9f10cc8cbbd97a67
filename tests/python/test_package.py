"""The package itself: what importing an unbuilt tree says, version metadata, and the dtype rule for numpy's defaults
(int64 index arrays converted on the host, refused on CUDA; float64 data refused), see sparse_prefill/_arrays.py."""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import sparse_prefill as sp
from conftest import make_varlen, to_paged

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG_DIR = os.path.dirname(os.path.abspath(sp.__file__))


# ---------------------------------------------------------------------------------------------------------------------
# Import of a tree without the extension
# ---------------------------------------------------------------------------------------------------------------------

def _import_copy(tmp_path, extra_files=()):
    """Copies the package's .py files (no _C) into tmp_path/sparse_prefill and imports it in a fresh interpreter
    (-S: no site-packages, so neither an installed nor an editable sparse_prefill can answer instead)."""
    dst = tmp_path / "sparse_prefill"
    dst.mkdir()
    for name in os.listdir(_PKG_DIR):
        if name.endswith(".py"):
            shutil.copy(os.path.join(_PKG_DIR, name), dst / name)
    for name in extra_files:
        (dst / name).write_bytes(b"not an extension")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import sparse_prefill"
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=60)


def test_unbuilt_tree_says_how_to_build(tmp_path):
    r = _import_copy(tmp_path)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: sparse_prefill: the compiled extension sparse_prefill._C is missing"), last
    for hint in ("pip install .", "pip install -e .", "bash scripts/build.sh"):
        assert hint in last, (hint, last)
    assert "circular" not in r.stderr


def test_unbuilt_tree_names_an_extension_of_another_python(tmp_path):
    r = _import_copy(tmp_path, extra_files=["_C.cpython-20-fake.so"])
    assert r.returncode != 0
    assert "_C.cpython-20-fake.so: built for another Python version" in r.stderr, r.stderr


def test_extension_loaded():
    assert sp._C.__name__ == "sparse_prefill._C"
    assert isinstance(sp.with_cuda, bool)


def test_installed_package_under_test():
    """scripts/test.sh sets SP_TEST_INSTALLED=1: the suite must run against the pip-installed package."""
    if os.environ.get("SP_TEST_INSTALLED") != "1":
        pytest.skip("not run by scripts/test.sh (SP_TEST_INSTALLED unset)")
    assert not os.path.realpath(sp.__file__).startswith(os.path.realpath(os.path.join(_REPO, "python")) + os.sep)
    from importlib.metadata import version
    assert version("sparse-prefill") == sp.__version__


def test_versions_agree():
    """pyproject.toml, CMakeLists.txt (the C++ package config) and sparse_prefill.__version__ say the same."""
    pyproject = os.path.join(_REPO, "pyproject.toml")
    if not os.path.exists(pyproject):
        pytest.skip("no source tree beside the tests")
    with open(pyproject) as f:
        py_version = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    with open(os.path.join(_REPO, "CMakeLists.txt")) as f:
        cmake_version = re.search(r"project\(sparse_prefill VERSION ([0-9.]+)", f.read()).group(1)
    assert py_version == cmake_version == sp.__version__


def _readme_section_code(text: str, heading: str) -> str:
    """The ```python blocks of the README section under `heading` (up to the next heading of any level)."""
    lines, fence = [], False
    for line in text[text.index(heading + "\n") + len(heading):].splitlines(keepends=True):
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            break
        lines.append(line)
    blocks = re.findall(r"```python\n(.*?)```", "".join(lines), re.S)
    assert blocks, f"no python block under {heading}"
    return "".join(blocks)


def _run_readme_code(code: str, tmp_path) -> str:
    env = dict(os.environ)   # the sparse_prefill under test, wherever it was imported from
    paths = [os.path.dirname(_PKG_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    r = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _readme() -> str:
    readme = os.path.join(_REPO, "README.md")
    if not os.path.exists(readme):
        pytest.skip("no source tree beside the tests")
    with open(readme) as f:
        return f.read()


def test_readme_first_example_runs_and_prints_what_the_readme_says(tmp_path):
    """The README's first example (CPU, the exact reference backend, ~15 s) runs as written, its selection is visibly
    sparse, and it prints the line the README shows (that line was printed with this version's selection defaults:
    a change of sp.SELECTION_DEFAULTS must update it)."""
    text = _readme()
    out = _run_readme_code(_readme_section_code(text, "### On a CPU"), tmp_path).strip()
    shown = re.search(r"it prints\n\n```text\n(.*?)\n```", text, re.S).group(1).strip()
    assert out == shown, (out, shown)
    density = float(re.search(r"density ([0-9.]+)", out).group(1))
    assert density < 0.5, out


def test_readme_usage_by_layer_runs(tmp_path):
    """The README's "Usage by layer" blocks (dense, block-sparse, chunked) run as one script, as written."""
    text = _readme()
    code = "".join(_readme_section_code(text, h) for h in
                   ("### Dense attention", "### Block-sparse prefill", "### Chunked prefill"))
    out = _run_readme_code(code, tmp_path)
    assert "paged == contiguous: True" in out, out
    assert re.search(r"density [0-9.]+, rel\. error", out) and "chunk rel. error" in out, out


# ---------------------------------------------------------------------------------------------------------------------
# numpy defaults: int64 index arrays and float64 data
# ---------------------------------------------------------------------------------------------------------------------

_rng = np.random.default_rng(11)
Q, K, V, CU_Q, CU_K = make_varlen(_rng, [8, 40], [30, 70])   # Hq=4, Hkv=2, D=64, float32
KC, VC, BT, USED = to_paged(_rng, K, V, CU_K, 16)
SEL = dict(block_size=64, sink=64, window=64, last_n=1, head_subgroups=1, dense_fraction=1.0)


def test_int64_cu_seqlens_converted_on_host():
    ref = sp.attention(Q, K, V, CU_Q, CU_K, 40, 70)
    cu_q, cu_k = CU_Q.astype(np.int64), CU_K.astype(np.int64)
    out = sp.attention(Q, K, V, cu_q, cu_k, 40, 70)
    np.testing.assert_array_equal(out, ref)
    assert cu_q.dtype == np.int64 and cu_k.dtype == np.int64   # the caller's arrays are left alone


def test_numpy_default_integer_arrays():
    """What a numpy user writes first: np.array([0, n]) (int64 on Linux) and np.cumsum of Python ints."""
    q, k, v = Q[:8], K[:30], V[:30]
    ref = sp.attention(q, k, v, np.array([0, 8], np.int32), np.array([0, 30], np.int32), 8, 30)
    out = sp.attention(q, k, v, np.array([0, 8]), np.cumsum([0, 30]), 8, 30)
    np.testing.assert_array_equal(out, ref)


def test_int64_paged_arrays_converted_on_host():
    ref = sp.attention(Q, KC, VC, CU_Q, None, 40, 70, block_table=BT, seqused_k=USED)
    out = sp.attention(Q, KC, VC, CU_Q.astype(np.int64), None, 40, 70, block_table=BT.astype(np.int64),
                       seqused_k=USED.astype(np.int64))
    np.testing.assert_array_equal(out, ref)


def test_int64_sparse_paths_converted_on_host():
    ref_index = sp.build_index(Q, K, V, CU_Q, CU_K, 40, 70, **SEL)
    index = sp.build_index(Q, K, V, CU_Q.astype(np.int64), CU_K.astype(np.int64), 40, 70, **SEL)
    np.testing.assert_array_equal(index.block_ids, ref_index.block_ids)
    ref = sp.sparse_prefill(Q, K, V, CU_Q, CU_K, 40, 70, **SEL)
    out = sp.sparse_prefill(Q, K, V, CU_Q.astype(np.int64), CU_K.astype(np.int64), 40, 70, **SEL)
    np.testing.assert_array_equal(out, ref)
    ref = sp.chunked_prefill(Q, KC, VC, CU_Q, BT, USED, 40, 70, final_chunk=True, **SEL)
    out = sp.chunked_prefill(Q, KC, VC, CU_Q.astype(np.int64), BT.astype(np.int64), USED.astype(np.int64), 40, 70,
                             final_chunk=True, **SEL)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_int64_out_of_int32_range_refused(name):
    args = dict(q=Q, k=K, v=V, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_q=40, max_seqlen_k=70)
    args[name] = args[name].astype(np.int64) + 2**32
    with pytest.raises(ValueError) as e:
        sp.attention(**args)
    msg = str(e.value)
    assert msg.startswith(name) and "does not fit in int32" in msg and "pass int32" in msg, msg


def test_int64_block_table_out_of_range_refused():
    with pytest.raises(ValueError) as e:
        sp.attention(Q, KC, VC, CU_Q, None, 40, 70, block_table=BT.astype(np.int64) - 2**40, seqused_k=USED)
    assert str(e.value).startswith("block_table"), str(e.value)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_float64_refused_naming_the_argument(name):
    args = dict(q=Q, k=K, v=V)
    args[name] = args[name].astype(np.float64)
    with pytest.raises(TypeError) as e:
        sp.attention(args["q"], args["k"], args["v"], CU_Q, CU_K, 40, 70)
    msg = str(e.value)
    assert msg.startswith(f"{name}: float64 is not supported"), msg
    assert "float16 or bfloat16" in msg and "float32" in msg and f"{name}.astype(np.float32)" in msg, msg


def test_float64_refused_on_every_entry_point():
    q64 = Q.astype(np.float64)
    for call in (lambda: sp.build_index(q64, K, V, CU_Q, CU_K, 40, 70, **SEL),
                 lambda: sp.sparse_prefill(q64, K, V, CU_Q, CU_K, 40, 70, **SEL),
                 lambda: sp.chunked_prefill(q64, KC, VC, CU_Q, BT, USED, 40, 70, final_chunk=True, **SEL),
                 lambda: sp.pool_kv(K.astype(np.float64), V, CU_K, block_size=64)):
        with pytest.raises(TypeError) as e:
            call()
        assert "float64 is not supported" in str(e.value)


class _FakeCudaArray:
    """Stands for an int64 CUDA array (no GPU needed): the refusal happens before anything reads it."""
    dtype = "int64"
    shape = (3,)

    def __dlpack_device__(self):
        return (2, 0)


class _FakeLib:
    cuda = True

    def __init__(self, compute):
        self.compute = compute


@pytest.mark.parametrize("compute,hint", [("torch", "cu_seqlens_q.to(torch.int32)"),
                                          ("cupy", "cu_seqlens_q.astype(cupy.int32)")])
def test_int64_refused_on_cuda(compute, hint):
    from sparse_prefill._arrays import normalize_dtypes
    with pytest.raises(TypeError) as e:
        normalize_dtypes({"cu_seqlens_q": _FakeCudaArray()}, _FakeLib(compute))
    msg = str(e.value)
    assert msg == f"cu_seqlens_q: int64 is not supported on CUDA; pass int32 (e.g. {hint})", msg


def test_torch_cpu_int64_converted():
    torch = pytest.importorskip("torch")
    t = [torch.from_numpy(a) for a in (Q, K, V)]
    ref = sp.attention(*t, torch.from_numpy(CU_Q), torch.from_numpy(CU_K), 40, 70)
    out = sp.attention(*t, torch.from_numpy(CU_Q).long(), torch.from_numpy(CU_K).long(), 40, 70)
    assert torch.equal(out, ref)


def test_torch_cuda_int64_refused():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    t = [torch.from_numpy(a).cuda().to(torch.bfloat16) for a in (Q, K, V)]
    cu_q, cu_k = torch.from_numpy(CU_Q).cuda().long(), torch.from_numpy(CU_K).cuda()
    with pytest.raises(TypeError) as e:
        sp.attention(*t, cu_q, cu_k, 40, 70)
    assert str(e.value) == ("cu_seqlens_q: int64 is not supported on CUDA; pass int32 "
                            "(e.g. cu_seqlens_q.to(torch.int32))")
    with pytest.raises(TypeError) as e:
        sp.attention(t[0].double(), t[1], t[2], cu_q.int(), cu_k, 40, 70)
    assert str(e.value).startswith("q: float64 is not supported") and "q.to(torch.bfloat16)" in str(e.value)


def test_selection_defaults_come_from_the_library():
    """One source for the selection's defaults: the C++ SelectionParams{} (sp.SELECTION_DEFAULTS); every public
    function's keyword defaults (numpy API and torch wrappers) and the torch schemas are those."""
    import inspect
    D = sp.Selection().as_dict()  # every field; SELECTION_DEFAULTS holds all but the per-call three
    assert sp.SELECTION_DEFAULTS == {k: v for k, v in D.items() if k not in ("final_chunk", "union", "max_kept_blocks")}
    assert D["rule"] == "row_max" and D["correction"] is False and D["alpha"] == 0.003
    assert D["head_subgroups"] == 0 and D["dense_fraction"] == 0.85
    p = sp._C.SelectionParams()
    assert list(D) == [{"union_lists": "union"}.get(k, k) for k in sp._C.SELECTION_FIELDS]  # one list, C++'s order
    c = {k: getattr(p, {"union": "union_lists"}.get(k, k)) for k in D}
    assert (c["rule"], c["max_kept_blocks"]) == (sp._api._as_rule(D["rule"]), -1) and D["max_kept_blocks"] is None
    floats = ("rule", "max_kept_blocks", "alpha", "mean_alpha", "candidate_alpha", "dense_fraction")  # float32 in C++, 7 digits here
    assert {k: v for k, v in D.items() if k not in floats} == {k: v for k, v in c.items() if k not in floats}
    assert all(abs(D[k] - c[k]) < 1e-7 for k in floats[2:])
    fns = [sp.build_index, sp.sparse_prefill, sp.chunked_prefill]
    try:
        import sparse_prefill.torch_ops as spt
        fns += [spt.sparse_prefill, spt.chunked_prefill]
        for name in ("sparse_prefill", "chunked_prefill"):
            schema = {a.name: a.default_value for a in spt.OPS[name]._schema.arguments}
            assert schema["correction"] == D["correction"] and schema["rule"] == sp._api._as_rule(D["rule"])
            assert abs(schema["alpha"] - D["alpha"]) < 1e-7 and schema["max_kept_blocks"] == -1
    except ImportError:
        pass
    # the selection keywords (numpy API and torch wrappers) default to the <library default> sentinel (a keyword
    # passed beside selection= is then told from one left out) and resolve to D
    from sparse_prefill._selection import _LIBRARY_DEFAULT, _selection
    resolved = _selection(None, {})
    assert {key: getattr(resolved, key) for key in D} == D
    for fn in fns:
        params = inspect.signature(fn).parameters
        for key in D:
            if key == "final_chunk" and fn.__name__ == "chunked_prefill":
                assert params[key].default is inspect.Parameter.empty  # the step's, required
                continue
            assert params[key].default is _LIBRARY_DEFAULT, (fn.__qualname__, key)

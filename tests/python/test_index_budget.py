"""The device index's block-id budget (max_kept_blocks, issue 16): validation (CPU), and on CUDA that a budget never
changes an answer. Segments take their ids from a bump cursor; one that finds no room is listed in full (every block
its tile sees), counted by index.overflow_segments, and the sparse output then equals dense attention on that tile.
The GPU tests are skipped without a GPU or a CUDA build (scripts/gpu.sh runs them on the H200)."""

import numpy as np
import pytest

import sparse_prefill as sp
from conftest import make_varlen, to_paged

try:
    import torch
except ImportError:  # the CPU tests below need numpy only
    torch = None

needs_cuda = pytest.mark.skipif(torch is None or not (torch.cuda.is_available() and sp._C.with_cuda),
                                reason="needs a CUDA GPU and a CUDA build")


def _arg(e):
    return getattr(e.value, "argument", None) or str(e.value).split(":")[0]


# ---- validation (any backend) --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (-7, ValueError), (2**31, ValueError), (2**40, ValueError),
                                     (1.5, TypeError), (True, TypeError), ("8", TypeError)])
def test_max_kept_blocks_is_validated_with_its_name(rng, bad, exc):
    q, k, v, cu_q, cu_k = make_varlen(rng, [300], [300])
    calls = [lambda: sp.build_index(q, k, v, cu_q, cu_k, 300, 300, max_kept_blocks=bad, dense_fraction=1.0),
             lambda: sp.index_workspace_bytes(q, k, v, cu_q, cu_k, 300, 300, max_kept_blocks=bad),
             lambda: sp.sparse_prefill_workspace_bytes(q, k, v, cu_q, cu_k, 300, 300, max_kept_blocks=bad),
             lambda: sp.sparse_prefill(q, k, v, cu_q, cu_k, 300, 300, max_kept_blocks=bad, dense_fraction=1.0)]
    for call in calls:
        with pytest.raises(exc) as e:
            call()
        assert _arg(e) == "max_kept_blocks", str(e.value)


def test_max_kept_blocks_valid_values_on_the_cpu(rng):
    # The CPU reference has no budget: the same index whatever the budget, no overflow.
    q, k, v, cu_q, cu_k = make_varlen(rng, [700, 129], [700, 300])
    ref = sp.build_index(q, k, v, cu_q, cu_k, 700, 700, alpha=0.3, dense_fraction=1.0)
    assert ref.overflow_segments == 0
    for budget in (None, 0, 5, 2**31 - 1):
        got = sp.build_index(q, k, v, cu_q, cu_k, 700, 700, alpha=0.3, max_kept_blocks=budget, dense_fraction=1.0)
        assert got.overflow_segments == 0
        for name in ("segment_start", "segment_end", "block_ids"):
            np.testing.assert_array_equal(got.host[name], ref.host[name])
        assert sp.index_workspace_bytes(q, k, v, cu_q, cu_k, 700, 700, max_kept_blocks=budget) == 0


def test_chunked_prefill_takes_max_kept_blocks(rng):
    q, k, v, cu_q, cu_k = make_varlen(rng, [64], [500])
    kc, vc, bt, used = to_paged(rng, k, v, cu_k, 64)
    with pytest.raises(ValueError) as e:
        sp.chunked_prefill(q, kc, vc, cu_q, bt, used, 64, 500, final_chunk=True, max_kept_blocks=-3,
                           dense_fraction=1.0)
    assert _arg(e) == "max_kept_blocks"
    sp.chunked_prefill(q, kc, vc, cu_q, bt, used, 64, 500, final_chunk=True, max_kept_blocks=10, dense_fraction=1.0)


# ---- CUDA ----------------------------------------------------------------------------------------------------------

def _structured(rng, q_lens, k_lens, hq=8, hkv=2):
    """Structured-workload sequences (selection keeps and drops blocks) as a bf16 varlen batch on the GPU; a
    sequence with Lq < Lk is the last Lq queries of an Lk-token prompt (a chunk)."""
    qs, ks, vs = [], [], []
    for lq, lk in zip(q_lens, k_lens):
        q, k, v = sp.workload.structured(lk, num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                                         seed=int(rng.integers(1 << 30)))
        qs.append(q[lk - lq:])
        ks.append(k)
        vs.append(v)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    bf = torch.bfloat16
    g = [torch.from_numpy(np.concatenate(a)).cuda().to(bf) for a in (qs, ks, vs)]
    return g + [torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda()], max(q_lens), max(k_lens)


def _lists(host):
    h = host.host
    return [h["block_ids"][a:e].tolist() for a, e in zip(h["segment_start"], h["segment_end"])]


def _full_lists(q_lens, k_lens, hkv, g, block_size=128):
    """Every segment's full list: blocks 0 .. n - 1, n the blocks its tile's last row sees (causal, bottom-right)."""
    out = []
    for lq, lk in zip(q_lens, k_lens):
        tiles = -(-lq * g // 128)
        for _ in range(hkv):
            for t in range(tiles):
                last = (min(t * 128 + 128, lq * g) - 1) // g
                hi = min(lk - 1, last + lk - lq)
                out.append(list(range(hi // block_size + 1)) if hi >= 0 else [])
    return out


def _close_to(out, lse, ref, ref_lse):
    # The same math on other tile shapes (and split-KV combines): 2 bf16 ulps, LSE to 1e-3 (as alpha=0 vs dense).
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=2 ** -7)
    assert (lse - ref_lse).abs().max().item() <= 1e-3


CASES = [  # q_lens, k_lens, hq, hkv
    ([3001, 700], [3001, 900], 8, 2),          # prompts and a chunk, GQA 4
    ([300, 1100], [4100, 2100], 8, 1),         # chunks against longer caches: the split-KV plan, GQA 8
]


@needs_cuda
@pytest.mark.parametrize("q_lens,k_lens,hq,hkv", CASES)
@pytest.mark.parametrize("union", [False, True])
def test_budget_that_fits_gives_the_default_index(q_lens, k_lens, hq, hkv, union):
    rng = np.random.default_rng()
    gpu, mq, mk = _structured(rng, q_lens, k_lens, hq, hkv)
    ref = sp.build_index(*gpu, mq, mk, alpha=0.2, head_subgroups=1, union=union, dense_fraction=1.0)
    ref_host = ref.to_host()
    assert ref.overflow_segments == 0 and ref_host.overflow_segments == 0 and 0 < ref.density <= 1
    assert union or ref.density < 1  # union lists cover every tile's list: density 1 on these inputs (H200)
    # Per-tile mode needs exactly the kept ids; union mode the per-tile lists (their kept ids, at most the union
    # blocks each tile sees: ref.kept_blocks) and then the unions (the host copy's ids: one list per sequence and head).
    budget = ref.kept_blocks if not union else ref.kept_blocks + ref_host.host["block_ids"].size
    got = sp.build_index(*gpu, mq, mk, alpha=0.2, head_subgroups=1, union=union, max_kept_blocks=budget, dense_fraction=1.0)
    host = got.to_host()
    assert got.overflow_segments == 0 and host.overflow_segments == 0
    assert (got.kept_blocks, got.visible_blocks) == (ref.kept_blocks, ref.visible_blocks)
    for name in ("segment_start", "segment_end", "block_ids"):   # the host copy is in segment order: same arrays
        np.testing.assert_array_equal(host.host[name], ref_host.host[name])
    assert (sp.index_workspace_bytes(*gpu, mq, mk, union=union, max_kept_blocks=budget) <
            sp.index_workspace_bytes(*gpu, mq, mk, union=union))


@needs_cuda
@pytest.mark.parametrize("q_lens,k_lens,hq,hkv", CASES)
@pytest.mark.parametrize("correction", [False, True])
@pytest.mark.parametrize("union", [False, True])
def test_zero_budget_overflows_every_segment_and_equals_dense(q_lens, k_lens, hq, hkv, correction, union):
    rng = np.random.default_rng()
    gpu, mq, mk = _structured(rng, q_lens, k_lens, hq, hkv)
    g = hq // hkv
    full = _full_lists(q_lens, k_lens, hkv, g)
    idx = sp.build_index(*gpu, mq, mk, alpha=0.2, head_subgroups=1, correction=correction, union=union, max_kept_blocks=0,
                         dense_fraction=1.0)
    assert idx.overflow_segments == len(full)                     # every segment (each sees a block here)
    assert idx.kept_blocks == idx.visible_blocks and idx.density == 1.0
    host = idx.to_host()
    assert host.overflow_segments == idx.overflow_segments
    assert _lists(host) == full
    dense, dense_lse = sp.attention(*gpu, mq, mk, return_lse=True)
    out, lse = sp.sparse_attention(*gpu[:3], idx, *gpu[3:], mq, mk, return_lse=True)
    torch.cuda.synchronize()
    _close_to(out, lse, dense, dense_lse)
    ws = torch.empty(sp.sparse_prefill_workspace_bytes(*gpu, mq, mk, union=union, correction=correction,
                                                       max_kept_blocks=0), dtype=torch.uint8, device="cuda")
    out, lse = sp.sparse_prefill(*gpu, mq, mk, alpha=0.2, head_subgroups=1, correction=correction, union=union, max_kept_blocks=0,
                                 workspace=ws, return_lse=True, dense_fraction=1.0)
    torch.cuda.synchronize()
    _close_to(out, lse, dense, dense_lse)


@needs_cuda
@pytest.mark.parametrize("q_lens,k_lens,hq,hkv", CASES)
@pytest.mark.parametrize("correction", [False, True])
@pytest.mark.parametrize("union", [False, True])
def test_partial_budget_lists_each_segment_in_full_or_as_selected(q_lens, k_lens, hq, hkv, correction, union):
    rng = np.random.default_rng()
    gpu, mq, mk = _structured(rng, q_lens, k_lens, hq, hkv)
    g = hq // hkv
    full = _full_lists(q_lens, k_lens, hkv, g)
    ref = sp.build_index(*gpu, mq, mk, alpha=0.2, head_subgroups=1, correction=correction, union=union, dense_fraction=1.0)
    selected = _lists(ref.to_host())
    if union:
        # The per-tile lists all fit (their ids are the per-tile index's kept blocks), then the unions one short:
        # the first union to ask fits, the last does not.
        per_tile = sp.build_index(*gpu, mq, mk, alpha=0.2, head_subgroups=1, correction=correction, dense_fraction=1.0).kept_blocks
        budget = per_tile + int(ref.to_host().host["block_ids"].size) - 1
    else:
        budget = ref.kept_blocks // 2  # segments take their ids in the order they finish: about half overflow
    idx = sp.build_index(*gpu, mq, mk, alpha=0.2, head_subgroups=1, correction=correction, union=union, max_kept_blocks=budget,
                         dense_fraction=1.0)
    host = idx.to_host()
    got = _lists(host)
    assert 0 < idx.overflow_segments < len(full), (idx.overflow_segments, len(full))
    # Each segment holds its selection or, overflowed, its full list; the count covers every changed segment.
    changed = sum(a != s for a, s in zip(got, selected))
    assert all(a == s or a == f for a, s, f in zip(got, selected, full))
    assert changed <= idx.overflow_segments <= sum(a == f for a, f in zip(got, full))
    assert host.overflow_segments == idx.overflow_segments
    assert idx.visible_blocks == ref.visible_blocks and idx.kept_blocks >= ref.kept_blocks
    if not union:  # kept counts the listed ids (full lists included)
        assert idx.kept_blocks == sum(len(a) for a in got)
    # The GPU over its own (partly overflowed) device index equals the GPU over its host copy, which lists the
    # overflowed segments in full: the kernel's full-list mode is that list.
    out, lse = sp.sparse_attention(*gpu[:3], idx, *gpu[3:], mq, mk, return_lse=True)
    want, want_lse = sp.sparse_attention(*gpu[:3], host, *gpu[3:], mq, mk, return_lse=True, reuse_index=True)
    torch.cuda.synchronize()
    _close_to(out, lse, want, want_lse)


@needs_cuda
def test_budget_sizes_the_workspace():
    rng = np.random.default_rng()
    gpu, mq, mk = _structured(rng, [1500], [1500])
    default = sp.index_workspace_bytes(*gpu, mq, mk)
    assert sp.index_workspace_bytes(*gpu, mq, mk, max_kept_blocks=2**31 - 1) == default   # clamped to the bound
    zero = sp.index_workspace_bytes(*gpu, mq, mk, max_kept_blocks=0)
    small = sp.index_workspace_bytes(*gpu, mq, mk, max_kept_blocks=50)  # below the causal bound (~600 ids here)
    assert 200 <= small - zero <= 200 + 256                       # 4 bytes a slot, 256-byte carving
    idx = sp.build_index(*gpu, mq, mk, dense_fraction=1.0)
    assert default - zero >= 4 * idx.visible_blocks               # the causal bound holds every visible block
    # A workspace sized for a budget is too small for the default one, and the error says what it needs.
    ws = torch.empty(small, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="^workspace: needs at least"):
        sp.build_index(*gpu, mq, mk, workspace=ws, dense_fraction=1.0)
    idx = sp.build_index(*gpu, mq, mk, workspace=ws, max_kept_blocks=50, dense_fraction=1.0)
    assert idx.kept_blocks == idx.to_host().kept_blocks


@needs_cuda
def test_overflow_with_head_subgroups_and_paged_kv():
    rng = np.random.default_rng()
    q_lens, k_lens = [1200], [1200]
    gpu, mq, mk = _structured(rng, q_lens, k_lens, 8, 2)
    kc, vc, bt, used = to_paged(rng, gpu[1].float().cpu().numpy(), gpu[2].float().cpu().numpy(),
                                gpu[4].cpu().numpy(), 128)
    kc, vc = (torch.from_numpy(a).cuda().to(torch.bfloat16) for a in (kc, vc))
    bt, used = torch.from_numpy(bt).cuda(), torch.from_numpy(used).cuda()
    dense, dense_lse = sp.attention(*gpu, mq, mk, return_lse=True)
    for kw in (dict(head_subgroups=2), dict(rule="tile_energy"), dict(rule="probe_row_max")):
        out, lse, idx = sp.sparse_prefill(gpu[0], kc, vc, gpu[3], None, mq, mk, block_table=bt, seqused_k=used,
                                          max_kept_blocks=0, return_lse=True, return_index=True, **kw)
        torch.cuda.synchronize()
        assert idx.overflow_segments > 0 and idx.density == 1.0, kw
        _close_to(out, lse, dense, dense_lse)

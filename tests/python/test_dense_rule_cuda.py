"""The dense rule (dense_fraction) and the per-query-head default (head_subgroups 0) on CUDA, against the CPU
reference and against dense attention: the device index lists every visible block when the rule fires (decided on
the device), a one-shot launch then runs the dense kernel (bit-identical to sp.attention) and the sparse kernel when
it does not (the CPU reference's output, poisoned outputs fully written), chunk shapes run the full lists through
the sparse kernel, FP8 and paged KV take the same gates, and a CUDA graph replays the decision. Skipped without a
GPU (scripts/gpu.sh runs them on the H200)."""

import numpy as np
import pytest

import sparse_prefill as sp
from conftest import to_paged

torch = pytest.importorskip("torch")
if not (torch.cuda.is_available() and sp._C.with_cuda):
    pytest.skip("needs a CUDA GPU and a CUDA build", allow_module_level=True)

from test_cuda import _assert_bf16_close, _check_close, _structured_varlen, _to  # noqa: E402


def _raw_density(args, mq, mk, **sel):
    return sp.build_index(*args, mq, mk, dense_fraction=1.0, **sel).density


def _full_lists(index):
    """Every segment of a host index lists 0 .. n - 1 (causal: the full list of its tile)."""
    for s in range(index.num_segments):
        ids = index.block_ids[index.segment_start[s]:index.segment_end[s]]
        if not np.array_equal(ids, np.arange(len(ids))):
            return False
    return True


@pytest.mark.parametrize("q_lens,k_lens,hq,hkv", [([1763, 129], [1763, 129], 8, 2), ([2000], [2000], 4, 1)])
def test_index_fires_like_the_cpu_reference(q_lens, k_lens, hq, hkv):
    rng = np.random.default_rng()
    cpu, gpu, mq, mk = _structured_varlen(rng, q_lens, k_lens, hq, hkv)
    raw = _raw_density(cpu, mq, mk, alpha=0.2)
    assert 0 < raw < 1
    for frac, fires in ((raw * 0.99, True), (min(1.0, raw * 1.01 + 1e-3), False)):
        ref = sp.build_index(*cpu, mq, mk, alpha=0.2, dense_fraction=frac)
        got = sp.build_index(*gpu, mq, mk, alpha=0.2, dense_fraction=frac)
        host = got.to_host()
        assert (got.density == 1.0) == fires and (ref.density == 1.0) == fires, (frac, raw, got.density)
        assert got.visible_blocks == ref.visible_blocks and host.overflow_segments == 0
        if fires:  # the same full list per segment (its length is the tile's visible blocks)
            assert _full_lists(host) and _full_lists(ref)
            lengths = lambda i: i.host["segment_end"] - i.host["segment_start"]  # noqa: E731
            assert np.array_equal(lengths(host), lengths(ref))


def test_one_shot_fired_is_the_dense_kernel_and_unfired_the_sparse_one():
    rng = np.random.default_rng()
    cpu, gpu, mq, mk = _structured_varlen(rng, [2500, 700], [2500, 700], 8, 2)
    dense, dense_lse = sp.attention(*gpu, mq, mk, return_lse=True)
    out = torch.full_like(gpu[0], float("nan"))
    got, lse, index = sp.sparse_prefill(*gpu, mq, mk, alpha=0.2, dense_fraction=0.01, out=out, return_lse=True,
                                        return_index=True)
    torch.cuda.synchronize()
    assert got is out and index.density == 1.0
    assert torch.equal(got, dense) and torch.equal(lse, dense_lse)  # the same dense kernel on the same inputs
    # not fired: the sparse kernel's output (the CPU reference over the same index), every element written
    out = torch.full_like(gpu[0], float("nan"))
    got, lse, index = sp.sparse_prefill(*gpu, mq, mk, alpha=0.2, dense_fraction=1.0, out=out, return_lse=True,
                                        return_index=True)
    host = index.to_host()
    assert 0 < host.density < 1
    ref, ref_lse = sp.sparse_attention(*cpu[:3], host, *cpu[3:], mq, mk, return_lse=True, reuse_index=True)
    torch.cuda.synchronize()
    assert not torch.isnan(got).any()
    _check_close(got, lse, ref, ref_lse)
    assert (got.float() - dense.float()).abs().max().item() > 1e-3  # really sparse


def test_default_selection_is_per_query_head_on_gpu():
    rng = np.random.default_rng()
    cpu, gpu, mq, mk = _structured_varlen(rng, [1500, 400], [1500, 3000], 8, 2)
    a = sp.build_index(*gpu, mq, mk).to_host()
    b = sp.build_index(*gpu, mq, mk, head_subgroups=4).to_host()
    ref = sp.build_index(*cpu, mq, mk)
    assert sp.SELECTION_DEFAULTS["head_subgroups"] == 0
    assert a.num_subgroups == b.num_subgroups == ref.num_subgroups == 4 and a.group_size == 1
    for key in ("segment_start", "segment_end", "block_ids"):
        assert np.array_equal(a.host[key], b.host[key]), key
    assert a.visible_blocks == ref.visible_blocks and abs(a.density - ref.density) <= 0.01


@pytest.mark.parametrize("union", [False, True])
def test_chunk_shapes_run_the_full_lists(union):
    """Chunk shapes are planned (split-KV): the sparse kernel runs the fired index's full lists, i.e. dense attention
    of the chunk against its cache."""
    rng = np.random.default_rng()
    cpu, gpu, mq, mk = _structured_varlen(rng, [256, 77], [9000, 4000], 8, 2)
    dense = sp.attention(*gpu, mq, mk)
    got, index = sp.sparse_prefill(*gpu, mq, mk, alpha=0.2, union=union, dense_fraction=0.01, return_index=True)
    torch.cuda.synchronize()
    assert index.density == 1.0
    _assert_bf16_close(got, dense)


def test_paged_and_fp8_one_shot_fired():
    rng = np.random.default_rng()
    cpu, gpu, mq, mk = _structured_varlen(rng, [1500], [1500], 8, 2)
    kc, vc, bt, used = to_paged(rng, cpu[1].float().numpy(), cpu[2].float().numpy(), cpu[4].numpy(), 64)
    g = lambda a, dt=None: _to(a, "cuda", dt)  # noqa: E731
    paged = (gpu[0], g(kc, torch.bfloat16), g(vc, torch.bfloat16), gpu[3], None)
    kw = dict(block_table=g(bt), seqused_k=g(used))
    dense = sp.attention(*paged, mq, mk, **kw)
    got = sp.sparse_prefill(*paged, mq, mk, alpha=0.2, dense_fraction=0.01, **kw)
    torch.cuda.synchronize()
    assert torch.equal(got, dense)
    f8 = [x.to(torch.float8_e4m3fn) for x in gpu[:3]] + list(gpu[3:])
    dense8 = sp.attention(*f8, mq, mk)
    got8 = sp.sparse_prefill(*f8, mq, mk, alpha=0.2, dense_fraction=0.01)
    torch.cuda.synchronize()
    assert torch.equal(got8, dense8)


def test_cuda_graph_replays_the_device_decision():
    """One captured sparse_prefill, replayed on inputs that fire the rule and on inputs that do not: the decision is
    read on the device at replay time."""
    rng = np.random.default_rng()
    _, sel_gpu, mq, mk = _structured_varlen(rng, [4096], [4096], 8, 2)           # selective: stays sparse
    noise = [torch.randn_like(x) if x.is_floating_point() else x for x in sel_gpu]  # Gaussian: keeps ~all blocks
    frac, a = 0.85, 0.2
    assert _raw_density(sel_gpu, mq, mk, alpha=a) < frac < _raw_density(noise, mq, mk, alpha=a)
    bufs = [x.clone() for x in sel_gpu]
    ws = torch.empty(sp.sparse_prefill_workspace_bytes(*bufs, mq, mk, alpha=a, dense_fraction=frac),
                     dtype=torch.uint8, device="cuda")
    out = torch.empty_like(bufs[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sp.sparse_prefill(*bufs, mq, mk, alpha=a, dense_fraction=frac, out=out, workspace=ws)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sp.sparse_prefill(*bufs, mq, mk, alpha=a, dense_fraction=frac, out=out, workspace=ws)
    for inputs in (noise, sel_gpu, noise):
        for b, x in zip(bufs, inputs):
            b.copy_(x)
        graph.replay()
        want = sp.sparse_prefill(*inputs, mq, mk, alpha=a, dense_fraction=frac)
        torch.cuda.synchronize()
        assert torch.equal(out, want)

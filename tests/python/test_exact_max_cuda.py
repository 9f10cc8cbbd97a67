"""rule='exact_max' (issue 44, docs/design/exact_max_spec.md) on the GPU: the CUDA index stage (exact_max.cu: the
candidates of row_max at candidate_alpha over the bf16 pooled means, then the exact block maxima of the candidates'
keys on wgmma with float accumulators, one pass from the diagonal down) against the CPU reference (double) on the same
inputs. The GPU's pooled scores are bf16 means (the candidates may flip near candidate_alpha's threshold, as
row_max's do) and its exact scores float32 sums: the symmetric difference of the kept sets is bounded as
test_key_max_cuda's; densities agree to 0.01. Skipped without a GPU or without a CUDA build (scripts/gpu.sh runs
them)."""

import numpy as np
import pytest

import sparse_prefill as sp
from conftest import make_varlen

torch = pytest.importorskip("torch")
if not (torch.cuda.is_available() and sp._C.with_cuda):
    pytest.skip("needs a CUDA GPU and a CUDA build", allow_module_level=True)

from test_cuda import (_assert_bf16_close, _chunk_step, _paged_prompt, _segments_differ,  # noqa: E402
                       _structured_varlen, _to)


def _flips_bound(ref):
    return max(4, ref.kept_blocks // 100)


def _agree(ref, got, batch, heads):
    assert got.num_segments == ref.num_segments and got.visible_blocks == ref.visible_blocks
    differ = _segments_differ(ref, got, batch, heads)
    assert differ <= _flips_bound(ref), (differ, ref.kept_blocks)
    assert abs(got.density - ref.density) <= 0.01, (got.density, ref.density)


@pytest.mark.parametrize("q_lens,k_lens,hkv", [
    ([1, 129, 1763], [1, 129, 1763], 2),       # odd lengths, GQA 4
    ([11, 300, 1000], [1000, 4100, 5000], 1),  # chunks (Lq < Lk), GQA 8
    ([3000], [3000], 2),
])
@pytest.mark.parametrize("alpha,candidate_alpha,subgroups", [
    (0.05, 0.003, 0), (0.3, 0.003, 0), (0.03, 0.05, 1), (0.5, 0.0, 0),
])
def test_exact_max_index_on_gpu_matches_cpu(q_lens, k_lens, hkv, alpha, candidate_alpha, subgroups):
    rng = np.random.default_rng()
    cpu, gpu, mq, mk = _structured_varlen(rng, q_lens, k_lens, 8, hkv)
    kw = dict(alpha=alpha, candidate_alpha=candidate_alpha, rule="exact_max", head_subgroups=subgroups,
              dense_fraction=1.0)
    ref = sp.build_index(*cpu, mq, mk, **kw)
    got = sp.build_index(*gpu, mq, mk, **kw).to_host()
    _agree(ref, got, len(q_lens), hkv * (8 // hkv if subgroups == 0 else subgroups))


@pytest.mark.parametrize("sink,window,block,padded", [
    (0, 0, 128, False), (100, 64, 64, True), (700, 300, 128, False), (1000, 0, 64, True),
])
def test_exact_max_sink_window_and_padded_rows_match_cpu(sink, window, block, padded):
    """The bound's sink keys (none, part of a 32-key chunk, several chunks, past the shortest sequence), the window
    band and the not-fully-visible blocks as candidates that set the running maxima; padded: K rows whose stride is not
    a multiple of 16 bytes (the element-copy loads of the sink chunks and of the K units)."""
    rng = np.random.default_rng()
    cpu, gpu, mq, mk = _structured_varlen(rng, [5, 700, 1100], [5, 2500, 1100], 8, 2)
    if padded:  # made on the device (a copy would make them contiguous)
        gpu[1:3] = (torch.cat([x, torch.zeros_like(x[..., :1])], dim=-1)[..., :128] for x in gpu[1:3])
        assert gpu[1].stride(1) * gpu[1].element_size() % 16 and torch.equal(gpu[1].cpu(), cpu[1])
    kw = dict(alpha=0.3, rule="exact_max", sink=sink, window=window, block_size=block, dense_fraction=1.0)
    ref = sp.build_index(*cpu, mq, mk, **kw)
    got = sp.build_index(*gpu, mq, mk, **kw).to_host()
    assert ref.visible_blocks - ref.kept_blocks > _flips_bound(ref), (ref.visible_blocks, ref.kept_blocks)
    _agree(ref, got, 3, 8)


@pytest.mark.parametrize("subgroups", [0, 1])
def test_exact_max_gqa3_d64_matches_cpu(subgroups):
    """SmolLM2's shapes: 9 query heads over 3 KV heads, head dim 64, per query head (sub-groups 3) or per KV head."""
    rng = np.random.default_rng()
    lens = [3000, 1777]
    parts = [sp.workload.structured(n, num_q_heads=9, num_kv_heads=3, head_dim=64, seed=int(rng.integers(1 << 30)))
             for n in lens]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cpu = [_to(np.concatenate([p[i] for p in parts]), "cpu", torch.bfloat16) for i in range(3)] + [_to(cu, "cpu")] * 2
    gpu = [a.cuda() for a in cpu]
    kw = dict(alpha=0.3, rule="exact_max", head_subgroups=subgroups, dense_fraction=1.0)
    ref = sp.build_index(*cpu, max(lens), max(lens), **kw)
    got = sp.build_index(*gpu, max(lens), max(lens), **kw).to_host()
    assert ref.density < 0.95
    _agree(ref, got, len(lens), 3 * (3 if subgroups == 0 else subgroups))


def test_exact_max_d64_fp16_and_block_256():
    rng = np.random.default_rng()
    q, k, v, cu_q, cu_k = make_varlen(rng, [700, 129], [2000, 129], hq=8, hkv=2, d=64)
    for dt in (torch.bfloat16, torch.float16):
        cpu = [_to(a, "cpu", dt) for a in (q, k, v)] + [_to(cu_q, "cpu"), _to(cu_k, "cpu")]
        gpu = [a.cuda() for a in cpu]
        for block in (128, 256):
            kw = dict(alpha=0.3, candidate_alpha=0.1, rule="exact_max", block_size=block, head_subgroups=1,
                      dense_fraction=1.0)
            ref = sp.build_index(*cpu, 700, 2000, **kw)
            got = sp.build_index(*gpu, 700, 2000, **kw).to_host()
            assert _segments_differ(ref, got, 2, 2) <= _flips_bound(ref)


def test_exact_max_alpha0_keeps_the_candidates_and_prefill_matches_reference():
    """alpha 0 keeps every candidate: the selection is row_max's at candidate_alpha (both on the GPU: the same bf16
    pooled scores); both alphas 0 are dense. A pruning selection's sparse output over the GPU's own index equals the
    CPU reference's over it."""
    rng = np.random.default_rng()
    cpu, gpu, mq, mk = _structured_varlen(rng, [1763, 300], [1763, 3000], 8, 2)
    cand = sp.build_index(*gpu, mq, mk, alpha=0.0, candidate_alpha=0.3, rule="exact_max", dense_fraction=1.0)
    row = sp.build_index(*gpu, mq, mk, alpha=0.3, rule="row_max", dense_fraction=1.0)
    c, r = cand.to_host(), row.to_host()
    assert c.density < 1.0 and _segments_differ(r, c, 2, 8) <= 2  # the two thresholds' float forms may tie apart
    dense = sp.build_index(*gpu, mq, mk, alpha=0.0, candidate_alpha=0.0, rule="exact_max")
    assert dense.kept_blocks == dense.visible_blocks
    kw = dict(alpha=0.3, rule="exact_max", window=128, sink=0, last_n=1, dense_fraction=1.0)
    index = sp.build_index(*gpu, mq, mk, **kw)
    host = index.to_host()
    assert host.density < 0.8
    got = sp.sparse_attention(*gpu[:3], index, *gpu[3:], mq, mk)
    want = sp.sparse_attention(*cpu[:3], host, *cpu[3:], mq, mk, reuse_index=True)
    torch.cuda.synchronize()
    _assert_bf16_close(got, want)
    out = sp.sparse_prefill(*gpu, mq, mk, **kw)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    _assert_bf16_close(out, want)


def test_exact_max_poisoned_workspace_and_repeat():
    """The index reads nothing it did not write: a workspace of 0xff bytes and a zeroed one give the same selection,
    and so do repeated calls."""
    rng = np.random.default_rng()
    cpu, gpu, mq, mk = _structured_varlen(rng, [1500, 777], [1500, 2500], 8, 2)
    kw = dict(alpha=0.1, rule="exact_max", dense_fraction=1.0)
    n = sp.index_workspace_bytes(*gpu, mq, mk, **kw)
    hosts = []
    for fill in (0xFF, 0x00, 0xFF):
        ws = torch.full((n,), fill, dtype=torch.uint8, device="cuda")
        hosts.append(sp.build_index(*gpu, mq, mk, workspace=ws, **kw).to_host())
    for h in hosts[1:]:
        assert h.kept_blocks == hosts[0].kept_blocks
        assert _segments_differ(hosts[0], h, 2, 8) == 0


def test_exact_max_nan_key_keeps_the_tile():
    """A NaN key (block 2, key 300): the tiles whose rows see block 2 (its mean and its exact scores are NaN) keep
    every visible block, as the reference's; the earlier tiles select."""
    rng = np.random.default_rng()
    cpu, gpu, mq, mk = _structured_varlen(rng, [2000], [2000], 8, 2)
    k = gpu[1].clone()
    k[300, 0, 5] = float("nan")
    kw = dict(alpha=0.5, rule="exact_max", dense_fraction=1.0, head_subgroups=1, sink=0, window=0, last_n=0)
    got = sp.build_index(gpu[0], k, *gpu[2:], mq, mk, **kw).to_host()
    ref = sp.build_index(cpu[0], k.cpu(), *cpu[2:], mq, mk, **kw)
    assert _segments_differ(ref, got, 1, 2) <= _flips_bound(ref)
    first = (256 * 4) // 128  # the first tile (packed rows of 4 heads) whose rows see block 2
    for t in range(first, int(ref.tiles[0])):
        assert len(got.segment(0, 0, t)) == len(ref.segment(0, 0, t)) == (t * 128 // 4 + 31) // 128 + 1


def test_exact_max_chunked_paged_union_on_gpu():
    """Chunks of 1024 over a paged cache (the K units read through the block table): each step's GPU index matches the
    CPU reference's, per tile and in union mode, and chunked_prefill runs on it."""
    rng = np.random.default_rng()
    L, C = 4000, 1024
    qg, kc, vc, bt, _, _ = _paged_prompt(rng, L)
    for c0 in range(0, L, C):
        c1 = min(L, c0 + C)
        q, k, v, cu_q, bt_, used, mq, mk = _chunk_step(qg, kc, vc, bt, c0, c1)
        for union in (False, True):
            kw = dict(alpha=0.1, rule="exact_max", final_chunk=c1 == L, union=union, dense_fraction=1.0)
            ref = sp.build_index(*(a.cpu() for a in (q, k, v, cu_q)), None, mq, mk, block_table=bt_.cpu(),
                                 seqused_k=used.cpu(), **kw)
            dev = sp.build_index(q, k, v, cu_q, None, mq, mk, block_table=bt_, seqused_k=used, **kw).to_host()
            assert _segments_differ(ref, dev, 1, 8) <= _flips_bound(ref)
        out = sp.chunked_prefill(q, kc, vc, cu_q, bt_, used, mq, mk, final_chunk=c1 == L, alpha=0.1,
                                 rule="exact_max")
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()


@pytest.mark.parametrize("alpha", [0.03, 0.3])
def test_exact_max_topic_prunes_as_the_reference(alpha):
    """The topic workload at 6K (fresh seed): the candidates are a fraction of the visible blocks and the exact stage
    prunes within them; the GPU's selection equals the CPU reference's up to near-threshold flips."""
    seed = int(np.random.default_rng().integers(1 << 30))
    q, k, v = sp.workload.topic(6144 + 77, num_q_heads=8, num_kv_heads=2, seed=seed)
    L = q.shape[0]
    cpu = [torch.from_numpy(a).to(torch.bfloat16) for a in (q, k, v)]
    cu = torch.tensor([0, L], dtype=torch.int32)
    gpu = [a.cuda() for a in cpu] + [cu.cuda(), cu.cuda()]
    kw = dict(alpha=alpha, rule="exact_max", dense_fraction=1.0)
    ref = sp.build_index(*cpu, cu, cu, L, L, **kw)
    got = sp.build_index(*gpu, L, L, **kw).to_host()
    cand = sp.build_index(*cpu, cu, cu, L, L, alpha=0.003, rule="row_max", dense_fraction=1.0)
    assert ref.density < 0.5 and ref.kept_blocks <= cand.kept_blocks
    _agree(ref, got, 1, 8)
    assert abs(got.density - ref.density) <= 0.005


def test_exact_max_fp8_matches_cpu():
    """FP8 e4m3 q/k/v with per-(sequence, KV head) descales (varlen, a chunk with Lq < Lk, Lk not a multiple of 128):
    the exact stage reads e4m3 keys exactly in bf16 with the k descale on the score, as the reference's real units."""
    from test_fp8_sparse import _check_selection, _fp8_case
    rng = np.random.default_rng()
    cpu, gpu, kw_cpu, kw_gpu, mq, mk = _fp8_case(rng, [700, 1500], [3000, 1500], 8, 2)
    sel = dict(alpha=0.1, rule="exact_max", dense_fraction=1.0)
    ref = sp.build_index(*cpu, mq, mk, **kw_cpu, **sel)
    got = sp.build_index(*gpu, mq, mk, **kw_gpu, **sel).to_host()
    assert ref.density < 1.0
    _check_selection(ref, got, 2, 8)


def test_exact_max_is_supported_on_gpu_and_long_prompts_are_refused_clearly():
    """sparse_support reports no reason for exact_max on CUDA arrays; a max_seqlen_k past the per-key scorer's 65535
    units of 64 keys is refused before any launch, naming max_seqlen_k."""
    rng = np.random.default_rng()
    q, k, v, cu_q, cu_k = make_varlen(rng, [300], [300], hq=8, hkv=2, d=128)
    gpu = [_to(a, "cuda", torch.bfloat16) for a in (q, k, v)] + [_to(cu_q, "cuda"), _to(cu_k, "cuda")]
    assert sp.sparse_support(*gpu, 300, 300, rule="exact_max") is None
    with pytest.raises(NotImplementedError, match="max_seqlen_k"):
        sp.build_index(*gpu, 300, 65536 * 64 + 1, rule="exact_max")

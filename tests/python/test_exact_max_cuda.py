"""rule='exact_max' (issue 44, docs/design/exact_max_spec.md) on the GPU: the CUDA index stage (exact_max.cu: the
candidates of row_max at candidate_alpha over the bf16 pooled means, then the block maxima of the candidates' keys on
e4m3 operands, rounded as the reference rounds them, on FP8 wgmma with float accumulators, one pass from the diagonal
down) against the CPU reference (double) on the same inputs. The GPU's pooled scores are bf16 means (the candidates
may flip near candidate_alpha's threshold, as row_max's do) and its exact scores the tensor cores' sums of the e4m3
products: the symmetric difference of the kept sets is bounded as
test_key_max_cuda's; densities agree to 0.01. The cases both per-key rules share (sink keys, window band and padded
rows, GQA 3 at D 64, fp16 and block 256, poisoned workspace, NaN key, chunked paged union, topic, FP8) are
test_key_max_cuda.py's, parametrized by rule. Skipped without a GPU or without a CUDA build (scripts/gpu.sh runs
them)."""

import numpy as np
import pytest

import sparse_prefill as sp
from conftest import BAND_CASE_SELECTION, band_case, make_varlen

torch = pytest.importorskip("torch")
if not (torch.cuda.is_available() and sp._C.with_cuda):
    pytest.skip("needs a CUDA GPU and a CUDA build", allow_module_level=True)

from test_cuda import _assert_bf16_close, _segments_differ, _structured_varlen, _to  # noqa: E402


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


def test_exact_max_zero_units_and_rows_match_cpu():
    """The e4m3 operands' edge cases (exact_max_spec.md step 3): a unit of 64 zero keys (amax 0: scale 0, its scores
    0, not NaN) inside a candidate block, one at the sequence's tail, and zero query rows (scale 0: every score 0),
    against the reference, which rounds alike."""
    rng = np.random.default_rng()
    cpu, gpu, mq, mk = _structured_varlen(rng, [3000], [3000], 8, 2)  # 3000 tokens prune (density ~0.75; 1500 ~1.0)
    q, k = cpu[0].clone(), cpu[1].clone()
    k[640:704] = 0   # a whole unit
    k[2944:] = 0     # the tail unit (keys 2944-2999)
    q[2100:2103] = 0  # three positions: every head's row zero
    cpu = [q, k, cpu[2], cpu[3], cpu[4]]
    gpu = [q.cuda(), k.cuda()] + gpu[2:]
    kw = dict(alpha=0.05, rule="exact_max", dense_fraction=1.0, candidate_alpha=0.0)
    ref = sp.build_index(*cpu, mq, mk, **kw)
    got = sp.build_index(*gpu, mq, mk, **kw).to_host()
    _agree(ref, got, 1, 8)
    assert ref.density < 1.0


@pytest.mark.parametrize("spike_key,far_kept", [(700, True), (768, False)])
def test_exact_max_scores_the_diagonal_block_not_the_window_band_on_gpu(spike_key, far_kept):
    """test_selection.py's constructed case on the kernel (exact_max_spec.md step 2): a spike of logit 10 in the window
    band's whole block 5 is not scored, so tile 6 keeps block 2 (logit 5); in the diagonal block 6 it is, and block 2
    (-5 < ln 0.05) is dropped. bf16 holds every value exactly; the GPU's index equals the CPU reference's."""
    q, k, cu, L = band_case(spike_key)
    q, k, cu = torch.from_numpy(q).to(torch.bfloat16), torch.from_numpy(k).to(torch.bfloat16), torch.from_numpy(cu)
    ref = sp.build_index(q, k, k.clone(), cu, cu, L, L, **BAND_CASE_SELECTION)
    got = sp.build_index(q.cuda(), k.cuda(), k.cuda(), cu.cuda(), cu.cuda(), L, L, **BAND_CASE_SELECTION).to_host()
    blocks = set(got.segment(0, 0, 6).tolist())
    assert blocks == set(ref.segment(0, 0, 6).tolist())
    assert {0, 4, 5, 6} <= blocks and (2 in blocks) == far_kept and 1 not in blocks


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
    assert host.density < 0.9  # prunes (0.75-0.84 on these inputs since the window band is not scored)
    got = sp.sparse_attention(*gpu[:3], index, *gpu[3:], mq, mk)
    want = sp.sparse_attention(*cpu[:3], host, *cpu[3:], mq, mk, reuse_index=True)
    torch.cuda.synchronize()
    _assert_bf16_close(got, want)
    out = sp.sparse_prefill(*gpu, mq, mk, **kw)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    _assert_bf16_close(out, want)


def test_exact_max_is_supported_on_gpu_and_long_prompts_are_refused_clearly():
    """sparse_support reports no reason for exact_max on CUDA arrays; a max_seqlen_k past the per-key scorer's 65535
    units of 64 keys is refused before any launch, naming max_seqlen_k."""
    rng = np.random.default_rng()
    q, k, v, cu_q, cu_k = make_varlen(rng, [300], [300], hq=8, hkv=2, d=128)
    gpu = [_to(a, "cuda", torch.bfloat16) for a in (q, k, v)] + [_to(cu_q, "cuda"), _to(cu_k, "cuda")]
    assert sp.sparse_support(*gpu, 300, 300, rule="exact_max") is None
    with pytest.raises(NotImplementedError, match="max_seqlen_k"):
        sp.build_index(*gpu, 300, 65536 * 64 + 1, rule="exact_max")

"""Exact torch emulation (CPU) of SparsePrefill's block-sparse prefill selection, plus candidate rules.

Everything follows docs/semantics.md (the FlashPrefill V2 selection) and src/reference/selection.cpp:
PackGQA tiles of 128 packed rows per (virtual) KV head (row r <-> position r // g, head kvh * g + r % g), key blocks
of `block` tokens, pooled means, bottom-right causal with Lq == Lk (one sequence, one-shot prefill).

A rule is a dict (see RULE_DEFAULTS: the library's default selection, sp.SELECTION_DEFAULTS):
  score    'mean'  s_rJ = scale * q_r . kmean_J                                   (the library)
           'quest' s_rJ = scale * (q_r+ . kmax_J + q_r- . kmin_J)  (upper bound of q_r . k over the block, Quest)
           'exact' w_rJ = log of row r's true softmax mass in block J (dense logits; the oracle)
           'probe' 'exact' for probe positions only (position % probe == probe - 1 and the last one, all heads);
                   other rows select nothing beyond the always-kept blocks (cost: 1/probe of the dense QK^T). With
                   probe 8, agg rowmax and union_mean 0.5 this is the library's rule='probe_row_max' (CPU reference)
           'antidiag' XAttention: groups of xs positions, A_ij = sum_t q_{xs i + xs-1-t} . k_{xs j + t} * scale / xs,
                   softmax over key groups, block mass = sum of its groups; every row of a group shares it
                   (cost: 1/xs of the dense QK^T)
           Per-key block maxima (issue 44): s_rJ = max over the keys j of J that row r sees of scale * q_r . k~_j
           'kmax'    k~ = k: exact block maxima (the cost of the dense QK^T); qk 'e4m3': q and k rounded to float8
                     e4m3 first as the library's exact_max rounds them (exact_max_spec.md step 3: a scale per row
                     of q and per unit of 64 keys, each group's largest magnitude to 448; e4m3_scaled), the
                     products in float64 times the two scales
           'lowrank' k~ = P P^T k, P [D, rank] the top `rank` eigenvectors of the KV head's key second moment K^T K
                     over the prompt (Loki): a rank-`rank` GEMM per pair
           'resid'   k~_j = kmean_J + P P^T (k_j - kmean_J), P from the residuals' second moment: the pooled mean at
                     full rank plus the key's own deviation at rank `rank` (a block of alike keys scores as its mean,
                     a spike as itself). basis 'lib' (the default): the library's basis (key_basis: the sampled
                     blocks' residuals, kKeyBasisIters subspace iterations from the hash_unit start, float64) and
                     the score s_rJ = scale (q_r . kmean_J + max_j (P^T q_r) . (P^T x_j)) in float64 with the library's
                     float32 means (key_max_scores); with rank 16 or 32, onepass 2, sinkref 1 and agg rowmax this is the
                     library's rule='key_max' (docs/design/key_max_spec.md; test_accuracy_emulator.py). basis 'eigh':
                     the top eigenvectors of the residuals of ALL keys (torch.linalg.eigh), scores in float32.
                     perp c (basis 'lib'; 0 = the library's rule): each key's term plus c |q_perp| |x_perp_j|, what the
                     basis leaves out of q and x_j (perp = I - P P^T; c = 1 bounds the exact maximum from above): one
                     more column of the residual GEMM (issue 44: rank 16 selecting like rank 32 offline).
                     basis 'query': the same score on a basis from the group's queries (query_basis: their second
                     moment at the sampled positions, the same iteration): what the queries look along
           rstride n scores only positions p % n == n - 1 (and the last), all heads; other rows add nothing beyond
           the always-kept blocks (the tile's union covers them)
  agg      'sum'   tile energy (FlashPrefill V2): M = max over the tile, E_J = sum_r exp(s_rJ - M), keep E_J >= alpha * max_J E_J
           'rowmax' per-row normalised: keep J iff max_r exp(s_rJ - m_r) >= alpha, m_r = max_J s_rJ
                   (i.e. some row of the tile has s_rJ >= m_r + ln alpha)
                   onepass 1: m_r is the running maximum of a single pass that visits the blocks from the diagonal
                   down to block 0 (m_rJ = max_{J' >= J} s_rJ'): a superset of the two-pass rule's blocks, the
                   price of scoring each pair once; onepass 2: the same pass started from the pooled means' bound
                   max_J scale q_r . kmean_J over the blocks the row sees whole (a block's maximum is >= its mean)
                   sinkref 1 (with onepass): the pass also starts from the row's exact maximum over the keys of the
                   always-kept sink blocks (full-D q . k, on the e4m3 operands with qk 'e4m3'; on SmolLM2 the
                   row's top block for most rows on exact scores, which a pass from the diagonal reaches last)
           'rowmass' per-row estimated softmax mass pi_rJ = |B_J| exp(s_rJ) / sum_J' |B_J'| exp(s_rJ'),
                   keep J iff max_r pi_rJ >= alpha
           'share1p' (score 'kmax'): per row a block's bound mass (from its exact maximum and mean logit over the
                   keys the row sees) >= alpha of the row's running total, decided in one pass as a kernel would
                   (the total from the pooled means, each block's bound swapped in before its test; estimators.py's
                   lbk1p); union over the tile's rows
           'rowcum' FlexPrefill: per row, always-kept blocks first, then blocks by decreasing pi_rJ, the fewest
                   whose cumulative pi reaches gamma; union over the tile's rows. With a block-maximum score pi is
                   softmax over the blocks' maxima (cummass 'max', estimators.py's maxcum), or (cummass 'lb') over
                   the lower bound of each block's log mass from its maximum m and its pooled mean logit u,
                   log(exp(m) + (n - 1) exp((n u - m) / (n - 1))) (estimators.py's lbcum: a spike counts as itself,
                   a block of alike keys as n times its mean)
  cand_mean a (None = off; 0: every visible block a candidate, as candidate_alpha 0): two stages (issue 44's "exact
           block maxima restricted to the candidate blocks a generous pooled-means pass proposes"): the candidates
           are the blocks the library's row-max rule over pooled means keeps at alpha a (per row, union over the
           tile: today's default at a = 0.003); the rule above then keeps only candidates (agg 'share1p': its one
           pass scores only them and the sink blocks; exact_max_spec.md "A share test"), and agg 'rowmax' takes
           each row's reference m_r over the candidates and the always-kept blocks (two-pass); with onepass the
           running maximum visits only the blocks exact_max scores (from the diagonal down, then the pooled bound /
           sinkref as above): the candidates that are not always kept, plus the blocks not fully visible to the
           tile (the diagonal's; exact_max_spec.md step 2): one GEMM per scored block and no stored scores. The
           always-kept blocks stay kept.
  subgroups S (head_subgroups; 0 = one per query head), sink, window, last_n, block, correction, dense_layers (first n
  layers dense), dense_fraction (the library's dense rule: a selection keeping at least this fraction of the visible
  blocks keeps them all; 1 = off).
Selection arithmetic runs in float64 (the CPU reference uses double), attention in float32.
"""
import math

import torch

TILE_ROWS = 128
RULE_DEFAULTS = dict(score="mean", agg="rowmax", alpha=0.003, gamma=0.9, subgroups=0, sink=256, window=512, last_n=2,
                     block=128, correction=False, dense_layers=0, probe=8, xs=8, union_mean=0.0, dense_fraction=0.85,
                     rank=16, rstride=1, onepass=0, basis="lib", perp=0.0, sinkref=0, cand_mean=None, qk="f32",
                     cummass="max")
BLOCK_MAX_SCORES = ("kmax", "lowrank", "resid")


def full_rule(rule):
    r = dict(RULE_DEFAULTS)
    r.update(rule or {})
    return r


def pooled(k, v, block):
    """k, v [L, H, D] -> kmean, vmean, kmax, kmin [nb, H, D] float64, counts [nb]."""
    L, H, D = k.shape
    nb = (L + block - 1) // block
    pad = nb * block - L
    kd, vd = k.double(), v.double()
    counts = torch.clamp(L - torch.arange(nb, device=k.device) * block, max=block).double()
    kp = torch.cat([kd, kd.new_zeros(pad, H, D)]).view(nb, block, H, D)
    vp = torch.cat([vd, vd.new_zeros(pad, H, D)]).view(nb, block, H, D)
    kmean = kp.sum(1) / counts[:, None, None]
    vmean = vp.sum(1) / counts[:, None, None]
    kmax = torch.cat([kd, kd.new_full((pad, H, D), -math.inf)]).view(nb, block, H, D).amax(1)
    kmin = torch.cat([kd, kd.new_full((pad, H, D), math.inf)]).view(nb, block, H, D).amin(1)
    return kmean, vmean, kmax, kmin, counts


def exact_log_mass(q, k, scale, block, rows=None):
    """log of each row's true softmax mass per key block: q [L, Hq, D], k [L, Hkv, D] -> [L, Hq, nb] float64
    (rows: positions to compute, others -inf). One sequence, causal, Lq == Lk."""
    L, Hq, D = q.shape
    g = Hq // k.shape[1]
    nb = (L + block - 1) // block
    P = nb * block
    pos = torch.arange(L, device=q.device) if rows is None else rows
    out = torch.full((L, Hq, nb), -math.inf, dtype=torch.float64, device=q.device)
    kf = torch.cat([k.double(), k.new_zeros(P - L, k.shape[1], D).double()])  # double: the CPU reference's precision
    keyi = torch.arange(P, device=q.device)
    for h in range(Hq):
        lg = (q[pos, h].double() @ kf[:, h // g].T) * scale
        lg.masked_fill_(keyi[None, :] > pos[:, None], -math.inf)
        lb = lg.view(len(pos), nb, block).logsumexp(-1)
        out[pos, h] = lb - lb.logsumexp(-1, keepdim=True)
    return out


def antidiag_log_mass(q, k, scale, block, xs):
    """XAttention's strided antidiagonal estimate, as log block mass per position: -> [L, Hq, nb] float64."""
    L, Hq, D = q.shape
    g = Hq // k.shape[1]
    nb = (L + block - 1) // block
    assert block % xs == 0
    P = nb * block
    G = P // xs
    qp = torch.cat([q.float(), q.new_zeros(P - L, Hq, D).float()])
    kp = torch.cat([k.float(), k.new_zeros(P - L, k.shape[1], D).float()])
    qr = torch.cat([qp[xs - 1 - t::xs] for t in range(xs)], -1)  # [G, Hq, xs D]
    kr = torch.cat([kp[t::xs] for t in range(xs)], -1)  # [G, Hkv, xs D]
    gi = torch.arange(G, device=q.device)
    out = torch.empty(G, Hq, nb, dtype=torch.float64, device=q.device)
    for h in range(Hq):
        a = (qr[:, h] @ kr[:, h // g].T) * (scale / xs)
        a.masked_fill_(gi[None, :] > gi[:, None], -math.inf)
        lb = a.view(G, nb, block // xs).logsumexp(-1).double()
        out[:, h] = lb - lb.logsumexp(-1, keepdim=True)
    return out.repeat_interleave(xs, 0)[:L]


# The library's key basis (src/core/key_basis.h: the same constants and start; docs/design/key_max_spec.md step 2)
KEY_BASIS_ITERS = 10
KEY_BASIS_SAMPLE_BLOCKS = 64
QUERY_BASIS_SAMPLE_BLOCKS = 16  # the blocks of query positions the queries' basis reads (see query_basis)


def hash_unit(d, c):
    """core/key_basis.h's hash_unit(d, c) in uint32 arithmetic: X0[d][c] of the basis iteration, in [-1, 1)."""
    m = 0xFFFFFFFF
    h = ((d * 2654435761) & m) ^ ((c * 2246822519) & m)
    h ^= h >> 15
    h = (h * 2246822519) & m
    h ^= h >> 13
    return float((h >> 8) - (1 << 23)) / float(1 << 23)


def library_means(k, block):
    """The pooled key means as the library holds them (float32), as float64: [nb, H, D]."""
    return pooled(k, k, block)[0].float().double()


def subspace_basis(C, rank):
    """The library's subspace iteration: C [H, D, D] (a second moment per head, float64) -> X [H, D, rank] float64:
    KEY_BASIS_ITERS times Y = C X, X = MGS(Y) (modified Gram-Schmidt, a zero column stays zero) from X0[d][c] =
    hash_unit(d, c)."""
    H, D = C.shape[0], C.shape[1]
    X0 = torch.tensor([[hash_unit(d, c) for c in range(rank)] for d in range(D)], dtype=torch.float64,
                      device=C.device)
    X = X0[None].repeat(H, 1, 1)  # [H, D, r]
    for _ in range(KEY_BASIS_ITERS):
        Y = C @ X
        for c in range(rank):
            y = Y[:, :, c]
            for c2 in range(c):  # against the new columns, each projection off the updated y
                y = y - (X[:, :, c2] * y).sum(-1, keepdim=True) * X[:, :, c2]
            n = y.norm(dim=-1, keepdim=True)
            X[:, :, c] = torch.where(n > 0, y / torch.where(n > 0, n, torch.ones_like(n)), torch.zeros_like(y))
    return X


def sampled_rows(L, block, device, count=None):
    """The positions of the sampled blocks J = 0, s, 2s, ... (s = max(1, ceil(nb / count)), count
    KEY_BASIS_SAMPLE_BLOCKS unless given)."""
    nb = (L + block - 1) // block
    s = max(1, -(-nb // (count or KEY_BASIS_SAMPLE_BLOCKS)))
    return (torch.arange(L, device=device) // block) % s == 0


def key_basis(k, rank, block):
    """The library's key_max basis: k [L, H, D] (one sequence) -> P [H, D, rank] float64, per KV head. The residuals
    x_j = k_j - kmean_J (float32 means) of every key of the sampled blocks (sampled_rows), C = sum_j x_j x_j^T, then
    subspace_basis(C); all in float64."""
    L = k.shape[0]
    x = k.double() - library_means(k, block).repeat_interleave(block, 0)[:L]
    xs = x[sampled_rows(L, block, k.device)]  # the sampled blocks' keys
    return subspace_basis(torch.einsum("nhd,nhe->hde", xs, xs), rank)


def query_basis(q, num_kv_heads, rank, block):
    """key_max's basis on the queries (basis 'query'): q [L, Hq, D] -> P [Hkv, D, rank] float64, per KV head: the
    second moment of the group's queries at the sampled positions (sampled_rows), C = sum q q^T over the group's
    heads, then subspace_basis(C). The directions the queries look along: a rare key's residual (the recall key) is
    scored through them, where the keys' own principal directions miss it (issue 44)."""
    L, Hq, D = q.shape
    g = Hq // num_kv_heads
    qs = q.double()[sampled_rows(L, block, q.device, QUERY_BASIS_SAMPLE_BLOCKS)].reshape(-1, num_kv_heads, g, D)
    return subspace_basis(torch.einsum("nhgd,nhge->hde", qs, qs), rank)


def key_max_scores(q, k, scale, block, rank, rows=None, chunk=2048, perp=0.0, basis="lib"):
    """The library's key_max scores (basis 'lib'): s_rJ = scale * (q_r . kmean_J + max over the keys j of J that
    the row sees of (P^T q_r) . (P^T x_j)), x_j = k_j - kmean_J, float64 (the CPU reference's precision), float32
    means: q [L, Hq, D], k [L, Hkv, D] -> [L, Hq, nb] (-inf where the row sees no key of J or is not in `rows`).
    perp c adds c |q_perp| |x_perp_j| to each key's term (perp = I - P P^T; see the module doc). basis 'query': P
    from the queries (query_basis) instead of the keys' residuals."""
    L, Hq, D = q.shape
    g = Hq // k.shape[1]
    P = query_basis(q, k.shape[1], rank, block) if basis == "query" else key_basis(k, rank, block)  # [Hkv, D, r]
    kmean = library_means(k, block)
    x = k.double() - kmean.repeat_interleave(block, 0)[:L]
    xp = torch.einsum("lhd,hdr->lhr", x, P)
    Pq = P.repeat_interleave(g, 0)
    qp = torch.einsum("lqd,qdr->lqr", q.double(), Pq)
    if perp:  # one more column: c |q_perp| against |x_perp_j|
        x_perp = (x - torch.einsum("lhr,hdr->lhd", xp, P)).norm(dim=-1, keepdim=True)
        q_perp = (q.double() - torch.einsum("lqr,qdr->lqd", qp, Pq)).norm(dim=-1, keepdim=True)
        xp, qp = torch.cat([xp, x_perp], -1), torch.cat([qp, perp * q_perp], -1)
    resid = block_max(qp, xp, 1.0, block, rows, chunk, dtype=torch.float64)
    mean = torch.einsum("lqd,jqd->lqj", q.double(), kmean.repeat_interleave(g, 1))
    return scale * (mean + resid)


def log_mass_lower_bound(m, u, n):
    """log of exp(m) + (n - 1) exp((n u - m) / (n - 1)) <= log sum_j exp(s_j) for n logits s_j with maximum m >= u and
    mean u: the maximum's key plus the other n - 1 at their mean (Jensen); equal when the others are alike. n a number
    or a tensor broadcasting with m; one key (n 1): m; -inf where m is not finite (a block the row does not see)."""
    n = torch.as_tensor(n, dtype=torch.float64, device=m.device)
    lb = torch.logaddexp(m, torch.log((n - 1).clamp(min=1e-300)) + (n * u - m) / (n - 1).clamp(min=1))
    return torch.where(n > 1, lb, m).masked_fill(~torch.isfinite(m), -math.inf)


def share_one_pass(w, pm, sink, alpha, out=None):
    """[..., nb] the blocks whose bound log mass w is >= alpha of the row's running total, decided in one pass in
    exact_max's order (the blocks where `sink` [nb], then from the diagonal down): the total starts at the pooled
    estimates' exp(pm) over the row's blocks, and each block swaps its term (exp(out), default exp(pm)) for exp(w)
    before its own test (a running total below the final one). w, pm, out: -inf where the row does not see the
    block."""
    out = pm if out is None else out
    nb = w.shape[-1]
    sh = torch.maximum(w.amax(-1, keepdim=True), pm.amax(-1, keepdim=True))
    sh = torch.where(torch.isfinite(sh), sh, torch.zeros_like(sh))
    ew, ep = torch.exp(w - sh), torch.exp(pm - sh)
    blocks = torch.arange(nb, device=w.device)
    order = torch.cat([blocks[sink], blocks.flip(0)[~sink.flip(0)]])
    z = ep.sum(-1, keepdim=True) + torch.cumsum((ew - torch.exp(out - sh))[..., order], -1)  # after each swap
    keep = torch.zeros_like(ew, dtype=torch.bool)
    keep[..., order] = (ew[..., order] >= alpha * z) & (ew[..., order] > 0)
    return keep


def e4m3_scaled(x, rows):
    """x [L, H, D] in groups of `rows` consecutive positions per head (q: 1, each row; k: 64, the exact stage's
    units), each group scaled so that its largest magnitude is 448 and rounded to float8 e4m3, as the library's
    exact_max does (float32: inv = 448 / amax, 0 where amax is 0; a NaN is not a magnitude; nearest even) ->
    (the e4m3 values [L, H, D] float32, each position's group scale amax / 448 [L, H] float32)."""
    L, H, D = x.shape
    n = -(-L // rows) * rows
    xf = torch.cat([x.float(), x.new_zeros(n - L, H, D, dtype=torch.float32)])
    mag = xf.abs().nan_to_num(nan=0.0).view(n // rows, rows, H, D)
    amax = mag.amax(dim=(1, 3), keepdim=True)  # [groups, 1, H, 1]
    inv = torch.where(amax > 0, torch.tensor(448.0) / amax, torch.zeros_like(amax))
    vals = (xf.view(n // rows, rows, H, D) * inv).to(torch.float8_e4m3fn).float()
    scale = (amax / 448.0).expand(-1, rows, -1, -1)
    return vals.reshape(n, H, D)[:L], scale.reshape(n, H)[:L]


def e4m3_operands(q, k):
    """The library's exact_max operands (exact_max_spec.md step 3): q per row and k per 64-key unit through
    e4m3_scaled, as the float64 values they stand for (sigma q8, kappa k8: exact products of e4m3 and float32)."""
    q8, sq = e4m3_scaled(q, 1)
    k8, sk = e4m3_scaled(k, 64)
    return q8.double() * sq.double()[..., None], k8.double() * sk.double()[..., None]


def projected_keys(k, score, rank, block, basis="lib"):
    """The keys a block-max score compares against (see the module doc): k [L, H, D] -> k~ [L, H, D] float32.
    basis (score 'resid'): 'eigh' (the residuals of all keys) or 'lib' (key_basis); 'lowrank' is always eigh."""
    if score == "kmax":
        return k.float()
    L, H, D = k.shape
    kd = k.double()
    if score == "resid" and basis == "lib":
        kmean = library_means(k, block).repeat_interleave(block, 0)[:L]
        P = key_basis(k, rank, block)
    else:
        kmean = pooled(k, k, block)[0].repeat_interleave(block, 0)[:L] if score == "resid" else torch.zeros_like(kd)
        x = kd - kmean
        _, vecs = torch.linalg.eigh(torch.einsum("lhd,lhe->hde", x, x))  # ascending eigenvalues, per head
        P = vecs[..., -min(rank, D):]                                      # [H, D, r]
    x = kd - kmean
    return (kmean + torch.einsum("lhr,hdr->lhd", torch.einsum("lhd,hdr->lhr", x, P), P)).float()


def block_max(q, kt, scale, block, rows=None, chunk=2048, dtype=torch.float32, mean=None):
    """max over the keys of each block that the row sees of scale * q . kt: q [L, Hq, E], kt [L, Hkv, E] ->
    [L, Hq, nb] float64 (-inf where the row sees no key of the block or is not in `rows`). One causal sequence;
    the products in `dtype`. mean: a tensor like the result that receives the mean over the same keys (0 where none)."""
    L, Hq, E = q.shape
    g = Hq // kt.shape[1]
    nb = (L + block - 1) // block
    P = nb * block
    kp = torch.cat([kt.to(dtype), kt.new_zeros(P - L, kt.shape[1], E).to(dtype)])
    pos = torch.arange(L, device=q.device) if rows is None else rows
    keyi = torch.arange(P, device=q.device)
    out = torch.full((L, Hq, nb), -math.inf, dtype=torch.float64, device=q.device)
    for h in range(Hq):
        for c in range(0, len(pos), chunk):
            pr = pos[c:c + chunk]
            lg = (q[pr, h].to(dtype) @ kp[:, h // g].T) * scale
            lg.masked_fill_(keyi[None, :] > pr[:, None], -math.inf)
            out[pr, h] = lg.view(len(pr), nb, block).amax(-1).double()
            if mean is not None:
                seen = (keyi[None, :] <= pr[:, None]).view(len(pr), nb, block)
                tot = torch.where(seen, lg.view(len(pr), nb, block), torch.zeros((), dtype=lg.dtype)).double().sum(-1)
                mean[pr, h] = tot / seen.sum(-1).clamp(min=1).double()
    return out


class Selection:
    """keep [V, T, nb] bool per virtual head and tile; corr [V, T, nb] blocks standing in as virtual keys."""

    def __init__(self, keep, corr, visible, gs, L, nb, kmean, vmean, counts):
        self.keep, self.corr, self.visible, self.gs, self.L, self.nb = keep, corr, visible, gs, L, nb
        self.kmean, self.vmean, self.counts = kmean, vmean, counts
        self.kept_blocks = int((keep & visible).sum())
        self.visible_blocks = int(visible.sum()) * keep.shape[0]

    @property
    def density(self):
        return self.kept_blocks / self.visible_blocks if self.visible_blocks else 1.0

    def per_row(self, m):
        """[V, T, nb] -> [Hq, L, nb]: the tile entry of each (query head, position)."""
        V, T, nb = m.shape
        rows = m.repeat_interleave(TILE_ROWS, dim=1)[:, :self.L * self.gs]  # [V, R, nb]
        return rows.reshape(V, self.L, self.gs, nb).permute(0, 2, 1, 3).reshape(V * self.gs, self.L, nb)


def select(q, k, v, rule, scale):
    """q [L, Hq, D], k, v [L, Hkv, D] (one sequence, Lq == Lk, causal) -> Selection."""
    r = full_rule(rule)
    if r["cummass"] not in ("max", "lb"):
        raise ValueError(f"cummass: 'max' or 'lb', got {r['cummass']!r}")
    if r["qk"] not in ("f32", "e4m3") or (r["qk"] == "e4m3" and r["score"] != "kmax"):
        raise ValueError(f"qk: 'f32', or 'e4m3' with score 'kmax' (the exact maxima's operands), got {r['qk']!r}")
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    S = r["subgroups"] or g  # 0: one selection per query head (the library's head_subgroups 0)
    assert g % S == 0
    gs, V, B = g // S, Hkv * S, r["block"]
    nb = (L + B - 1) // B
    kmean, vmean, kmax, kmin, counts = pooled(k, v, B)
    R = L * gs
    T = (R + TILE_ROWS - 1) // TILE_ROWS
    Rp = T * TILE_ROWS
    qv = q.double().reshape(L, V, gs, D).permute(1, 0, 2, 3).reshape(V, R, D)
    qv = torch.cat([qv, qv.new_zeros(V, Rp - R, D)], 1)
    dev = q.device
    kvh = torch.arange(V, device=dev) // S
    memo = {}

    def pooled_logits():  # [V, Rp, nb] scale * q_r . kmean_J (the pooled mean logit), computed once
        if "pl" not in memo:
            memo["pl"] = torch.einsum("vrd,jvd->vrj", qv, kmean[:, kvh]) * scale
        return memo["pl"]
    mass = r["score"] in ("exact", "probe", "antidiag")  # s is already a log block mass per row
    if mass:
        if r["score"] == "antidiag":
            lm = antidiag_log_mass(q, k, scale, B, r["xs"])
        else:
            pr = None
            if r["score"] == "probe":
                P_ = r["probe"]
                pr = torch.arange(P_ - 1, L, P_, device=q.device)
                pr = torch.unique(torch.cat([pr, torch.tensor([L - 1], device=q.device)]))
            lm = exact_log_mass(q, k, scale, B, pr)
        s = lm.reshape(L, V, gs, nb).permute(1, 0, 2, 3).reshape(V, R, nb)
        s = torch.cat([s, s.new_full((V, Rp - R, nb), -math.inf)], 1)
    elif r["score"] in BLOCK_MAX_SCORES:
        n = r["rstride"]
        pr = None
        if n > 1:
            pr = torch.unique(torch.cat([torch.arange(n - 1, L, n, device=dev), torch.tensor([L - 1], device=dev)]))
        if r["score"] == "resid" and r["basis"] in ("lib", "query"):
            bm = key_max_scores(q, k, scale, B, r["rank"], pr, perp=r["perp"], basis=r["basis"])
        else:
            bmean = torch.zeros(L, Hq, nb, dtype=torch.float64, device=dev) if r["agg"] == "share1p" else None
            if r["qk"] == "e4m3":
                bm = block_max(*e4m3_operands(q, k), scale, B, pr, dtype=torch.float64, mean=bmean)
            else:
                bm = block_max(q, projected_keys(k, r["score"], r["rank"], B, r["basis"]), scale, B, pr, mean=bmean)
        s = bm.reshape(L, V, gs, nb).permute(1, 0, 2, 3).reshape(V, R, nb)
        s = torch.cat([s, s.new_full((V, Rp - R, nb), -math.inf)], 1)
    elif r["score"] == "mean":
        s = pooled_logits()
    elif r["score"] == "quest":
        s = (torch.einsum("vrd,jvd->vrj", qv.clamp(min=0), kmax[:, kvh]) +
             torch.einsum("vrd,jvd->vrj", qv.clamp(max=0), kmin[:, kvh])) * scale
    else:
        raise ValueError(r["score"])
    rows = torch.arange(Rp, device=dev)
    pos = rows // gs
    valid = rows < R
    first_key = torch.arange(nb, device=dev) * B
    see = (first_key[None, :] <= pos[:, None]) & valid[:, None]  # [Rp, nb]
    s = s.masked_fill(~see[None], -math.inf)
    st = s.view(V, T, TILE_ROWS, nb)
    seet = see.view(T, TILE_ROWS, nb)
    visible = seet.any(1)  # [T, nb]
    agg, alpha = r["agg"], r["alpha"]
    # always kept
    t_idx = torch.arange(T, device=dev)
    first_pos = (t_idx * TILE_ROWS) // gs
    last_pos = (torch.clamp((t_idx + 1) * TILE_ROWS, max=R) - 1) // gs
    last_key = first_key + counts.long() - 1
    fully = last_key[None, :] <= first_pos[:, None]  # [T, nb]
    always = torch.zeros(T, nb, dtype=torch.bool, device=dev)
    always |= (first_key < r["sink"])[None, :]
    if r["window"] > 0:
        lo = torch.clamp(first_pos - r["window"] + 1, min=0)
        always |= (last_key[None, :] >= lo[:, None]) & (first_key[None, :] <= last_pos[:, None])
    always |= ~fully
    always |= (t_idx >= T - r["last_n"])[:, None]
    always = always & visible

    def pooled_row_max_keep(a):  # the library's row-max rule over pooled means at alpha a: [V, T, nb]
        sm = pooled_logits()
        sm = sm.masked_fill(~see[None], -math.inf).view(V, T, TILE_ROWS, nb)
        mm = sm.amax(-1, keepdim=True)
        mm = torch.where(torch.isfinite(mm), mm, torch.zeros_like(mm))
        return (torch.exp(sm - mm) >= a).any(2)

    # cand_mean: [V, T, nb] the pooled-means stage's candidates with the always-kept blocks (cand: the blocks a rule
    # may keep, and the two-pass reference's m_r), and the blocks the one pass scores: the candidates less the
    # always-kept blocks, plus the blocks not fully visible to the tile (exact_max_spec.md step 2)
    cand = scored = None
    if r["cand_mean"] is not None:
        if agg not in ("rowmax", "share1p"):
            raise ValueError("cand_mean restricts the row-max rule or the one-pass share: it needs agg 'rowmax' or "
                             "'share1p'")
        proposed = pooled_row_max_keep(r["cand_mean"]) & visible[None]
        cand = proposed | always[None]
        scored = (proposed & ~always[None]) | (~fully & visible)[None]
    if agg == "sum":
        M = st.amax(dim=(2, 3), keepdim=True)
        E = torch.exp(st - M).sum(2)  # [V, T, nb]; -inf entries give 0
        sel = E >= alpha * E.amax(-1, keepdim=True)
    elif agg in ("rowmax", "rowmass", "rowcum"):
        if agg == "rowcum" and r["cummass"] == "lb":
            if r["score"] not in BLOCK_MAX_SCORES:
                raise ValueError("cummass 'lb' bounds a block's mass from its maximum: it needs a block-max score")
            u = pooled_logits()
            w = log_mass_lower_bound(st, u.view(V, T, TILE_ROWS, nb), counts)
        elif agg == "rowmax" or mass or r["score"] in BLOCK_MAX_SCORES:
            w = st
        else:
            w = st + torch.log(counts)[None, None, None, :]
        if agg == "rowmax" and r["onepass"]:
            wc = w if scored is None else w.masked_fill(~scored[:, :, None, :], -math.inf)  # the blocks it scores
            m = wc.flip(-1).cummax(-1).values.flip(-1)  # running max of a pass from the diagonal down to block 0
            if r["onepass"] == 2:  # started from the pooled means' bound over the blocks the row sees whole
                # (the library's float32 means, as its key_max rule)
                sm = torch.einsum("vrd,jvd->vrj", qv, kmean.float().double()[:, kvh]) * scale
                whole = (first_key + counts.long() - 1)[None, :] <= pos[:, None]
                sm = sm.masked_fill(~whole[None], -math.inf).view(V, T, TILE_ROWS, nb)
                m = torch.maximum(m, sm.amax(-1, keepdim=True))
            nsk = min(L, -(-r["sink"] // B) * B)
            if r["sinkref"] and nsk > 0:  # the maximum over the sink blocks' keys the row sees (qk 'e4m3': on the
                # library's e4m3 operands, as exact_max_spec.md step 4; else exactly)
                qs, ks = (qv, k.double()) if r["qk"] != "e4m3" else e4m3_operands(q, k)
                if r["qk"] == "e4m3":  # packed as qv
                    qs = qs.reshape(L, V, gs, D).permute(1, 0, 2, 3).reshape(V, R, D)
                    qs = torch.cat([qs, qs.new_zeros(V, Rp - R, D)], 1)
                ex = torch.einsum("vrd,jvd->vrj", qs, ks[:nsk][:, kvh]) * scale
                ex = ex.masked_fill(torch.arange(nsk, device=dev)[None, None, :] > pos[None, :, None], -math.inf)
                m = torch.maximum(m, ex.amax(-1).view(V, T, TILE_ROWS, 1))
        else:
            if r["sinkref"]:
                raise ValueError("sinkref starts the one pass: it needs agg 'rowmax' and onepass 1 or 2")
            m = (w if cand is None else w.masked_fill(~cand[:, :, None, :], -math.inf)).amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(w - m)
        if agg == "rowmax":
            sel = (p >= alpha).any(2)
        else:
            p = p / p.sum(-1, keepdim=True).clamp(min=1e-300)
            if agg == "rowmass":
                sel = (p >= alpha).any(2)
            else:
                al = always[None, :, None, :].expand_as(p)
                key = torch.where(al, torch.full_like(p, 2.0), p)  # always-kept blocks first
                order = key.argsort(-1, descending=True)
                ps = torch.gather(p, -1, order)
                cum = ps.cumsum(-1)
                # keep a block while the mass before it is below gamma
                before = cum - ps
                take = (before < r["gamma"]) & (ps > 0)
                keep_rows = torch.zeros_like(take)
                keep_rows.scatter_(-1, order, take)
                sel = keep_rows.any(2)
    elif agg == "share1p":
        # a per-row share of each block's bound mass, decided in one pass as exact_max's stage 2 would
        # (estimators.py's lbk1p): the bound from the block's maximum m and mean logit u over the n keys the row
        # sees, log(exp(m) + (n - 1) exp((n u - m) / (n - 1))); the row's total starts at the pooled means' (|B| exp
        # of the pooled mean logit, every visible block) and each block, the sink blocks first and then from the
        # diagonal down, swaps that estimate for its bound before its own test: keep iff bound >= alpha x total
        if r["score"] != "kmax" or r["rstride"] != 1:
            raise ValueError("agg 'share1p' needs score 'kmax' and rstride 1 (the exact logits' maxima and means)")
        u = bmean.reshape(L, V, gs, nb).permute(1, 0, 2, 3).reshape(V, R, nb)
        u = torch.cat([u, u.new_zeros(V, Rp - R, nb)], 1).view(V, T, TILE_ROWS, nb)
        n = torch.minimum((pos[:, None] - first_key[None, :] + 1).clamp(min=0), counts.long()[None, :])
        w = log_mass_lower_bound(st, u, n.view(T, TILE_ROWS, nb)[None])
        pmean = pooled_logits() + torch.log(counts)[None, None, :]
        pmean = pmean.masked_fill(~see[None], -math.inf).view(V, T, TILE_ROWS, nb)
        sink = first_key < r["sink"]
        if scored is None:
            sel = share_one_pass(w, pmean, sink, alpha).any(2)
        else:
            # exact_share (exact_max_spec.md, "A share test"): only the candidates and the sink blocks are scored;
            # the total starts over the blocks the row sees whole (a partial block enters with its bound); a scored
            # whole block swaps |B| exp(its exact mean logit) for its bound; a block not scored keeps its pooled term
            # (w = out = its pooled estimate: a swap of nothing), and `cand` below drops it unless always kept
            nt = n.view(T, TILE_ROWS, nb)[None]
            whole = nt == counts.long()[None, None, None, :]
            pm = pmean.masked_fill(~whole, -math.inf)
            swapped = (scored | sink[None, None, :])[:, :, None, :]
            out = torch.where(whole, torch.log(nt.clamp(min=1).double()) + u, torch.full_like(u, -math.inf))
            sel = share_one_pass(torch.where(swapped, w, pm), pm, sink, alpha, torch.where(swapped, out, pm)).any(2)
    else:
        raise ValueError(agg)
    if r["union_mean"] > 0:  # plus the library's row-max rule over pooled means at this alpha
        sel = sel | pooled_row_max_keep(r["union_mean"])
    if cand is not None:
        sel = sel & cand
    keep = (sel & visible[None]) | always[None]
    # the dense rule (SelectionParams::dense_fraction): kept >= fraction * visible (the fraction a float32, the
    # product in double, as in sparse.h's keeps_all) keeps every visible block
    frac = float(torch.tensor(r["dense_fraction"], dtype=torch.float32))
    kept, vis = int((keep & visible[None]).sum()), int(visible.sum()) * V
    if frac < 1 and vis > 0 and kept >= frac * vis:
        keep = visible[None].expand_as(keep).clone()
    corr = (fully[None] & ~keep) if r["correction"] else torch.zeros_like(keep)
    return Selection(keep, corr, visible, gs, L, nb, kmean, vmean, counts)


def sparse_attention(q, k, v, selection, scale, block):
    """Exact softmax over the kept blocks (+ mean correction). q [L, Hq, D] -> out [L, Hq, D] float32."""
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    nb = selection.nb
    P = nb * block
    keep = selection.per_row(selection.keep)  # [Hq, L, nb]
    corr = selection.per_row(selection.corr)
    causal = torch.ones(L, P, dtype=torch.bool, device=q.device).tril_()  # key j <= query i (Lq == Lk)
    qf, kf, vf = q.float(), k.float(), v.float()
    kpad = torch.cat([kf, kf.new_zeros(P - L, Hkv, D)])
    vpad = torch.cat([vf, vf.new_zeros(P - L, Hkv, D)])
    km, vm = selection.kmean.float(), selection.vmean.float()
    logc = torch.log(selection.counts).float()
    out = torch.empty(L, Hq, D, device=q.device)
    neg = torch.tensor(-math.inf, device=q.device)
    for h in range(Hq):
        # selection heads are laid out h = v * gs + j and read K/V head h // g
        kh = h // g
        logits = qf[:, h] @ kpad[:, kh].T
        logits.mul_(scale)
        bias = torch.where(keep[h], 0.0, neg)  # [L, nb]
        logits.view(L, nb, block).add_(bias[:, :, None])
        logits.masked_fill_(~causal, -math.inf)
        if bool(corr[h].any()):
            vl = (qf[:, h] @ km[:, kh].T) * scale + logc[None]
            vl = vl.masked_fill(~corr[h], -math.inf)
            logits = torch.cat([logits, vl], 1)
            pr = torch.softmax(logits, -1)
            out[:, h] = pr[:, :P] @ vpad[:, kh] + pr[:, P:] @ vm[:, kh]
        else:
            pr = torch.softmax(logits, -1)
            out[:, h] = pr @ vpad[:, kh]
    return out


def pruned_mass(q, k, v, selection, scale, block):
    """Diagnostics of the mean correction, per head averaged over rows of non-final tiles: the true softmax mass of
    the dropped keys (dense probabilities), and the mass the correction's virtual keys take in the corrected softmax;
    also the relative output error without / with correction against dense."""
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    nb = selection.nb
    P = nb * block
    keep = selection.per_row(selection.keep)
    corr = selection.per_row(selection.corr)
    causal = torch.ones(L, P, dtype=torch.bool, device=q.device).tril_()
    qf, kf, vf = q.float(), k.float(), v.float()
    kpad = torch.cat([kf, kf.new_zeros(P - L, Hkv, D)])
    vpad = torch.cat([vf, vf.new_zeros(P - L, Hkv, D)])
    km, vm = selection.kmean.float(), selection.vmean.float()
    logc = torch.log(selection.counts).float()
    res = []
    for h in range(Hq):
        kh = h // g
        lg = (qf[:, h] @ kpad[:, kh].T) * scale
        lg.masked_fill_(~causal, -math.inf)
        pd = torch.softmax(lg, -1)
        dense = pd @ vpad[:, kh]
        tokkeep = keep[h].repeat_interleave(block, 1)
        rows = corr[h].any(1)  # rows that drop something
        if not bool(rows.any()):
            continue
        true_drop = (pd * (~tokkeep)).sum(1)
        ls = lg.masked_fill(~tokkeep, -math.inf)
        ps = torch.softmax(ls, -1)
        o_nc = ps @ vpad[:, kh]
        vl = (qf[:, h] @ km[:, kh].T) * scale + logc[None]
        vl = vl.masked_fill(~corr[h], -math.inf)
        pc = torch.softmax(torch.cat([ls, vl], 1), -1)
        o_c = pc[:, :P] @ vpad[:, kh] + pc[:, P:] @ vm[:, kh]
        virt = pc[:, P:].sum(1)
        err = lambda o: float(((o - dense)[rows].norm() / dense[rows].norm()))
        res.append(dict(head=h, true_dropped=float(true_drop[rows].mean()), virtual_mass=float(virt[rows].mean()),
                        rel_err_nc=err(o_nc), rel_err_c=err(o_c)))
    return res


# ---------------------------------------------------------------------------------------------------------------------
# The exact oracle of issue 37, in chunks of query positions (GPU at 32K, CPU for tests)
# ---------------------------------------------------------------------------------------------------------------------
# Per row the fewest key blocks that hold a fraction `frac` of its true softmax mass (the tile's always-kept blocks
# first, then by decreasing mass: select()'s agg='rowcum' with score='exact'), the union over each PackGQA tile of
# 128 packed rows (subgroups S: one selection per g / S query heads; S = g is one per query head), always-kept blocks
# added, then exact softmax over the kept blocks (renormalised, no correction). Equal to
# select(score='exact', agg='rowcum', gamma=frac, subgroups=S) + sparse_attention() (test_accuracy_oracle.py), but
# the probabilities of one KV head's g query heads are formed for `chunk` query positions at a time (a multiple of
# 128, so every tile lies in one chunk for any g), and the same exp(logits) serve the selection and the attention:
# one QK^T per chunk, memory ~2 * g * chunk * L * itemsize.

def tile_geometry(t_idx, gs, L, nb, block, sink, window, last_n):
    """visible, always [len(t_idx), nb] bool for the tiles t_idx (as select(): blocks some row of the tile sees; sink,
    local band, blocks not fully visible to the tile's first row, the last `last_n` tiles)."""
    dev = t_idx.device
    R = L * gs
    T = (R + TILE_ROWS - 1) // TILE_ROWS
    first_key = torch.arange(nb, device=dev) * block
    last_key = torch.clamp(first_key + block, max=L) - 1
    first_pos = (t_idx * TILE_ROWS) // gs
    last_pos = (torch.clamp((t_idx + 1) * TILE_ROWS, max=R) - 1) // gs
    visible = first_key[None, :] <= last_pos[:, None]
    always = (first_key < sink)[None, :] | ~(last_key[None, :] <= first_pos[:, None])
    if window > 0:
        lo = torch.clamp(first_pos - window + 1, min=0)
        always = always | ((last_key[None, :] >= lo[:, None]) & (first_key[None, :] <= last_pos[:, None]))
    always = always | (t_idx >= T - last_n)[:, None]
    return visible, always & visible


def oracle_chunk_rows(L, g, mem_bytes, itemsize):
    """Query positions per chunk: a multiple of 128 whose [g, rows, L] probabilities (x2: the exp and the masked copy
    of one matmul's operands) fit mem_bytes."""
    per_pos = 2 * g * (L + 128) * itemsize
    return max(TILE_ROWS, (int(mem_bytes // per_pos) // TILE_ROWS) * TILE_ROWS)


def oracle_chunks(q, k, scale, frac, subgroups=None, block=128, sink=256, window=512, last_n=2, mem_bytes=2 << 30,
                  dtype=torch.float32, chunk=None):
    """Yields, per KV head h and chunk of positions [c0, c1): dict(h, c0, c1, e [g, n, K] = exp(logit - row max)
    (0 where masked; K = nbc * block, nbc the blocks the chunk sees), keep_rows [g, n, nbc] (each query head's row
    mask), keep [S, Tc, nbc] and visible [Tc, nbc] of the chunk's tiles t0 .. t0 + Tc). frac None keeps every
    visible block (dense, same arithmetic). q [L, Hq, D], k [L, Hkv, D]: one causal sequence."""
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    S = subgroups or g
    assert g % S == 0, f"subgroups {S} must divide the group size {g}"
    gs = g // S
    nb = (L + block - 1) // block
    isz = torch.tensor([], dtype=dtype).element_size()
    chunk = chunk or oracle_chunk_rows(L, g, mem_bytes, isz)
    assert chunk % TILE_ROWS == 0, "chunk must be a multiple of 128 positions (whole tiles for any g)"
    dev = q.device
    for h in range(Hkv):
        kh = torch.cat([k[:, h].to(dtype), k.new_zeros(nb * block - L, D).to(dtype)])
        for c0 in range(0, L, chunk):
            c1 = min(L, c0 + chunk)
            n, nbc = c1 - c0, (c1 + block - 1) // block
            K = nbc * block
            qc = q[c0:c1, h * g:(h + 1) * g].to(dtype).permute(1, 0, 2)  # [g, n, D]
            e = torch.matmul(qc, kh[:K].T).mul_(scale)  # [g, n, K]
            posi = torch.arange(c0, c1, device=dev)
            e.masked_fill_(torch.arange(K, device=dev)[None, None, :] > posi[None, :, None], -math.inf)
            e.sub_(e.amax(-1, keepdim=True)).exp_()  # key 0 is visible to every row: the max is finite
            t0, t1 = (c0 * gs) // TILE_ROWS, (c1 * gs + TILE_ROWS - 1) // TILE_ROWS
            vis, alw = tile_geometry(torch.arange(t0, t1, device=dev), gs, L, nbc, block, sink, window, last_n)
            if frac is None:
                keep = vis[None].expand(S, -1, -1)
            else:
                bm = e.view(g, n, nbc, block).sum(-1)
                p = bm / bm.sum(-1, keepdim=True)  # each row's true mass per block
                # packed rows of virtual head (h, s): row (pos - c0) * gs + j <-> query head h * g + s * gs + j
                pr = p.view(S, gs, n, nbc).permute(0, 2, 1, 3).reshape(S, n * gs, nbc)
                pr = torch.cat([pr, pr.new_zeros(S, (t1 - t0) * TILE_ROWS - n * gs, nbc)], 1)
                pr = pr.view(S, t1 - t0, TILE_ROWS, nbc)
                al = alw[None, :, None, :].expand_as(pr)
                order = torch.where(al, torch.full_like(pr, 2.0), pr).argsort(-1, descending=True)
                ps = torch.gather(pr, -1, order)
                take = ((ps.cumsum(-1) - ps) < frac) & (ps > 0)  # while the mass before a block is below frac
                rows = torch.zeros_like(take).scatter_(-1, order, take)
                keep = (rows.any(2) & vis[None]) | alw[None]
            kr = keep.repeat_interleave(TILE_ROWS, 1)[:, :n * gs].reshape(S, n, gs, nbc)
            keep_rows = kr.permute(0, 2, 1, 3).reshape(g, n, nbc)
            yield dict(h=h, c0=c0, c1=c1, e=e, keep_rows=keep_rows, keep=keep, visible=vis, t0=t0, S=S, gs=gs, nb=nb)


def oracle_attention(q, k, v, scale, frac, subgroups=None, block=128, sink=256, window=512, last_n=2,
                     mem_bytes=2 << 30, dtype=torch.float32, chunk=None):
    """-> (out [L, Hq, D] in `dtype`, kept blocks, visible blocks) of the oracle (frac None: dense, every block)."""
    L, Hq, D = q.shape
    g = Hq // k.shape[1]
    nb = (L + block - 1) // block
    vpad = torch.cat([v.to(dtype), v.new_zeros(nb * block - L, v.shape[1], D).to(dtype)])
    out = torch.empty(L, Hq, D, dtype=dtype, device=q.device)
    kept = visible = 0
    for c in oracle_chunks(q, k, scale, frac, subgroups, block, sink, window, last_n, mem_bytes, dtype, chunk):
        h, c0, c1, e, kr = c["h"], c["c0"], c["c1"], c["e"], c["keep_rows"]
        n, nbc = c1 - c0, kr.shape[-1]
        e.view(g, n, nbc, block).mul_(kr[..., None])  # drop the blocks the tile did not keep (in place)
        o = torch.matmul(e, vpad[:nbc * block, h]) / e.sum(-1, keepdim=True)
        out[c0:c1, h * g:(h + 1) * g] = o.permute(1, 0, 2)
        kept += int((c["keep"] & c["visible"][None]).sum())
        visible += int(c["visible"].sum()) * c["S"]
    return out, kept, visible


def oracle_select(q, k, scale, frac, subgroups=None, block=128, sink=256, window=512, last_n=2, mem_bytes=2 << 30,
                  dtype=torch.float64, chunk=None):
    """The oracle's selection assembled from the chunks: (keep [Hkv * S, T, nb], visible [T, nb]) in select()'s
    layout (virtual head h * S + s), for tests and diagnostics."""
    L, Hq, _ = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    S = subgroups or g
    T = (L * (g // S) + TILE_ROWS - 1) // TILE_ROWS
    nb = (L + block - 1) // block
    keep = torch.zeros(Hkv * S, T, nb, dtype=torch.bool, device=q.device)
    vis = torch.zeros(T, nb, dtype=torch.bool, device=q.device)
    for c in oracle_chunks(q, k, scale, frac, subgroups, block, sink, window, last_n, mem_bytes, dtype, chunk):
        Tc, nbc = c["visible"].shape
        keep[c["h"] * S:(c["h"] + 1) * S, c["t0"]:c["t0"] + Tc, :nbc] = c["keep"]
        vis[c["t0"]:c["t0"] + Tc, :nbc] = c["visible"]
    return keep, vis

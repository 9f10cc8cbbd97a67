"""Naive float64 numpy implementations of the semantic contract (docs/semantics.md), independent of the C++ library."""

import numpy as np

TILE_ROWS = 128


def seq_lens(cu):
    cu = np.asarray(cu, dtype=np.int64)
    return cu[:-1], np.diff(cu)


def visible_mask(lq, lk, causal=True, window=(-1, -1)):
    """[lq, lk] bool: query i sees key j (bottom-right alignment)."""
    i = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    diag = i + (lk - lq)
    m = np.ones((lq, lk), dtype=bool)
    if causal:
        m &= j <= diag
    left, right = window
    if right >= 0:
        m &= j <= diag + right
    if left >= 0:
        m &= j >= diag - left
    return m


def gather_paged(cache, block_table, seqused_k):
    """Contiguous [total_k, Hkv, D] keys of a paged cache and its cu_seqlens_k."""
    page = cache.shape[1]
    rows, cu = [], [0]
    for b, used in enumerate(np.asarray(seqused_k)):
        used = int(used)
        pages = (used + page - 1) // page
        if pages:
            rows.append(cache[np.asarray(block_table[b][:pages])].reshape(-1, *cache.shape[2:])[:used])
        cu.append(cu[-1] + used)
    k = np.concatenate(rows, 0) if rows else np.zeros((0,) + cache.shape[2:], cache.dtype)
    return k, np.array(cu, np.int32)


def attention(q, k, v, cu_q, cu_k, causal=True, scale=None, window=(-1, -1)):
    """(out [total_q, Hq, D] float64, lse [Hq, total_q] float64)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros_like(q)
    lse = np.full((hq, total_q), -np.inf)
    qs, lqs = seq_lens(cu_q)
    ks, lks = seq_lens(cu_k)
    for b in range(len(lqs)):
        lq, lk = int(lqs[b]), int(lks[b])
        if lq == 0:
            continue
        qb = q[qs[b]:qs[b] + lq]
        kb = np.repeat(k[ks[b]:ks[b] + lk], g, axis=1)
        vb = np.repeat(v[ks[b]:ks[b] + lk], g, axis=1)
        mask = visible_mask(lq, lk, causal, window)
        s = np.einsum("ihd,jhd->hij", qb, kb) * scale
        s = np.where(mask[None], s, -np.inf)
        m = s.max(axis=2, initial=-np.inf, keepdims=True)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m_safe)
        den = p.sum(axis=2, keepdims=True)
        o = np.einsum("hij,jhd->ihd", p / np.where(den > 0, den, 1.0), vb)
        out[qs[b]:qs[b] + lq] = o
        with np.errstate(divide="ignore"):
            lse[:, qs[b]:qs[b] + lq] = np.where(den[..., 0] > 0, np.log(den[..., 0]) + m_safe[..., 0], -np.inf)
    return out, lse


def pool(k, cu_k, block_size):
    """(means [total_blocks, Hkv, D] float64, cu_blocks)."""
    k = np.asarray(k, np.float64)
    ks, lks = seq_lens(cu_k)
    means, cu = [], [0]
    for b in range(len(lks)):
        nb = (int(lks[b]) + block_size - 1) // block_size
        for j in range(nb):
            lo = ks[b] + j * block_size
            hi = ks[b] + min((j + 1) * block_size, int(lks[b]))
            means.append(k[lo:hi].mean(axis=0))
        cu.append(cu[-1] + nb)
    shape = (0,) + k.shape[1:]
    return (np.stack(means) if means else np.zeros(shape)), np.array(cu, np.int32)


def tile_rows(tile, lq, g):
    """Packed rows [lo, hi) of a tile; row r is position r // g of head offset r % g."""
    lo = tile * TILE_ROWS
    return lo, min(lo + TILE_ROWS, lq * g)


def sparse_attention(q, k, v, cu_q, cu_k, index_host, block_size, correction, causal=True, scale=None):
    """Attention restricted to the listed blocks of each row's segment, plus the mean correction."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kmean, cu_blocks = pool(k, cu_k, block_size)
    vmean, _ = pool(v, cu_k, block_size)
    out = np.zeros_like(q)
    lse = np.full((hq, total_q), -np.inf)
    qs, lqs = seq_lens(cu_q)
    ks, lks = seq_lens(cu_k)
    seg = 0
    for b in range(len(lqs)):
        lq, lk = int(lqs[b]), int(lks[b])
        tiles = (lq * g + TILE_ROWS - 1) // TILE_ROWS
        nblocks = (lk + block_size - 1) // block_size
        mask = visible_mask(lq, lk, causal)
        for h in range(hkv):
            for t in range(tiles):
                s_id = seg + h * tiles + t
                lo_s, hi_s = index_host["segment_start"][s_id], index_host["segment_end"][s_id]
                listed = set(int(x) for x in index_host["block_ids"][lo_s:hi_s])
                r0, r1 = tile_rows(t, lq, g)
                first_pos = r0 // g
                for r in range(r0, r1):
                    i, head = r // g, h * g + r % g
                    logits, values = [], []
                    for jb in range(nblocks):
                        j0, j1 = jb * block_size, min((jb + 1) * block_size, lk)
                        if jb in listed:
                            sel = np.nonzero(mask[i, j0:j1])[0] + j0
                            if len(sel):
                                logits.append(q[qs[b] + i, head] @ k[ks[b] + sel, h].T * scale)
                                values.append(v[ks[b] + sel, h])
                        elif correction:
                            fully = (not causal) or (j1 - 1 <= first_pos + lk - lq)
                            if fully:
                                km = kmean[cu_blocks[b] + jb, h]
                                logits.append(np.array([q[qs[b] + i, head] @ km * scale + np.log(j1 - j0)]))
                                values.append(vmean[cu_blocks[b] + jb, h][None])
                    if not logits:
                        continue
                    lg = np.concatenate(logits)
                    vals = np.concatenate(values)
                    m = lg.max()
                    p = np.exp(lg - m)
                    out[qs[b] + i, head] = p @ vals / p.sum()
                    lse[head, qs[b] + i] = np.log(p.sum()) + m
        seg += hkv * tiles
    return out, lse


def select(q, k, cu_q, cu_k, alpha, block_size, sink=0, window=0, last_n=0, rule="tile_energy", scale=None,
           final_chunk=True, head_subgroups=1, tie=1e-5):
    """The selection (causal, bottom-right) from the contract, in float64, one row at a time: per segment (b,
    virtual KV head, tile) in contract order, (kept block ids, ids within `tie` of the threshold). rule
    'tile_energy': E_J = sum_r exp(s_rJ - M) >= alpha * max_J E_J (tie relative); 'row_max':
    max_r (s_rJ - m_r) >= ln(alpha), m_r = max_J s_rJ (tie absolute). The pooled means are float64 here (the
    libraries use float32), hence the tie band."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    S = head_subgroups
    gs = hq // hkv // S  # query heads per virtual KV head
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kmean, cu_blocks = pool(k, cu_k, block_size)
    qs, lqs = seq_lens(cu_q)
    _, lks = seq_lens(cu_k)
    out = []
    for b in range(len(lqs)):
        lq, lk = int(lqs[b]), int(lks[b])
        tiles = (lq * gs + TILE_ROWS - 1) // TILE_ROWS
        nb = (lk + block_size - 1) // block_size
        for v in range(hkv * S):
            for t in range(tiles):
                r0, r1 = tile_rows(t, lq, gs)
                sc = np.full((r1 - r0, nb), -np.inf)
                diags = []
                for r in range(r0, r1):
                    i, head = r // gs, v * gs + r % gs
                    diag = i + lk - lq
                    diags.append(diag)
                    for J in range(nb):
                        if diag >= 0 and J * block_size <= diag:
                            sc[r - r0, J] = scale * float(q[qs[b] + i, head] @ kmean[cu_blocks[b] + J, v // S])
                visible = [J for J in range(nb) if np.isfinite(sc[:, J]).any()]
                if rule == "row_max":
                    crit = np.full(nb, -np.inf)
                    for row in sc:
                        if np.isfinite(row).any():
                            m = row.max()
                            for J in range(nb):
                                if np.isfinite(row[J]):
                                    crit[J] = max(crit[J], row[J] - m)
                    thr = np.log(alpha) if alpha > 0 else -np.inf
                    near = lambda c: abs(c - thr) <= tie
                else:
                    M = sc.max() if visible else 0.0
                    crit = np.array([np.exp(sc[np.isfinite(sc[:, J]), J] - M).sum() for J in range(nb)])
                    thr = alpha * (crit[visible].max() if visible else 0.0)
                    near = lambda c: abs(c - thr) <= tie * thr
                last_tile = t >= tiles - (last_n if final_chunk else 0)
                dmin = min(diags) if diags else -1
                kept, ties = [], []
                for J in visible:
                    lo, hi = J * block_size, min((J + 1) * block_size, lk) - 1
                    band = window > 0 and any(lo <= dg and hi >= dg - window + 1 for dg in diags if dg >= 0)
                    forced = last_tile or lo < sink or hi > dmin or band
                    if forced or crit[J] >= thr:
                        kept.append(J)
                    if not forced and near(crit[J]):
                        ties.append(J)
                out.append((kept, set(ties)))
    return out

"""The exact oracle: per query head and query tile, the fewest key blocks that hold a fraction F of each row's true
softmax mass, then exact attention over them.

For every query head h and tile t of 128 consecutive positions (one selection per query head, the library's
head_subgroups = g geometry), each row keeps its blocks by decreasing true mass, after the tile's always-kept blocks
(sink, the local window, blocks crossing the diagonal, every block in the last `last_n` tiles), until the kept mass
reaches F; the tile keeps the union over its rows and every row then attends exactly (renormalised softmax, no
correction) over the tile's blocks. It is what a selection that knew the attention would keep: the floor the
library's estimates are measured against.

Bounded memory: probabilities exist for one query head and one chunk of query positions at a time (a multiple of
128 positions, [chunk, keys] float32 several times over), sized to `mem_bytes`; keys beyond the chunk's last position
are never formed (causal), so no whole L x L matrix is ever held.
"""

from __future__ import annotations

import math


def chunk_rows(L: int, mem_bytes: float) -> int:
    """Query positions per chunk: a multiple of 128 whose float32 [rows, L] working set (~4 copies) fits."""
    return max(128, int(mem_bytes // (16 * (L + 128))) // 128 * 128)


def oracle_attention(q, k, v, scale: float, frac: float, block_size: int = 128, sink: int = 256, window: int = 512,
                     last_n: int = 2, mem_bytes: float = 2 << 30):
    """(out [L, Hq, D] float32, kept blocks, visible blocks) of the oracle on one causal sequence.

    Args:
        q: [L, Hq, D]; k, v: [L, Hkv, D] (torch, any float dtype; computed in float32 on their device).
        scale: softmax scale; frac: the mass fraction F in (0, 1].
        block_size, sink, window, last_n: the library's block geometry and always-kept blocks.
        mem_bytes: the working memory of one chunk (see chunk_rows).
    """
    import torch
    L, Hq, D = q.shape
    g = Hq // k.shape[1]
    nb = (L + block_size - 1) // block_size
    P = nb * block_size
    dev = q.device
    kf = torch.zeros(P, k.shape[1], D, dtype=torch.float32, device=dev)
    vf = torch.zeros(P, v.shape[1], v.shape[2], dtype=torch.float32, device=dev)
    kf[:L], vf[:L] = k, v
    out = torch.empty(L, Hq, v.shape[2], dtype=torch.float32, device=dev)
    chunk = chunk_rows(L, mem_bytes)
    tiles = (L + 127) // 128
    first_key = torch.arange(nb, device=dev) * block_size
    last_key = torch.clamp(first_key + block_size, max=L) - 1
    kept = torch.zeros((), dtype=torch.int64, device=dev)   # summed on the device, read once (no sync per head)
    visible = 0
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        n, nbc = c1 - c0, (c1 + block_size - 1) // block_size
        K = nbc * block_size
        t = torch.arange(c0 // 128, (c1 + 127) // 128, device=dev)     # the chunk's tiles (c0 % 128 == 0)
        first_pos, last_pos = t * 128, torch.clamp(t * 128 + 127, max=L - 1)
        fk, lk = first_key[:nbc], last_key[:nbc]
        vis = fk[None] <= last_pos[:, None]
        always = (fk < sink)[None] | (lk[None] > first_pos[:, None]) | (t >= tiles - last_n)[:, None]
        if window > 0:
            always |= (lk[None] >= (first_pos - window + 1)[:, None]) & vis
        always &= vis
        visible += Hq * int(vis.sum())                          # the same blocks are visible to every head
        pos = torch.arange(c0, c1, device=dev)
        # keys a row does not see: only in the chunk's own key range [c0, K) (the rows before c0 see all of [0, c0))
        causal = torch.arange(c0, K, device=dev)[None] > pos[:, None]
        row_tile = (pos - c0) // 128
        # Passes over the [n, K] float32 matrix, what its time is (on a GPU at 32K: ~10 s per 8B-shaped prompt): the
        # product, the max, the shift and exp (in place), the block sums, the mask of kept blocks and the product
        # with V. The scale is folded into q, the causal mask touches only the chunk's own keys and the softmax
        # denominator is the kept blocks' mass: 10 passes where the direct formulation takes 16.
        for h in range(Hq):
            e = (q[c0:c1, h].float() * scale) @ kf[:K, h // g].T
            e[:, c0:].masked_fill_(causal, -math.inf)
            e = e.sub_(e.amax(1, keepdim=True)).exp_()             # key 0 is visible to every row: finite
            mass = e.view(n, nbc, block_size).sum(-1)              # unnormalised: sum_j exp(s_rj - max_r)
            total = mass.sum(1, keepdim=True)
            al = always[row_tile]
            order = torch.where(al, math.inf, mass).argsort(1, descending=True)    # the always-kept blocks first
            sorted_mass = mass.gather(1, order)
            take = ((sorted_mass.cumsum(1) - sorted_mass) < frac * total) & (sorted_mass > 0)
            rows = torch.zeros_like(take).scatter_(1, order, take)
            if n % 128:                                            # the last chunk: whole tiles for the union
                rows = torch.cat([rows, rows.new_zeros(len(t) * 128 - n, nbc)])
            keep = rows.view(len(t), 128, nbc).any(1) | always      # the union over each tile's rows
            row_keep = keep[row_tile]
            e.view(n, nbc, block_size).mul_(row_keep[..., None])
            out[c0:c1, h] = (e @ vf[:K, h // g]) / (mass * row_keep).sum(1, keepdim=True)
            kept += (keep & vis).sum()
    return out, int(kept), visible

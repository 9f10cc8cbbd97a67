"""A host model of the sparse kernel's dynamic scheduler, to tell load imbalance from memory effects when a tile order
is slower (docs/design/sparse_kernel.md, "Work order"). No GPU: every tile costs its steps + 1 (fill and drain), a step
is one 128-key block; the 132 SMs take the next tile of the work order (sparse_tile_coord's, rewritten here) when
they finish one. A tile's steps: its sink (2 blocks) and window (~5 blocks) always, `density` of its other visible
blocks, every visible block for the last 2 tiles (last_n). Prints each order's makespan over the ideal (all work / SMs).
Usage: python3 bench/lab/model_tile_order.py"""
import heapq


def tile_coord(t, heads, batch, max_tiles, band):
    """sparse_tile_coord (src/cuda/attention/block_schedule.h): (KV head, tile, sequence) of work-order index t."""
    first = (t // (band * heads)) * band
    off = t - first * heads
    width = min(band, batch * max_tiles - first)
    kv = off // width
    r = first + off - kv * width
    return kv, max_tiles - 1 - r // batch, r % batch


def tile_steps(tile, max_tiles, density, g, last_n=2):
    visible = ((tile * 128 + 127) // g) // 128 + 1  # blocks of 128 keys the tile's last row sees
    if tile >= max_tiles - last_n:
        return visible
    return min(visible, 7) + density * max(0, visible - 7)


def makespan(L, density, band, heads=8, g=4, sms=132):
    max_tiles = L * g // 128
    free = [0.0] * sms
    total = 0.0
    for t in range(heads * max_tiles):
        _, tile, _ = tile_coord(t, heads, 1, max_tiles, band)
        cost = tile_steps(tile, max_tiles, density, g) + 1
        total += cost
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free) / (total / sms)


if __name__ == "__main__":
    # the A/B rows of ab_banded_fpv2_h200.json / ab_banded_random_h200.json, at their densities
    for L, density in ((8192, 0.26), (32768, 0.073), (131072, 0.019), (65536, 0.2), (65536, 0.5)):
        print(f"L {L:6d} density {density:.3f}: makespan / ideal, heads fastest {makespan(L, density, 1):.3f}, "
              f"banded {makespan(L, density, 132):.3f}")

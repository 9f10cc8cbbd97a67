"""key_basis_kernel's reordered work (lab/key-basis-order) against the plain statement, thread by thread on the CPU:
the slices summed per float4 with every slice in flight, Y = C X read by C's columns (C symmetric to the bit), the
right-looking Gram-Schmidt (one owner warp per column, every warp subtracting the finished column from its later
columns). Both orders run with the same float32 operations (fma as float64 product + add, rounded once: the same
emulation on both sides), so equal bits here mean the kernels' indexing and order of operations agree; the device
test is test_key_max_cuda.py. Usage: python3 bench/lab/key_basis_order_check.py"""
import numpy as np

THREADS, WARPS = 256, 8
f32 = np.float32


def fma(a, b, c):
    return f32(np.float64(a) * np.float64(b) + np.float64(c))


def hash_unit(d, c):
    h = ((d * 2654435761) ^ (c * 2246822519)) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 2246822519) & 0xFFFFFFFF
    h ^= h >> 13
    return f32((np.int32(np.uint32(h >> 8)) - (1 << 23)) / float(1 << 23))


def shfl_sum(vals):  # butterfly over 32 lanes, o = 16, 8, 4, 2, 1: every lane ends with the same value
    v = list(vals)
    for o in (16, 8, 4, 2, 1):
        v = [f32(v[l] + v[l ^ o]) for l in range(32)]
    return v


def subtract_projection(X, y, R, per, col):
    """y -= (X[:, col] . y) X[:, col] as one warp computes it (lane partial dots, the shuffle tree)."""
    dots = []
    for l in range(32):
        dot = f32(0)
        for k in range(per):
            dot = fma(X[(l + 32 * k) * R + col], y[l][k], dot)
        dots.append(dot)
    dots = shfl_sum(dots)
    for l in range(32):
        for k in range(per):
            y[l][k] = fma(-dots[l], X[(l + 32 * k) * R + col], y[l][k])


def write_normalized(X, y, R, per, col):
    """X[:, col] = y / |y| as one warp computes it (the lanes' partial norms, the shuffle tree, 0 for a zero or NaN
    column), y[lane][k] holding row lane + 32 k."""
    nns = []
    for l in range(32):
        nn = f32(0)
        for k in range(per):
            nn = fma(y[l][k], y[l][k], nn)
        nns.append(nn)
    nns = shfl_sum(nns)
    for l in range(32):
        ok = nns[l] > 0
        inv = f32(1 / np.sqrt(np.float64(nns[l]))) if ok else f32(0)
        for k in range(per):
            X[(l + 32 * k) * R + col] = f32(y[l][k] * inv) if ok else f32(0)



def plain(partials, D, R, iters):
    C = np.zeros(D * D, f32)
    for i in range(D * D):
        c = f32(0)
        for p in partials:
            c = f32(c + p[i])
        C[i] = c
    X = np.array([hash_unit(i // R, i % R) for i in range(D * R)], f32)
    per = D // 32
    for _ in range(iters):
        Y = np.zeros(D * R, f32)
        for i in range(D * R):
            d, col = divmod(i, R)
            y = f32(0)
            for e2 in range(D):
                y = fma(C[d * D + e2], X[e2 * R + col], y)
            Y[i] = y
        for col in range(R):
            y = [[Y[(l + 32 * k) * R + col] for k in range(per)] for l in range(32)]
            for prev in range(col):
                subtract_projection(X, y, R, per, prev)
            write_normalized(X, y, R, per, col)
    return X


def reordered(partials, D, R, iters):
    C = np.zeros(D * D, f32)
    vec = D * D // 4 // THREADS
    for t in range(THREADS):
        for v in range(vec):
            i4 = t + v * THREADS
            c = [f32(0)] * 4
            for p in partials:
                for q in range(4):
                    c[q] = f32(c[q] + p[4 * i4 + q])
            C[4 * i4:4 * i4 + 4] = c
    X = np.array([hash_unit(i // R, i % R) for i in range(D * R)], f32)
    per, own, cols = D // 32, (R + WARPS - 1) // WARPS, D * R // THREADS
    for _ in range(iters):
        Y = np.zeros(D * R, f32)
        for t in range(THREADS):
            yd, yc0 = t % D, (t // D) * cols
            y = [f32(0)] * cols
            for e2 in range(D):
                c = C[e2 * D + yd]
                for j in range(cols):
                    y[j] = fma(c, X[e2 * R + yc0 + j], y[j])
            for j in range(cols):
                Y[yd * R + yc0 + j] = y[j]
        ys = {w: [[[Y[(l + 32 * k) * R + w + j * WARPS] if w + j * WARPS < R else f32(0) for k in range(per)]
                   for l in range(32)] for j in range(own)] for w in range(WARPS)}
        for c in range(R):
            for w in range(WARPS):  # the owner finishes column c
                for j in range(own):
                    if w + j * WARPS != c:
                        continue
                    write_normalized(X, ys[w][j], R, per, c)
            for w in range(WARPS):  # after the barrier: every warp's later columns
                for j in range(own):
                    col = w + j * WARPS
                    if col <= c or col >= R:
                        continue
                    subtract_projection(X, ys[w][j], R, per, c)
    return X


def main():
    rng = np.random.default_rng(0)
    for D, R, splits in ((64, 16, 3), (64, 32, 2), (128, 16, 2)):
        keys = rng.standard_normal((splits, 40, D)).astype(f32) * f32(3)
        keys[:, :, :4] *= f32(20)  # a few strong directions, as learned keys have
        partials = []
        for s in range(splits):  # a symmetric partial C per slice (x_r x_c in the same order for (r, c) and (c, r))
            P = np.zeros((D, D), f32)
            for x in keys[s]:
                for r in range(D):
                    for c in range(D):
                        P[r, c] = fma(x[r], x[c], P[r, c])
            assert (P == P.T).all()
            partials.append(P.reshape(-1))
        a, b = plain(partials, D, R, 2), reordered(partials, D, R, 2)
        print(f"D {D} R {R} slices {splits}: identical bits {np.array_equal(a.view(np.uint32), b.view(np.uint32))}, "
              f"max |diff| {np.abs(a - b).max():.3g}, orthonormal to {np.abs(a.reshape(D, R).T @ a.reshape(D, R) - np.eye(R)).max():.2g}")


if __name__ == "__main__":
    main()

"""key_basis_kernel (src/cuda/index/key_max.cu) transliterated literally, threads as Python loops, for one CTA, against
the reference's double MGS subspace iteration: checks the kernel's indexing (padded C, float4 slices, rows per
thread, the CGS2 lanes) on a machine without a GPU. D 64, R 16 / 32, 3 iterations (minutes of pure Python):
    python3 bench/lab/key_basis_emulation.py
At a97f704 + 725b1c5: max |kernel - reference| 4.4e-7 (R 16) and 1.3e-6 (R 32), orthogonality 3e-7."""
import numpy as np
def hash_unit(d, c):
    h = ((d * 2654435761) ^ (c * 2246822519)) & 0xffffffff
    h ^= h >> 15; h = (h * 2246822519) & 0xffffffff; h ^= h >> 13
    return np.float32((np.int64(h >> 8) - (1 << 23)) / float(1 << 23))
def kernel(partials, D, R, iters=10, T=256):
    splits = partials.shape[0]
    kCS = D + 4; kGroups = T // R; kRows = D // kGroups; kPer = D // 32; kVec = D * D // 4 // T
    C = np.zeros(D * kCS, np.float32); X = np.zeros(D * R, np.float32); Y = np.zeros(D * R, np.float32)
    part4 = partials.reshape(splits, -1, 4)
    for t in range(T):
        c = np.zeros((kVec, 4), np.float32)
        for s in range(splits):
            for v in range(kVec): c[v] += part4[s, t + v * T]
        for v in range(kVec):
            i = 4 * (t + v * T); C[(i // D) * kCS + i % D:(i // D) * kCS + i % D + 4] = c[v]
    for i in range(D * R): X[i] = hash_unit(i // R, i % R)
    for it in range(iters):
        for t in range(T):
            col, group = t % R, t // R
            y = np.zeros(kRows, np.float32)
            for e in range(0, D, 4):
                x = [X[(e + j) * R + col] for j in range(4)]
                for k in range(kRows):
                    c4 = C[(group + kGroups * k) * kCS + e:(group + kGroups * k) * kCS + e + 4]
                    y[k] = y[k] + c4[0]*x[0] + c4[1]*x[1] + c4[2]*x[2] + c4[3]*x[3]
            for k in range(kRows): Y[(group + kGroups * k) * R + col] = y[k]
        for c in range(R):
            v = np.array([[Y[(lane + 32 * k) * R + c] for k in range(kPer)] for lane in range(32)], np.float32)
            for p_ in range(2):
                dot = np.zeros(R, np.float32)
                for p in range(c):
                    dot[p] = sum(X[(lane + 32 * k) * R + p] * v[lane, k] for lane in range(32) for k in range(kPer))
                for p in range(c):
                    for lane in range(32):
                        for k in range(kPer): v[lane, k] -= dot[p] * X[(lane + 32 * k) * R + p]
            nn = np.float32((v * v).sum())
            for lane in range(32):
                for k in range(kPer): X[(lane + 32 * k) * R + c] = v[lane, k] / np.sqrt(nn) if nn > 0 else 0
    return X.reshape(D, R)
def mgs_ref(C, D, R, iters=10):
    X = np.array([[float(hash_unit(d, c)) for c in range(R)] for d in range(D)])
    for it in range(iters):
        Yd = C @ X; Xn = np.zeros_like(X)
        for c in range(R):
            y = Yd[:, c].copy()
            for p in range(c): y -= (Xn[:, p] @ y) * Xn[:, p]
            n = np.sqrt(y @ y); Xn[:, c] = y / n if n > 0 else 0
        X = Xn
    return X
rng = np.random.default_rng(1)
for D, R in ((64, 16), (64, 32)):
    A = rng.standard_normal((D, 600)) * np.logspace(0, -2, D)[:, None]
    xs = np.array_split(A, 3, axis=1)
    partials = np.stack([(x @ x.T).astype(np.float32).ravel() for x in xs])
    C = partials.astype(np.float64).sum(0).reshape(D, D)
    Xk = kernel(partials, D, R, iters=3); Xr = mgs_ref(C, D, R, iters=3)
    print(D, R, "max |kernel - ref|", np.abs(Xk - Xr).max(), "orth", np.abs(Xk.T @ Xk - np.eye(R)).max())

"""Fragment-level NumPy simulation of one warp of kernels/attention/decode_mma.cuh.

mma.m16n8k16 (.row.col, f32 accumulators, f16/bf16 inputs) and movmatrix.m8n8.trans.b16 are implemented
from the PTX ISA's documented fragment layouts (independently of the kernel's mapping):
  A (16x16, row): lane (g = lane/4, t = lane%4): reg0 = {A[g][2t], A[g][2t+1]}, reg1 = {A[g+8][2t], +1},
                  reg2 = {A[g][2t+8], +1}, reg3 = {A[g+8][2t+8], +1}   (first element in the low half)
  B (16x8, col):  reg0 = {B[2t][g], B[2t+1][g]}, reg1 = {B[2t+8][g], B[2t+9][g]}
  C/D (16x8):     c0, c1 = C[g][2t], C[g][2t+1]; c2, c3 = C[g+8][2t], C[g+8][2t+1]
  movmatrix.trans: in: lane l holds {M[l/4][2(l%4)], M[l/4][2(l%4)+1]}; out: the same positions of M^T.
The kernel's per-lane logic (q fragment permutation, K/V 16-byte loads, word selection, ballots and
masks, row max / l over the t-lanes, P packing, movmatrix of V words, O ownership and the store to
shared memory) is replayed lane by lane and checked against Q @ K.T and softmax(S) @ V in float64.
"""
import argparse

import numpy as np

NEG_INF = -np.inf


def bf16(x):
    """round to bfloat16 (nearest even), returned as float64"""
    f = np.asarray(x, np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def f16(x):
    return np.asarray(x, np.float16).astype(np.float64)


# ---- the hardware, from the PTX ISA layouts ------------------------------------------------------
def lane_gt(l):
    return l // 4, l % 4


def mma(A_regs, B_regs, C):
    """A_regs [32][4] of (lo, hi), B_regs [32][2] of (lo, hi), C [32][4] floats -> D [32][4]"""
    A = np.zeros((16, 16)); B = np.zeros((16, 8)); Cm = np.zeros((16, 8))
    for l in range(32):
        g, t = lane_gt(l)
        r = A_regs[l]
        A[g][2 * t], A[g][2 * t + 1] = r[0]
        A[g + 8][2 * t], A[g + 8][2 * t + 1] = r[1]
        A[g][2 * t + 8], A[g][2 * t + 9] = r[2]
        A[g + 8][2 * t + 8], A[g + 8][2 * t + 9] = r[3]
        b = B_regs[l]
        B[2 * t][g], B[2 * t + 1][g] = b[0]
        B[2 * t + 8][g], B[2 * t + 9][g] = b[1]
        Cm[g][2 * t], Cm[g][2 * t + 1], Cm[g + 8][2 * t], Cm[g + 8][2 * t + 1] = C[l]
    Dm = A @ B + Cm
    out = np.zeros((32, 4))
    for l in range(32):
        g, t = lane_gt(l)
        out[l] = [Dm[g][2 * t], Dm[g][2 * t + 1], Dm[g + 8][2 * t], Dm[g + 8][2 * t + 1]]
    return out


def movmatrix_trans(regs):
    """regs [32] of (lo, hi) -> [32] of (lo, hi)"""
    M = np.zeros((8, 8))
    for l in range(32):
        M[l // 4][2 * (l % 4)], M[l // 4][2 * (l % 4) + 1] = regs[l]
    T = M.T
    return [(T[l // 4][2 * (l % 4)], T[l // 4][2 * (l % 4) + 1]) for l in range(32)]


def shfl_xor(vals, m):
    return [vals[l ^ m] for l in range(32)]


def ballot(preds):
    return sum(1 << l for l in range(32) if preds[l])


# ---- the kernel's per-lane logic -------------------------------------------------------------------
def q_frag(Q, l, kk):
    g, t = lane_gt(l)
    c, h = kk >> 1, kk & 1
    d = 32 * c + 8 * t + 4 * h
    return [(Q[g][d], Q[g][d + 1]), (Q[g + 8][d], Q[g + 8][d + 1]),
            (Q[g][d + 2], Q[g][d + 3]), (Q[g + 8][d + 2], Q[g + 8][d + 3])]


def load16(X, tok, l, c, ok):
    """lane l's 16 bytes of row tok, chunk c: 4 words of (lo, hi); zeros where not ok"""
    g, t = lane_gt(l)
    if not ok:
        return [(0.0, 0.0)] * 4
    d0 = 32 * c + 8 * t
    return [(X[tok][d0 + 2 * i], X[tok][d0 + 2 * i + 1]) for i in range(4)]


def warp_tile_S(Q, K, D, valid):
    """S accumulators per lane [32][j][4] (unscaled) for one 16-token tile"""
    NC = D // 32
    okl = [[valid[8 * r + lane_gt(l)[0]] for r in range(2)] for l in range(32)]
    kr = [[[load16(K, 8 * r + lane_gt(l)[0], l, c, okl[l][r]) for c in range(NC)] for r in range(2)] for l in range(32)]
    sacc = [np.zeros((32, 4)) for _ in range(2)]
    for c in range(NC):
        for h in range(2):
            A = [q_frag(Q, l, 2 * c + h) for l in range(32)]
            for j in range(2):
                B = [(kr[l][j][c][2 * h], kr[l][j][c][2 * h + 1]) for l in range(32)]
                sacc[j] = mma(A, B, sacc[j])
    bal = [ballot([okl[l][r] for l in range(32)]) for r in range(2)]
    return sacc, bal, okl


class WarpState:
    def __init__(self, D):
        self.D = D
        NC = D // 32
        self.o = np.zeros((32, NC, 4, 4))
        self.m = np.full((32, 2), NEG_INF)
        self.l = np.zeros((32, 2))


def tile(st, Q, K, V, valid, qscale, rnd):
    D = st.D
    NC = D // 32
    sacc, bal, okl = warp_tile_S(Q, K, D, valid)
    s = np.zeros((32, 2, 4))
    for l in range(32):
        g, t = lane_gt(l)
        for j in range(2):
            for e in range(4):
                val = (bal[j] >> (8 * t + 4 * (e & 1))) & 1
                s[l][j][e] = sacc[j][l][e] * qscale if val else NEG_INF
    corr = np.zeros((32, 2))
    for rr in range(2):
        mx = [max(s[l][0][2 * rr], s[l][0][2 * rr + 1], s[l][1][2 * rr], s[l][1][2 * rr + 1]) for l in range(32)]
        x1 = shfl_xor(mx, 1); mx = [max(a, b) for a, b in zip(mx, x1)]
        x2 = shfl_xor(mx, 2); mx = [max(a, b) for a, b in zip(mx, x2)]
        for l in range(32):
            M = max(mx[l], st.m[l][rr])
            mu = 0.0 if M == NEG_INF else M
            corr[l][rr] = np.exp2(st.m[l][rr] - mu)
            st.m[l][rr] = M
            ps = 0.0
            for j in range(2):
                for e in range(2):
                    p = np.exp2(s[l][j][2 * rr + e] - mu)
                    s[l][j][2 * rr + e] = p
                    ps += p
            st.l[l][rr] = st.l[l][rr] * corr[l][rr] + ps
    for l in range(32):
        st.o[l][:, :, 0:2] *= corr[l][0]
        st.o[l][:, :, 2:4] *= corr[l][1]
    pa = [[(rnd(s[l][0][0]), rnd(s[l][0][1])), (rnd(s[l][0][2]), rnd(s[l][0][3])),
           (rnd(s[l][1][0]), rnd(s[l][1][1])), (rnd(s[l][1][2]), rnd(s[l][1][3]))] for l in range(32)]
    vr = [[[load16(V, 8 * r + lane_gt(l)[0], l, c, okl[l][r]) for c in range(NC)] for r in range(2)] for l in range(32)]
    for c in range(NC):
        for i in range(4):
            b0 = movmatrix_trans([vr[l][0][c][i] for l in range(32)])
            b1 = movmatrix_trans([vr[l][1][c][i] for l in range(32)])
            B = [(b0[l], b1[l]) for l in range(32)]
            C = np.array([st.o[l][c][i] for l in range(32)])
            Dn = mma(pa, B, C)
            for l in range(32):
                st.o[l][c][i] = Dn[l]
    return sacc, s, pa


def store_rows(st):
    """the kernel's put(): lane (g, t) -> red[g][32c + 8t .. +8], red[g + 8][same]; l over t-lanes"""
    D = st.D
    NC = D // 32
    red = np.full((16, D), np.nan)
    for l in range(32):
        g, t = lane_gt(l)
        for c in range(NC):
            o = st.o[l][c]
            red[g][32 * c + 8 * t: 32 * c + 8 * t + 8] = [o[0][0], o[0][1], o[1][0], o[1][1], o[2][0], o[2][1], o[3][0], o[3][1]]
            red[g + 8][32 * c + 8 * t: 32 * c + 8 * t + 8] = [o[0][2], o[0][3], o[1][2], o[1][3], o[2][2], o[2][3], o[3][2], o[3][3]]
    lsum = st.l.copy()
    for rr in range(2):
        a = lsum[:, rr]
        a = a + np.array(shfl_xor(list(a), 1))
        a = a + np.array(shfl_xor(list(a), 2))
        lsum[:, rr] = a
    m = np.zeros(16); L = np.zeros(16)
    for l in range(32):
        g, t = lane_gt(l)
        for rr in range(2):
            row = g + 8 * rr
            # every t-lane of the row holds the same m and l
            assert st.m[l][rr] == st.m[4 * g][rr] or (np.isnan(st.m[l][rr]) and np.isnan(st.m[4 * g][rr]))
            assert lsum[l][rr] == lsum[4 * g][rr]
            m[row], L[row] = st.m[l][rr], lsum[l][rr]
    assert not np.isnan(red).any(), "some O element not owned by any lane"
    return red, m, L


def check(D, GQ, rng, elem="bf16", ntiles=3, pvalid=0.8):
    rnd = bf16 if elem == "bf16" else f16
    Q = np.zeros((16, D))
    Q[:GQ] = rnd(rng.standard_normal((GQ, D)))
    scale = 1 / np.sqrt(D)
    qscale = scale * np.log2(np.e)
    st = WarpState(D)
    allK, allV, allvalid = [], [], []
    for it in range(ntiles):
        K = rnd(rng.standard_normal((16, D)) * (1 + it))
        V = rnd(rng.standard_normal((16, D)))
        valid = rng.random(16) < pvalid
        if it == 0:
            # exact S / P.V check on the first tile, no previous state
            sacc, s, pa = tile(st, Q, K, V, valid, qscale, lambda x: x)  # P unrounded: exact algebra
            S = Q @ K.T
            S0 = Q @ (K * valid[:, None]).T  # absent tokens' K rows are not read (zeros), masked below
            for j in range(2):
                for l in range(32):
                    g, t = lane_gt(l)
                    exp = [S0[g][8 * j + 2 * t], S0[g][8 * j + 2 * t + 1], S0[g + 8][8 * j + 2 * t], S0[g + 8][8 * j + 2 * t + 1]]
                    assert np.allclose(sacc[j][l], exp, rtol=1e-12, atol=1e-12), (D, j, l)
            red, m, L = store_rows(st)
            Sm = np.where(valid[None, :], S * qscale, NEG_INF)
            mx = Sm.max(axis=1)
            mu = np.where(mx == NEG_INF, 0.0, mx)
            P = np.exp2(Sm - mu[:, None])
            assert np.allclose(m, mx), "row max"
            assert np.allclose(L, P.sum(axis=1), rtol=1e-12), "l"
            assert np.allclose(red, P @ V, rtol=1e-12, atol=1e-12), "P @ V"
            assert valid.all() or not np.allclose(S, S0), "the masking test needs absent tokens"
            st = WarpState(D)  # start again, now with rounded P, over all tiles
            allK, allV, allvalid = [], [], []
            Kt, Vt, vt = K, V, valid
            tile(st, Q, Kt, Vt, vt, qscale, rnd)
            allK.append(Kt); allV.append(Vt); allvalid.append(vt)
            continue
        tile(st, Q, K, V, valid, qscale, rnd)
        allK.append(K); allV.append(V); allvalid.append(valid)
    red, m, L = store_rows(st)
    K = np.concatenate(allK); V = np.concatenate(allV); valid = np.concatenate(allvalid)
    S = np.where(valid[None, :], (Q @ K.T) * scale, NEG_INF)
    mx = S.max(axis=1)
    W = np.exp(S - mx[:, None])
    ref = (W @ V) / W.sum(axis=1)[:, None]
    lse = mx + np.log(W.sum(axis=1))
    got = red / L[:, None]
    glse = (m + np.log2(L)) * np.log(2)
    err = np.abs(got - ref)[:GQ].max()
    eps = 2.0 ** -7 if elem == "bf16" else 2.0 ** -10
    floor = eps * np.abs(ref[:GQ]).max()
    assert np.allclose(glse[:GQ], lse[:GQ], rtol=1e-9, atol=1e-9), "lse"
    return err, floor


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rng = np.random.default_rng(0)
    for D in (64, 128, 256):
        for GQ in (3, 8, 16):
            worst = 0.0
            for elem in ("bf16", "f16"):
                for rep in range(2):
                    err, floor = check(D, GQ, rng, elem)
                    worst = max(worst, err / floor)
            print(f"D={D:3d} GQ={GQ:2d}: S, row max, l, P@V exact (float64, unrounded P); 3-tile online "
                  f"softmax with P rounded to q's type: max err / (1 ulp x max|ref|) = {worst:.3f}")
    # all tokens of a tile absent: m stays -inf, O and l 0 (no NaN)
    st = WarpState(64)
    Q = np.zeros((16, 64)); Q[:4] = 1.0
    tile(st, Q, np.ones((16, 64)), np.full((16, 64), np.nan), np.zeros(16, bool), 1.0, bf16)
    red, m, L = store_rows(st)
    assert np.all(m == NEG_INF) and np.all(L == 0) and np.all(red == 0), "empty tile"
    print("empty tile: m = -inf, l = 0, O = 0 (absent V rows never read)")
    print("OK")

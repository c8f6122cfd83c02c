/* decode_mma.cuh: the tensor-core variant of the sparse decode-attention kernel (gvr_sparse_attention,
 * gvr_kernels.h), for GQA groups of GQ = Hq / Hkv in [3, 16] query heads, normal mode only (no
 * per-entry partials; those keep decode.cuh). Selected at run time by decode.cu when GVR_ATTN_MMA=1.
 *
 * One CTA of 4 warps per (row b, KV head, split s): all GQ heads of the KV head are the M = 16 rows
 * of mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16} (rows >= GQ: zero q, computed, never written).
 * The split's tokens (its entries expanded to their G tokens) are cut into 16-token tiles; tile i of
 * the CTA goes to warp i % 4. Lane (g = lane / 4, t = lane % 4) resolves tokens g and 8 + g of its
 * warp's tile (entry load -> block-table load -> K/V row offsets, pipelined across tiles) and loads,
 * for every 32-element chunk c of D, the 16 bytes [32c + 8t, 32c + 8t + 8) of those K and V rows.
 *  - S = q.K^T per 8-token n-tile j (tokens 8j..8j+7): the K words w0..w3 of (token 8j + g, chunk c)
 *    are the B fragment of k-steps (c, h): b0 = w[2h], b1 = w[2h + 1]; the dot product is invariant
 *    to a permutation of d, so q's A fragment of k-step (c, h) takes the same permutation:
 *    a0 = q[g][32c + 8t + 4h + {0,1}], a1 = q[g + 8][same], a2 = q[g][32c + 8t + 4h + {2,3}],
 *    a3 = q[g + 8][same]. q is unscaled (exact input values); s = acc * scale * log2(e) in f32.
 *  - online softmax per row (query head), log2 domain (ex2), l kept per lane (partial over the lane's
 *    columns, reduced over the 4 t-lanes at the end), O rescaled only when some row's max moved.
 *  - O += P.V: A = P straight from S's accumulators (the FlashAttention-2 register reuse), B = V via
 *    movmatrix.trans of the loaded V words: word i of (token g of group r, chunk c) transposed is the
 *    b_r register of output n-tile (c, i), whose column n is d = 32c + 8(n >> 1) + 2i + (n & 1); so
 *    lane (g, t) ends up owning O[g][32c + 8t .. 32c + 8t + 7] and O[g + 8][same].
 * Every mapping above is checked at the fragment level by a NumPy simulation of the PTX ISA's
 * documented mma / movmatrix layouts: scripts/mma_layout_sim.py (keep it in step with this file).
 * NOT YET RUN ON A GPU: selected only with GVR_ATTN_MMA=1 until tests/test_attention_gpu.py's "mma"
 * variants have passed.
 *
 * Head dims 64 and 128. D = 256 keeps decode.cuh's kernel: O alone is 128 f32 registers per lane
 * there, and with one tile of K (64) and V (64) in flight plus the per-lane state it does not fit 255
 * registers (tried this session: rolling K -> V -> next K with pinned loads still spilled ~900 bytes);
 * the way there is a CTA of 8 warps, warp pairs splitting D (partial S exchanged through shared
 * memory), left for after this kernel is verified.
 * Registers (ptxas -v, sm_90a, __launch_bounds__(128, 2)): D = 64 201, D = 128 255, no spills, no
 * local memory. q: registers at D = 64 (D/4 = 16), shared memory at D = 128 (one LDS.128 per k-step,
 * each pinned behind the previous chunk's mma; q in registers spilled).
 * Pipelining: the next tile's token resolution runs ahead (entry loads three tiles, block-table loads
 * two tiles ahead); its K loads are issued before this tile's S, its V loads right after this tile's
 * S (pinned there: this tile's K registers are free then), so one tile of K and V (D = 128: 8 KB per
 * warp) is in flight behind the compute.
 *
 * The end of the CTA merges the 4 warps' states through shared memory in fixed order, then the
 * epilogue of decode.cuh (finalize; S > 1: split states to the workspace, the last CTA merges them in
 * split order; repair)
 * with 16 rows per unit. */
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode.cuh"

namespace gvr::attn {

constexpr int MMA_ROWS = 16;     /* the M dimension: GQA rows of one unit (the plan's "HC" for this path) */
constexpr int MMA_NW = 4;        /* warps per CTA */
constexpr int MMA_THREADS = MMA_NW * 32;
constexpr int MMA_RESIDENT = 2;  /* CTAs per SM that the instances' __launch_bounds__ guarantee */
constexpr int MMA_MIN_GQ = 3;    /* the smallest GQA group served (smaller ones keep decode.cuh) */

/* One instance: q/k/v element type ELEM, head dim D. Explicitly instantiated in decode_mma.cu. */
template <int ELEM, int D>
struct DecodeMmaInstance {
    static cudaError_t launch(const DecodeArgs &a, unsigned grid, cudaStream_t stream);
};

#if defined(__CUDACC__) && defined(GVR_DECODE_KERNELS) && defined(GVR_DECODE_MMA_KERNELS)

namespace mma_detail {

/* D = A.B + D, m16n8k16, f32 accumulators; all lanes of the warp execute it together */
template <int ELEM>
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1)
{
    if constexpr (ELEM == GVR_ELEM_BF16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* the transpose of the warp's 8 x 8 b16 matrix (lane l holds row l / 4, columns 2(l % 4), +1) */
__device__ __forceinline__ uint32_t movt(uint32_t x)
{
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

/* two floats to the element type, lo in the low half (the lower column / k index) */
template <int ELEM>
__device__ __forceinline__ uint32_t pack2(float lo, float hi)
{
    uint32_t r;
    if constexpr (ELEM == GVR_ELEM_BF16)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* word i (a constant after unrolling) of 16 loaded bytes */
__device__ __forceinline__ uint32_t word(const uint4 &v, int i)
{
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <int D>
struct MmaSmem {
    static constexpr int KK = D / 16;                 /* k-steps of S */
    static constexpr int NSLOT = MMA_NW;              /* warp states kept for the final merge */
    static constexpr int RS = D + 4;                  /* row stride (floats): conflict-free fragment stores */
    union U {
        uint4 q[KK][32];                  /* q's A fragments per k-step and lane (GVR_MMA_QSMEM) */
        float red[NSLOT * MMA_ROWS * RS]; /* red[slot][row][d] */
    };
    U u;
    float red_m[NSLOT][MMA_ROWS], red_l[NSLOT][MMA_ROWS];
    float wts[MAX_SPLITS][MMA_ROWS];
    float hM[MMA_ROWS], hL[MMA_ROWS], hPrior[MMA_ROWS];
    int last;
};

} // namespace mma_detail

template <int ELEM, int D>
__global__ void __launch_bounds__(MMA_THREADS, MMA_RESIDENT) gvr_attention_decode_mma_kernel(const DecodeArgs a)
{
    using namespace detail;
    using namespace mma_detail;
    constexpr int NC = D / 32;          /* 16-byte chunks of a row per lane */
    constexpr int KK = D / 16;          /* k-steps of S */
#ifndef GVR_MMA_QSMEM
#define GVR_MMA_QSMEM(D) ((D) >= 128)
#endif
    constexpr bool QSMEM = GVR_MMA_QSMEM(D); /* q's fragments in shared memory, else registers */
    static_assert(D == 64 || D == 128, "D = 256 keeps decode.cuh's kernel (see the header comment)");
    constexpr int HC = MMA_ROWS;
    constexpr int NW_ = MMA_NW;
    constexpr float NEG_INF = -__builtin_huge_valf();
    using SM = MmaSmem<D>;
    constexpr int NSLOT = SM::NSLOT, RS = SM::RS;
    __shared__ SM sm;

    pdl_enter();

    const int tid = (int)threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int g = lane >> 2, t = lane & 3;

    unsigned bid = blockIdx.x;
    const int s = (int)(bid % (unsigned)a.S);
    bid /= (unsigned)a.S;
    const int kvh = (int)(bid % (unsigned)a.Hkv);
    const int b = (int)(bid / (unsigned)a.Hkv);
    const long long unit = (long long)b * a.Hkv + kvh;
    const int nh = a.GQ;            /* valid rows */
    const int hq0 = kvh * a.GQ;     /* first query head */

    /* q's A fragment of k-step kk for this lane (element by element: any 2-byte alignment) */
    auto qfrag_load = [&](int kk, uint32_t (&f)[4]) {
        const int d = 32 * (kk >> 1) + 8 * t + 4 * (kk & 1);
        const uint16_t *qb = (const uint16_t *)a.q;
        uint32_t e0[4] = {0, 0, 0, 0}, e1[4] = {0, 0, 0, 0};
        if (g < nh) {
            const uint16_t *qe = qb + ((long long)b * a.q_sb + (long long)(hq0 + g) * a.q_sh + d);
#pragma unroll
            for (int i = 0; i < 4; i++)
                e0[i] = qe[i];
        }
        if (g + 8 < nh) {
            const uint16_t *qe = qb + ((long long)b * a.q_sb + (long long)(hq0 + g + 8) * a.q_sh + d);
#pragma unroll
            for (int i = 0; i < 4; i++)
                e1[i] = qe[i];
        }
        f[0] = e0[0] | (e0[1] << 16);
        f[1] = e1[0] | (e1[1] << 16);
        f[2] = e0[2] | (e0[3] << 16);
        f[3] = e1[2] | (e1[3] << 16);
    };
    uint32_t qa[QSMEM ? 1 : KK][4];
    if constexpr (QSMEM) {
        for (int kk = w; kk < KK; kk += NW_) {
            uint32_t f[4];
            qfrag_load(kk, f);
            sm.u.q[kk][lane] = make_uint4(f[0], f[1], f[2], f[3]);
        }
        __syncthreads();
        qa[0][0] = qa[0][1] = qa[0][2] = qa[0][3] = 0u;
    } else {
#pragma unroll
        for (int kk = 0; kk < KK; kk++)
            qfrag_load(kk, qa[kk]);
    }
    /* ptxas hoists independent loads as far up as it can; where that would hold too many registers at
     * once, a load's address is pinned behind a result: + (its bits & a run-time zero) */
    const unsigned zero = (unsigned)a.n >> 31; /* n >= 0 (checked by the host): 0, unknown to the compiler */
    auto pin = [&](long long off, float dep) -> long long { return off + (long long)(__float_as_uint(dep) & zero); };
    /* q's fragment of k-step kk (shared memory: its load pinned behind dep) */
    auto qfrag = [&](int kk, float dep, uint32_t (&f)[4]) {
        if constexpr (QSMEM) {
            const uint4 v = *(&sm.u.q[kk][lane] + (__float_as_uint(dep) & zero));
            f[0] = v.x;
            f[1] = v.y;
            f[2] = v.z;
            f[3] = v.w;
        } else {
            (void)dep;
#pragma unroll
            for (int i = 0; i < 4; i++)
                f[i] = qa[kk][i];
        }
    };

    const long long e0 = (long long)s * a.n / a.S, e1 = (long long)(s + 1) * a.n / a.S;
    const long long nent = e1 - e0;
    const int32_t *irow = a.idx + (long long)b * a.idx_sb + (long long)kvh * a.idx_sh + e0;
    /* this lane's 16-byte column piece of chunk 0 of the KV head's rows */
    const char *kb = (const char *)a.k + 2 * ((long long)kvh * a.k_sh + 8 * t);
    const char *vb = (const char *)a.v + 2 * ((long long)kvh * a.v_sh + 8 * t);
    const bool blockmode = a.bt != nullptr;
    const int G = a.G, P = a.P;
    const int32_t *btrow = a.bt + (long long)b * a.bt_sb;
    long long len; /* block mode: tokens of the row; slot mode: slots of the cache */
    if (blockmode) {
        const long long cap = (long long)a.max_pages * P;
        len = cap;
        if (a.lengths) {
            const long long l0 = a.lengths[b];
            len = l0 < 0 ? 0 : (l0 > cap ? cap : l0);
        }
    } else {
        len = a.num_pages * P;
    }
    const bool len32 = len <= 0x7fffffffLL; /* token positions fit 32 bits: 32-bit divisions by P */

    const long long ntok = nent * G;
    const long long ntiles = (ntok + 15) / 16;
    const long long nk = ntiles > w ? (ntiles - 1 - w) / NW_ + 1 : 0; /* this warp's tiles: w, w + 4, ... */

    /* ---- token resolution, three stages per token (lane: tokens g and 8 + g of the tile) ----
     * stage A: entry value and token-in-entry (an index load); the warp's tiles advance 64 tokens */
    long long ea[2];
    int ia[2];
    const int de = 64 / G, di = 64 % G;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int v0 = 16 * w + 8 * r + g;
        ea[r] = v0 / G;
        ia[r] = v0 - (v0 / G) * G;
    }
    auto stage_a = [&](int (&x)[2], int (&ii)[2]) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            x[r] = ea[r] < nent ? __ldg(irow + ea[r]) : -1;
            ii[r] = ia[r];
            ia[r] += di;
            ea[r] += de;
            if (ia[r] >= G) {
                ia[r] -= G;
                ea[r] += 1;
            }
        }
    };
    /* stage B: (page, slot), issues the block-table load; false: no token */
    auto stage_b = [&](const int (&x)[2], const int (&ii)[2], int (&pg)[2], int (&slot)[2], bool (&ok)[2]) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            pg[r] = 0;
            slot[r] = 0;
            ok[r] = false;
            if (x[r] < 0)
                continue;
            if (blockmode) {
                const long long tk = (long long)x[r] * G + ii[r];
                if (tk >= len)
                    continue;
                long long tp;
                if (len32) {
                    const unsigned tu = (unsigned)tk, q = tu / (unsigned)P;
                    tp = q;
                    slot[r] = (int)(tu - q * (unsigned)P);
                } else {
                    tp = tk / P;
                    slot[r] = (int)(tk - tp * P);
                }
                pg[r] = __ldg(btrow + tp);
                ok[r] = true;
            } else {
                if ((long long)x[r] >= len)
                    continue;
                pg[r] = (int)((unsigned)x[r] / (unsigned)P);
                slot[r] = (int)((unsigned)x[r] - (unsigned)pg[r] * (unsigned)P);
                ok[r] = true;
            }
        }
    };
    /* stage C: page range check, byte offsets of the K and V rows; ballots of the tile's tokens (bit
     * 4k of bal[r]: token 8r + k present) */
    auto stage_c = [&](const int (&pg)[2], const int (&slot)[2], const bool (&okb)[2], long long (&ko)[2],
                       long long (&vo)[2], bool (&ok)[2], unsigned (&bal)[2]) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            ok[r] = okb[r] && pg[r] >= 0 && (long long)pg[r] < a.num_pages;
            ko[r] = 0;
            vo[r] = 0;
            if (ok[r]) {
                ko[r] = 2 * ((long long)pg[r] * a.k_sp + (long long)slot[r] * a.k_st);
                vo[r] = 2 * ((long long)pg[r] * a.v_sp + (long long)slot[r] * a.v_st);
            }
            bal[r] = __ballot_sync(0xffffffffu, ok[r]);
        }
    };
    auto load_k = [&](int c, const long long (&ko)[2], const bool (&ok)[2], uint4 (&kr)[2][NC]) {
#pragma unroll
        for (int r = 0; r < 2; r++)
            kr[r][c] = ok[r] ? ld_nc_v4(kb + ko[r] + 64 * c) : make_uint4(0, 0, 0, 0);
    };
    /* absent tokens: V rows of zeros (p = 0 times V stays finite) */
    auto load_v = [&](int c, const long long (&vo)[2], const bool (&ok)[2], uint4 (&vr)[2][NC]) {
#pragma unroll
        for (int r = 0; r < 2; r++)
            vr[r][c] = ok[r] ? ld_nc_v4(vb + vo[r] + 64 * c) : make_uint4(0, 0, 0, 0);
    };

    /* ---- running state: rows g (index 0) and g + 8 (index 1) ---- */
    float o[NC][4][4]; /* n-tile (c, i): {O[g][d], O[g][d + 1], O[g + 8][d], O[g + 8][d + 1]}, d = 32c + 8t + 2i */
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int c = 0; c < NC; c++)
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[c][i][e] = 0.f;
    const float qscale = a.qscale;

    /* S of the tile (both n-tiles) into sacc: two accumulator chains (n-tile j); q's fragments
     * (shared memory) read per chunk, pinned behind the chunk before (so that ptxas does not hoist all
     * of them over the mma: registers) */
    auto s_tile = [&](const uint4 (&kr)[2][NC], float (&sacc)[2][4]) {
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                sacc[j][e] = 0.f;
#pragma unroll
        for (int c = 0; c < NC; c++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                uint32_t f[4];
                qfrag(2 * c + h, sacc[0][0], f);
#pragma unroll
                for (int j = 0; j < 2; j++)
                    mma16816<ELEM>(sacc[j], f[0], f[1], f[2], f[3], word(kr[j][c], 2 * h), word(kr[j][c], 2 * h + 1));
            }
        }
    };
    /* online softmax of the tile's S; P as the A fragment of P.V */
    auto softmax = [&](float (&sacc)[2][4], const unsigned (&bal)[2], uint32_t (&pa)[4]) {
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const bool val = (bal[j] >> (8 * t + 4 * (e & 1))) & 1u; /* token 8j + 2t + (e & 1) */
                sacc[j][e] = val ? sacc[j][e] * qscale : NEG_INF;
            }
        float corr[2];
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            float mx = fmaxf(fmaxf(sacc[0][2 * rr], sacc[0][2 * rr + 1]), fmaxf(sacc[1][2 * rr], sacc[1][2 * rr + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mx, m[rr]);
            const float mu = mx == NEG_INF ? 0.f : mx;
            corr[rr] = ex2(m[rr] - mu);
            m[rr] = mx;
            float ps = 0.f;
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float p = ex2(sacc[j][2 * rr + e] - mu);
                    sacc[j][2 * rr + e] = p;
                    ps += p;
                }
            l[rr] = fmaf(l[rr], corr[rr], ps);
        }
        if (!__all_sync(0xffffffffu, corr[0] == 1.f && corr[1] == 1.f)) {
#pragma unroll
            for (int c = 0; c < NC; c++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    o[c][i][0] *= corr[0];
                    o[c][i][1] *= corr[0];
                    o[c][i][2] *= corr[1];
                    o[c][i][3] *= corr[1];
                }
        }
        pa[0] = pack2<ELEM>(sacc[0][0], sacc[0][1]); /* P[g][2t, 2t + 1] */
        pa[1] = pack2<ELEM>(sacc[0][2], sacc[0][3]); /* P[g + 8][2t, 2t + 1] */
        pa[2] = pack2<ELEM>(sacc[1][0], sacc[1][1]); /* P[g][8 + 2t, 9 + 2t] */
        pa[3] = pack2<ELEM>(sacc[1][2], sacc[1][3]); /* P[g + 8][8 + 2t, 9 + 2t] */
    };
    /* O += P.V of chunk c */
    auto pv_chunk = [&](int c, const uint32_t (&pa)[4], const uint4 (&vr)[2][NC]) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t b0 = movt(word(vr[0][c], i)), b1 = movt(word(vr[1][c], i));
            mma16816<ELEM>(o[c][i], pa[0], pa[1], pa[2], pa[3], b0, b1);
        }
    };

    int xa[2] = {-1, -1}, ixa[2] = {0, 0}; /* stage A result waiting for stage B */
    int pgb[2] = {0, 0}, slb[2] = {0, 0};  /* stage B result waiting for stage C */
    bool okb[2] = {false, false};

    {
        uint4 k0[2][NC], v0[2][NC], k1[2][NC], v1[2][NC];
        unsigned bal0[2] = {0u, 0u}, bal1[2] = {0u, 0u};
        long long kon[2], von[2];
        bool okn[2];
        if (nk > 0) {
            stage_a(xa, ixa);
            stage_b(xa, ixa, pgb, slb, okb);
            stage_c(pgb, slb, okb, kon, von, okn, bal0);
#pragma unroll
            for (int c = 0; c < NC; c++) {
                load_k(c, kon, okn, k0);
                load_v(c, von, okn, v0);
            }
            if (nk > 1) {
                stage_a(xa, ixa);
                stage_b(xa, ixa, pgb, slb, okb);
            }
            if (nk > 2)
                stage_a(xa, ixa);
        }
        /* tile kt from (kc, vc, balc); the next tile's loads into (kn, vn, baln) */
        auto tile = [&](long long kt, uint4 (&kc)[2][NC], uint4 (&vc)[2][NC], const unsigned (&balc)[2],
                        uint4 (&kn)[2][NC], uint4 (&vn)[2][NC], unsigned (&baln)[2]) {
            const bool more = kt + 1 < nk;
            if (more) {
                stage_c(pgb, slb, okb, kon, von, okn, baln);
#pragma unroll
                for (int c = 0; c < NC; c++)
                    load_k(c, kon, okn, kn);
            }
            if (kt + 2 < nk)
                stage_b(xa, ixa, pgb, slb, okb);
            if (kt + 3 < nk)
                stage_a(xa, ixa);
            float sacc[2][4];
            s_tile(kc, sacc);
            if (more) { /* the next tile's V once this tile's K registers are free */
                const long long vd[2] = {pin(von[0], sacc[1][3]), pin(von[1], sacc[1][3])};
#pragma unroll
                for (int c = 0; c < NC; c++)
                    load_v(c, vd, okn, vn);
            }
            uint32_t pa[4];
            softmax(sacc, balc, pa);
#pragma unroll
            for (int c = 0; c < NC; c++)
                pv_chunk(c, pa, vc);
        };
        for (long long kt = 0; kt < nk; kt += 2) {
            tile(kt, k0, v0, bal0, k1, v1, bal1);
            if (kt + 1 < nk)
                tile(kt + 1, k1, v1, bal1, k0, v0, bal0);
        }
    }

    /* ---- the warp's state: l summed over the row's 4 t-lanes (fixed order: every lane the same bits) ---- */
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
        l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    }
    /* ---- warps: through shared memory (red shares storage with q's fragments: wait for every warp) ---- */
    float *red = sm.u.red;
    auto put = [&](int slot) {
        float *r0 = red + (slot * HC + g) * RS + 8 * t, *r1 = r0 + 8 * RS;
#pragma unroll
        for (int c = 0; c < NC; c++) {
            *(float4 *)(r0 + 32 * c) = make_float4(o[c][0][0], o[c][0][1], o[c][1][0], o[c][1][1]);
            *(float4 *)(r0 + 32 * c + 4) = make_float4(o[c][2][0], o[c][2][1], o[c][3][0], o[c][3][1]);
            *(float4 *)(r1 + 32 * c) = make_float4(o[c][0][2], o[c][0][3], o[c][1][2], o[c][1][3]);
            *(float4 *)(r1 + 32 * c + 4) = make_float4(o[c][2][2], o[c][2][3], o[c][3][2], o[c][3][3]);
        }
        if (t == 0) {
            sm.red_m[slot][g] = m[0];
            sm.red_l[slot][g] = l[0];
            sm.red_m[slot][g + 8] = m[1];
            sm.red_l[slot][g + 8] = l[1];
        }
    };
    __syncthreads();
    static_assert(NSLOT == NW_, "one slot per warp");
    put(w);
    __syncthreads();

    /* ==== from here: the epilogue of decode.cuh's kernel, copied with HC = 16 rows, NW = NSLOT warp
     * states, row stride RS, and loops over the nh valid rows only. A COPY of verified code: after
     * this kernel is verified on a GPU, the next session factors one shared epilogue out of both. ==== */
    if (tid < HC) {
        const int h = tid;
        float M = NEG_INF;
#pragma unroll
        for (int i = 0; i < NSLOT; i++)
            M = fmaxf(M, sm.red_m[i][h]);
        const float Mu = M == NEG_INF ? 0.f : M;
        float Ls = 0.f;
#pragma unroll
        for (int i = 0; i < NSLOT; i++) {
            const float wt = ex2(sm.red_m[i][h] - Mu);
            sm.wts[i][h] = wt;
            Ls += wt * sm.red_l[i][h];
        }
        sm.hM[h] = M;
        sm.hL[h] = Ls;
        sm.hPrior[h] = (a.accumulate && a.S == 1 && h < nh)
                           ? a.lse[(long long)b * a.lse_sb + (long long)(hq0 + h) * a.lse_sh]
                           : 0.f;
    }
    __syncthreads();

    constexpr int D4 = D / 4;
    const int ITEMS = nh * D4;

    /* the final state of head h (log2 domain, O unnormalized) into out / lse */
    auto finalize = [&](int h, int d4, float4 O, float M, float Ls, float prior) {
        if (h >= nh)
            return;
        const long long hq = hq0 + h;
        float *lsep = a.lse + (long long)b * a.lse_sb + hq * a.lse_sh;
        const int es = a.out_dtype == GVR_ELEM_F32 ? 4 : 2;
        char *op = (char *)a.out + (long long)es * ((long long)b * a.out_sb + hq * a.out_sh + d4 * 4);
        const bool empty = M == NEG_INF;
        if (!a.accumulate) {
            float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
            float lv = NEG_INF;
            if (!empty) {
                const float inv = 1.f / Ls;
                val = make_float4(O.x * inv, O.y * inv, O.z * inv, O.w * inv);
                lv = (M + log2f(Ls)) * LN2;
            }
            store4(op, a.out_dtype, a.out_vec, val);
            if (d4 == 0)
                *lsep = lv;
            return;
        }
        if (empty)
            return; /* the prior state stays bit-identical */
        const float inv = 1.f / Ls;
        const float4 vnew = make_float4(O.x * inv, O.y * inv, O.z * inv, O.w * inv);
        const float lb = (M + log2f(Ls)) * LN2, la = prior;
        float4 val = vnew;
        float lv = lb;
        if (la != NEG_INF) {
            const float mm = la > lb ? la : lb;
            const float wa = expf(la - mm), wb = expf(lb - mm), ws = wa + wb;
            const float4 va = load4f((const float *)op, a.out_vec);
            val = make_float4((wa * va.x + wb * vnew.x) / ws, (wa * va.y + wb * vnew.y) / ws,
                              (wa * va.z + wb * vnew.z) / ws, (wa * va.w + wb * vnew.w) / ws);
            lv = mm + logf(ws);
        }
        store4(op, GVR_ELEM_F32, a.out_vec, val);
        if (d4 == 0)
            *lsep = lv;
    };

    if (a.S == 1) {
        for (int it = tid; it < ITEMS; it += MMA_THREADS) {
            const int h = it / D4, d4 = it - h * D4;
            float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int i = 0; i < NSLOT; i++)
                O = fma4(sm.wts[i][h], *(const float4 *)(red + (i * HC + h) * RS + d4 * 4), O);
            finalize(h, d4, O, sm.hM[h], sm.hL[h], sm.hPrior[h]);
        }
        return;
    }

    /* ---- S > 1: this split's state to the workspace; the last CTA of the unit merges ---- */
    const long long us = unit * a.S;
    for (int it = tid; it < ITEMS; it += MMA_THREADS) {
        const int h = it / D4, d4 = it - h * D4;
        float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < NSLOT; i++)
            O = fma4(sm.wts[i][h], *(const float4 *)(red + (i * HC + h) * RS + d4 * 4), O);
        __stcg((float4 *)(a.ws_o + ((us + s) * HC + h) * D + d4 * 4), O);
    }
    if (tid < nh)
        __stcg((float2 *)(a.ws_ml + ((us + s) * HC + tid) * 2), make_float2(sm.hM[tid], sm.hL[tid]));
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const int prev = atomicAdd(a.ws_cnt + unit, 1);
        sm.last = prev == a.S - 1;
    }
    __syncthreads();
    if (!sm.last)
        return;
    __threadfence();
    if (tid == 0)
        a.ws_cnt[unit] = 0; /* every split has arrived: the workspace is zero again after this launch */
    /* per head: the splits' maxima and weights, lane i holding splits i and i + 32 (S <= 64), reduced by
     * fixed butterflies (the same tree every time: deterministic) */
    static_assert(MAX_SPLITS <= 64, "two splits per lane");
    for (int h = w; h < nh; h += NW_) {
        const float2 *ml = (const float2 *)a.ws_ml + us * HC + h;
        float mv[2], lv[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int si = lane + 32 * k;
            mv[k] = NEG_INF;
            lv[k] = 0.f;
            if (si < a.S) {
                const float2 st = __ldcg(ml + (long long)si * HC);
                mv[k] = st.x;
                lv[k] = st.y;
            }
        }
        float M = fmaxf(mv[0], mv[1]);
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1)
            M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
        const float Mu = M == NEG_INF ? 0.f : M;
        float Ls = 0.f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int si = lane + 32 * k;
            const float wt = ex2(mv[k] - Mu);
            if (si < a.S)
                sm.wts[si][h] = wt;
            Ls = fmaf(wt, lv[k], Ls);
        }
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1)
            Ls += __shfl_xor_sync(0xffffffffu, Ls, off);
        if (lane == 0) {
            sm.hM[h] = M;
            sm.hL[h] = Ls;
            sm.hPrior[h] = a.accumulate ? a.lse[(long long)b * a.lse_sb + (long long)(hq0 + h) * a.lse_sh] : 0.f;
        }
    }
    __syncthreads();
    for (int it = tid; it < ITEMS; it += MMA_THREADS) {
        const int h = it / D4, d4 = it - h * D4;
        const float *src = a.ws_o + (us * HC + h) * D + d4 * 4;
        float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int i = 0; i < a.S; i++)
            O = fma4(sm.wts[i][h], __ldcg((const float4 *)(src + (long long)i * HC * D)), O);
        finalize(h, d4, O, sm.hM[h], sm.hL[h], sm.hPrior[h]);
    }
}

template <int ELEM, int D>
cudaError_t DecodeMmaInstance<ELEM, D>::launch(const DecodeArgs &a, unsigned grid, cudaStream_t stream)
{
    LaunchConfig lc(grid, MMA_THREADS, 0, 0, stream);
    return cudaLaunchKernelEx(&lc.cfg, gvr_attention_decode_mma_kernel<ELEM, D>, a);
}

#endif /* __CUDACC__ && GVR_DECODE_KERNELS && GVR_DECODE_MMA_KERNELS */

} // namespace gvr::attn

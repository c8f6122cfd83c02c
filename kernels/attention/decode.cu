/* decode.cu: the entry points of sparse attention (gvr_kernels.h): gvr_sparse_attention and
 * gvr_sparse_attention_workspace_size. This file only plans and dispatches; the kernel is in
 * decode.cuh, its instances in decode_d64.cu, decode_d128.cu, decode_d256.cu.
 *
 * Plan (shapes and SM count only, so the result is bit-identical run after run):
 *  - heads: the GQA group of GQ = Hq / Hkv query heads in nch = ceil(GQ / 8) chunks of HC heads, HC the
 *    power of two in {1, 2, 4, 8} at least ceil(GQ / nch) (heads past GQ computed, never written);
 *  - units = B * Hkv * nch; splits S of each unit's entries (flash-decoding): the most that keep the
 *    grid in one wave (floor(resident CTAs / units), resident_ctas(HC) per SM: measured on the H100,
 *    a second wave costs more than the split work saves; 1 when the units fill half a wave), at most
 *    the entries, at most ceil(tokens / MIN_SPLIT_TOKENS), at most MAX_SPLITS;
 *  - grid = units * S CTAs of 128 threads, a unit's splits consecutive; when the grid fits in one CTA
 *    per SM and S <= MAX_CLUSTER (and the device runs such clusters) the splits are one cluster, merged
 *    in rank 0's shared memory (no workspace; H100: repair of 8 blocks 9.5 -> 8.1 us cold); otherwise
 *    workspace (S > 1): the split states and one counter per unit.
 * MIN_SPLIT_TOKENS 64 (measured on the H100, 2026-11-23: B=1, 1K tokens 15.8 -> 14.5 us cold against 128,
 * no change at 4K/8K/B=64, 32 and 16 no better). A tensor-core variant (mma.sync for q.K and P.V) and a
 * cp.async ring of 4 steps of K/V per CTA were measured and dropped: no faster at B=1 (28.1 vs 27.7 us at
 * 8K; the ring 32.6), the ring slower at B=64; a tensor-core path again in 2026-11 (session 16,
 * scripts/patches/decode_mma.diff): 0.2 us faster warm at 1K, 0.3-1.1 us slower cold, 3% at B=64. */
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attention/decode.cuh"
#include "common/device.cuh"
#include "common/runtime.cuh"
#include "gvr_kernels.h"

#define GVR_API extern "C" __attribute__((visibility("default")))

namespace gvr::attn {
namespace {

#ifndef GVR_DECODE_MIN_SPLIT_TOKENS
#define GVR_DECODE_MIN_SPLIT_TOKENS 64
#endif
constexpr long long MIN_SPLIT_TOKENS = GVR_DECODE_MIN_SPLIT_TOKENS;

struct Plan {
    int HC, nch, S;
    int part_cta; /* partials through the token path, one entry per CTA (DecodeArgs::part_cta) */
    int cl; /* > 1: the S splits of a unit are one cluster, merged in rank 0's shared memory (no workspace) */
    long long units;
    size_t cnt_bytes, o_bytes, ml_bytes; /* workspace parts (0 when S == 1) */
    size_t ws_bytes;
};

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

Plan make_plan(const gvr_attention_params *p, int sms)
{
    Plan g{};
    const int GQ = p->Hkv > 0 ? p->Hq / p->Hkv : 1;
    g.nch = (GQ + 7) / 8;
    const int per = (GQ + g.nch - 1) / g.nch;
    g.HC = per <= 1 ? 1 : per <= 2 ? 2 : per <= 4 ? 4 : 8;
    g.units = (long long)p->B * p->Hkv * g.nch;
    const long long G = p->block_table ? p->block_size : 1;
    const long long tokens = (long long)p->n * G;
    long long S = 1;
    /* one wave: the CTAs resident at once (the instances' __launch_bounds__ guarantee) */
    const int most = resident_ctas(1) > resident_ctas(8) ? resident_ctas(1) : resident_ctas(8);
    const int res = resident_ctas(g.HC);
    const long long target = (long long)res * (sms > 0 ? sms : 1);
    if (g.units > 0 && 2 * g.units <= target && p->n > 1) {
        S = target / g.units;
        const long long by_tok = (tokens + MIN_SPLIT_TOKENS - 1) / MIN_SPLIT_TOKENS;
        if (S > by_tok)
            S = by_tok;
        if (S > p->n)
            S = p->n;
        if (S > MAX_SPLITS)
            S = MAX_SPLITS;
        if (S < 1)
            S = 1;
    }
    /* partials: one entry per CTA through the token path (all of a CTA's warps on the entry's tokens) when
     * the entries fit the splits and the grid stays within two waves; otherwise the PART instances (one
     * sub-warp per entry: H100, B=1, 64 entries of 64 tokens: ~51 us against ~20 for the same attention
     * without partials) */
    if (p->part_out && p->n >= 1 && p->n <= MAX_SPLITS && g.units * p->n <= 2 * target) {
        S = p->n;
        g.part_cta = 1;
    }
    g.S = (int)S;
    if (g.S > 1) {
        /* the counters sit in one fixed region at the start, the same for every plan on this device
         * (units <= target / 2 whenever S > 1): only the counters must be zero between calls (each
         * call resets its own), and no call's split states ever land on another call's counters */
        g.cnt_bytes = round_up((size_t)((long long)most * (sms > 0 ? sms : 1) / 2 + 1) * sizeof(int), 256);
        g.o_bytes = round_up((size_t)g.units * g.S * g.HC * p->D * sizeof(float), 256);
        g.ml_bytes = round_up((size_t)g.units * g.S * g.HC * 2 * sizeof(float), 256);
        g.ws_bytes = g.cnt_bytes + g.o_bytes + g.ml_bytes;
    }
    return g;
}

/* f(instance) for the instance of (q element type, cache element type, mode, D, HC) */
template <int ELEM, int KVE, int D, int MODE, class F>
auto visit_hc(int HC, F &&f)
{
    switch (HC) {
    case 1: return f(DecodeInstance<ELEM, KVE, D, 1, MODE>{});
    case 2: return f(DecodeInstance<ELEM, KVE, D, 2, MODE>{});
    case 4: return f(DecodeInstance<ELEM, KVE, D, 4, MODE>{});
    default: return f(DecodeInstance<ELEM, KVE, D, 8, MODE>{});
    }
}

template <int ELEM, int KVE, int MODE, class F>
auto visit_d(int D, int HC, F &&f)
{
    switch (D) {
    case 64: return visit_hc<ELEM, KVE, 64, MODE>(HC, f);
    case 128: return visit_hc<ELEM, KVE, 128, MODE>(HC, f);
    default: return visit_hc<ELEM, KVE, 256, MODE>(HC, f);
    }
}

template <int ELEM, int KVE, class F>
auto visit_mode(int mode, int D, int HC, F &&f)
{
    switch (mode) {
    case DECODE_PART: return visit_d<ELEM, KVE, DECODE_PART>(D, HC, f);
    case DECODE_EXTRA: return visit_d<ELEM, KVE, DECODE_EXTRA>(D, HC, f);
    default: return visit_d<ELEM, KVE, DECODE_PLAIN>(D, HC, f);
    }
}

template <class F>
auto visit_instance(int elem, int kv, int mode, int D, int HC, F &&f)
{
    if (kv == GVR_ELEM_E4M3)
        return elem == GVR_ELEM_F16 ? visit_mode<GVR_ELEM_F16, GVR_ELEM_E4M3>(mode, D, HC, f)
                                    : visit_mode<GVR_ELEM_BF16, GVR_ELEM_E4M3>(mode, D, HC, f);
    if (elem == GVR_ELEM_F16)
        return visit_mode<GVR_ELEM_F16, GVR_ELEM_F16>(mode, D, HC, f);
    return visit_mode<GVR_ELEM_BF16, GVR_ELEM_BF16>(mode, D, HC, f);
}

/* the kernel mode of a call: partials through the sub-warp path, prr.repair's extras, or plain */
int mode_of(const gvr_attention_params *p, const Plan &g)
{
    if (p->part_out && !g.part_cta)
        return DECODE_PART;
    if (p->accumulate && !p->part_out && ((p->exclude && p->nx > 0) || p->counts || p->cast_out))
        return DECODE_EXTRA;
    return DECODE_PLAIN;
}

bool aligned(const void *ptr, size_t a) { return ((uintptr_t)ptr % a) == 0; }

cudaError_t plan_for(const gvr_attention_params *p, Plan *g)
{
    int dev = 0, sms = 0;
    cudaError_t e = current_device(&dev);
    if (e == cudaSuccess)
        e = sm_count(dev, &sms);
    if (e != cudaSuccess)
        return e;
    *g = make_plan(p, sms);
    /* latency-bound plans (the grid within one CTA per SM) merge their splits in a cluster when one holds
     * them and the device can run it: no workspace, no global round trips for the merge */
    const int C = g->S;
    const bool dtype_ok = (p->dtype == GVR_ELEM_F16 || p->dtype == GVR_ELEM_BF16) &&
                          (p->kv_dtype == p->dtype || p->kv_dtype == GVR_ELEM_E4M3);
    if (C > 1 && C <= MAX_CLUSTER && g->units * C <= sms && dtype_ok && gvr_attention_cuda_head_dim_ok(p->D) &&
        visit_instance(p->dtype, p->kv_dtype, mode_of(p, *g), p->D, g->HC,
                       [&](auto inst) { return inst.cluster_ok(dev, C); })) {
        g->cl = C;
        g->cnt_bytes = g->o_bytes = g->ml_bytes = g->ws_bytes = 0;
    }
    return cudaSuccess;
}

} // namespace
} // namespace gvr::attn

using namespace gvr::attn;

GVR_API size_t gvr_sparse_attention_workspace_size(const gvr_attention_params *p)
{
    if (p->B <= 0 || p->Hq <= 0 || p->Hkv <= 0)
        return 0;
    Plan g;
    if (plan_for(p, &g) != cudaSuccess)
        return 0; /* gvr_sparse_attention reports the failing query */
    return g.ws_bytes;
}

GVR_API int gvr_sparse_attention(const gvr_attention_params *p, void *workspace, size_t workspace_bytes, void *stream_)
{
    cudaStream_t stream = (cudaStream_t)stream_;
    if (p->B <= 0 || p->Hq <= 0)
        return 0;
    /* the intake (csrc/) enforces these; this only keeps a bad call from launching */
    if (p->dtype != GVR_ELEM_F16 && p->dtype != GVR_ELEM_BF16)
        return gvr::set_message(1, "gvr_sparse_attention: q must be float16 or bfloat16 on CUDA (dtype %d)", p->dtype);
    if (p->kv_dtype != p->dtype && p->kv_dtype != GVR_ELEM_E4M3)
        return gvr::set_message(1, "gvr_sparse_attention: k/v must have q's dtype or be fp8 e4m3 (kv_dtype %d)", p->kv_dtype);
    if (!gvr_attention_cuda_head_dim_ok(p->D))
        return gvr::set_message(1, "gvr_sparse_attention: head dim D = %d not served on CUDA (64, 128, 256)", p->D);
    if (p->Hkv <= 0 || p->Hq % p->Hkv || p->Hq / p->Hkv > GVR_ATTN_MAX_GQA)
        return gvr::set_message(1, "gvr_sparse_attention: Hq = %d, Hkv = %d: Hq must be a multiple of Hkv, at most %d times",
                                p->Hq, p->Hkv, GVR_ATTN_MAX_GQA);
    if (p->Hsel != 1 && p->Hsel != p->Hkv)
        return gvr::set_message(1, "gvr_sparse_attention: Hsel = %d must be 1 or Hkv = %d", p->Hsel, p->Hkv);
    if (p->out_dtype != GVR_ELEM_F32 && p->out_dtype != GVR_ELEM_F16 && p->out_dtype != GVR_ELEM_BF16)
        return gvr::set_message(1, "gvr_sparse_attention: out dtype %d", p->out_dtype);
    if (p->accumulate && p->out_dtype != GVR_ELEM_F32)
        return gvr::set_message(1, "gvr_sparse_attention: accumulate needs a float32 out");
    if (p->n < 0 || p->P <= 0 || p->num_pages < 0 || (p->block_table && (p->block_size < 1 || p->max_pages < 0)))
        return gvr::set_message(1, "gvr_sparse_attention: bad sizes (n = %d, P = %d, block_size = %d)", p->n, p->P,
                                p->block_size);
    if ((p->part_out != nullptr) != (p->part_lse != nullptr))
        return gvr::set_message(1, "gvr_sparse_attention: part_out and part_lse go together");
    if ((p->exclude || p->counts || p->cast_out) && (!p->accumulate || p->part_out))
        return gvr::set_message(1, "gvr_sparse_attention: exclude, counts and cast_out belong to a repair (accumulate, no partials)");
    if ((p->exclude && (p->nx < 0 || (p->Hx != 1 && p->Hx != p->Hsel))) || (p->counts && p->ncounts != 2 && p->ncounts != 4) ||
        (p->cast_out && p->cast_dtype != GVR_ELEM_F32 && p->cast_dtype != GVR_ELEM_F16 && p->cast_dtype != GVR_ELEM_BF16))
        return gvr::set_message(1, "gvr_sparse_attention: bad exclude (Hx = %d, nx = %d), counts (%d) or cast_out dtype (%d)",
                                p->Hx, p->nx, p->ncounts, p->cast_dtype);
    /* loads of 8 elements of K and V (16 bytes; fp8: 8): aligned bases, strides in multiples of 8 elements
     * (q is read element by element, once per CTA: any alignment) */
    const size_t piece = p->kv_dtype == GVR_ELEM_E4M3 ? 8 : 16;
    const bool k_ok = aligned(p->k, piece) && p->k_stride_page % 8 == 0 && p->k_stride_tok % 8 == 0 && p->k_stride_head % 8 == 0;
    const bool v_ok = aligned(p->v, piece) && p->v_stride_page % 8 == 0 && p->v_stride_tok % 8 == 0 && p->v_stride_head % 8 == 0;
    if (!k_ok || !v_ok)
        return gvr::set_message(1, "gvr_sparse_attention: %s must be %zu-byte aligned with strides in multiples of 8 "
                                "elements on CUDA", !k_ok ? "k_cache" : "v_cache", piece);

    Plan g;
    cudaError_t e = plan_for(p, &g);
    if (e != cudaSuccess)
        return gvr::set_error("gvr_sparse_attention: device query", e);
    if (g.ws_bytes > 0) {
        if (!workspace || workspace_bytes < g.ws_bytes)
            return gvr::set_message(1, "gvr_sparse_attention: workspace of %zu bytes, %zu needed "
                                    "(gvr_sparse_attention_workspace_size)", workspace ? workspace_bytes : (size_t)0,
                                    g.ws_bytes);
        if (!aligned(workspace, 16))
            return gvr::set_message(1, "gvr_sparse_attention: workspace must be 16-byte aligned");
    }
    const long long grid = g.units * g.S;
    if (grid <= 0)
        return 0;
    if (grid > 0x7fffffffLL)
        return gvr::set_message(1, "gvr_sparse_attention: %lld CTAs exceed the grid limit", grid);

    DecodeArgs a{};
    a.q = p->q;
    a.q_vec = aligned(p->q, 16) && p->q_stride_b % 8 == 0 && p->q_stride_h % 8 == 0;
    a.q_sb = p->q_stride_b;
    a.q_sh = p->q_stride_h;
    a.k = p->k;
    a.k_sp = p->k_stride_page;
    a.k_st = p->k_stride_tok;
    a.k_sh = p->k_stride_head;
    a.v = p->v;
    a.v_sp = p->v_stride_page;
    a.v_st = p->v_stride_tok;
    a.v_sh = p->v_stride_head;
    a.num_pages = p->num_pages;
    a.P = p->P;
    a.idx = p->indices;
    a.idx_sb = p->idx_stride_b;
    a.idx_sh = p->Hsel == 1 ? 0 : p->idx_stride_h;
    a.n = p->n;
    a.bt = p->block_table;
    a.bt_sb = p->block_table ? p->bt_stride_b : 0;
    a.max_pages = p->block_table ? p->max_pages : 0;
    a.lengths = p->block_table ? p->lengths : nullptr;
    a.G = p->block_table ? p->block_size : 1;
    a.qscale = p->scale * p->k_scale * 1.4426950408889634f; /* K' = k_scale * K folded into q */
    a.vscale = p->v_scale;
    a.out = p->out;
    a.out_dtype = p->out_dtype;
    a.out_sb = p->out_stride_b;
    a.out_sh = p->out_stride_h;
    {
        const int vec_elems = p->out_dtype == GVR_ELEM_F32 ? 4 : 4; /* 4 elements: 16 or 8 bytes */
        const size_t vec_bytes = p->out_dtype == GVR_ELEM_F32 ? 16 : 8;
        a.out_vec = aligned(p->out, vec_bytes) && p->out_stride_b % vec_elems == 0 && p->out_stride_h % vec_elems == 0;
    }
    a.lse = p->lse;
    a.lse_sb = p->lse_stride_b;
    a.lse_sh = p->lse_stride_h;
    a.accumulate = p->accumulate != 0;
    a.part_out = p->part_out;
    a.po_sb = p->part_out_stride_b;
    a.po_sh = p->part_out_stride_h;
    a.po_se = p->part_out_stride_e;
    a.po_vec = p->part_out && aligned(p->part_out, 16) && p->part_out_stride_b % 4 == 0 &&
               p->part_out_stride_h % 4 == 0 && p->part_out_stride_e % 4 == 0;
    a.part_lse = p->part_lse;
    a.pl_sb = p->part_lse_stride_b;
    a.pl_sh = p->part_lse_stride_h;
    if (p->accumulate && !p->part_out) {
        a.xidx = p->nx > 0 ? p->exclude : nullptr;
        a.x_sb = p->exc_stride_b;
        a.x_sh = p->Hx == 1 ? 0 : p->exc_stride_h;
        a.nx = p->nx;
        a.counts = (unsigned long long *)p->counts;
        a.ncounts = p->ncounts;
        a.cast = p->cast_out;
        a.cast_dtype = p->cast_dtype;
        a.cast_sb = p->cast_stride_b;
        a.cast_sh = p->cast_stride_h;
        a.cast_vec = p->cast_out && aligned(p->cast_out, p->cast_dtype == GVR_ELEM_F32 ? 16 : 8) &&
                     p->cast_stride_b % 4 == 0 && p->cast_stride_h % 4 == 0;
    }
    a.count_all = p->Hsel != 1;
    a.Hkv = p->Hkv;
    a.GQ = p->Hq / p->Hkv;
    a.nch = g.nch;
    a.S = g.S;
    a.cl = g.cl;
    {
        auto lg2 = [](long long v) { return v > 0 && (v & (v - 1)) == 0 ? __builtin_ctzll((unsigned long long)v) : -1; };
        a.g_shift = lg2(a.G);
        a.p_shift = lg2(a.P);
        const long long lim = 1LL << 31;
        a.i32 = (long long)a.n * a.G < lim && (long long)a.S * a.n < lim && (long long)a.max_pages * a.P < lim &&
                a.num_pages * a.P < lim;
    }
    a.part_cta = g.part_cta;
    if (g.S > 1 && g.cl <= 1) {
        char *ws = (char *)workspace;
        a.ws_cnt = (int *)ws;
        a.ws_o = (float *)(ws + g.cnt_bytes);
        a.ws_ml = (float *)(ws + g.cnt_bytes + g.o_bytes);
    }
    e = visit_instance(p->dtype, p->kv_dtype, mode_of(p, g), p->D, g.HC,
                       [&](auto inst) { return inst.launch(a, (unsigned)grid, g.cl, stream); });
    if (e != cudaSuccess)
        return gvr::set_error("gvr_sparse_attention: kernel launch", e);
    return 0;
}

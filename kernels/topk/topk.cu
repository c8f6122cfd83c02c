/* topk.cu: the entry points of topk_decode (gvr_kernels.h): exact decode-time Top-K of B rows of
 * fp32 scores. This file only plans: it picks the method (AUTO: radix for N <= 4096, GVR above; the
 * same result either way), the geometry (cluster size C, float4s per thread VEC, streamed chunks),
 * and calls the launcher of the instance (topk/launch.h), then the sort kernel for sorted=1.
 *
 * Every path computes, for each row b (length len_b), the min(k, len_b) first elements of the order
 * (value descending, -0 == +0, -inf valid, NaN below -inf, ties to the lower index) as int32
 * indices, then -1 padding; bit-identical to csrc/ as a set, in a deterministic order (sorted when
 * asked). One cluster of C CTAs of 512 threads per row:
 *  - radix (radix.cuh): the row in registers, 11/11/10-bit digit rounds;
 *  - GVR (gvr.cuh): a guess from the previous step's Top-K or a sample, value-bin rounds exchanged
 *    with st.async, exact ranking of the few candidates left; rows too long for the registers of a
 *    resident grid are streamed from memory chunk by chunk;
 *  - sort (sort.cuh): a CUB block radix sort of each row's selection. */
#include <cuda_runtime.h>

#include "common/device.cuh"
#include "common/runtime.cuh"
#include "gvr_kernels.h"
#include "topk/launch.h"

#define GVR_API extern "C" __attribute__((visibility("default")))

namespace gvr::topk {
namespace {

#ifdef GVR_PROFILE
/* the stamps of the last launch's translation unit (common/profile.cuh) */
cudaError_t (*g_prof_read)(long long *) = nullptr;
#endif

/* ---- GVR ---------------------------------------------------------------------------------------- */

struct GvrGeometry {
    int C, vec, nch;
    bool stream;
};

/* f(GvrInstance<C > 1, vec, stream>{}) for vec in GVR_TILE_VECS (stream false) or GVR_STREAM_VEC */
template <bool CLUSTER, class F>
auto visit_gvr_vec(int vec, bool stream, F &&f)
{
    if (stream)
        return f(GvrInstance<CLUSTER, GVR_STREAM_VEC, true>{});
    switch (vec) {
    case 2: return f(GvrInstance<CLUSTER, 2, false>{});
    case 3: return f(GvrInstance<CLUSTER, 3, false>{});
    case 4: return f(GvrInstance<CLUSTER, 4, false>{});
    case 5: return f(GvrInstance<CLUSTER, 5, false>{});
    case 6: return f(GvrInstance<CLUSTER, 6, false>{});
    case 8: return f(GvrInstance<CLUSTER, 8, false>{});
    case 9: return f(GvrInstance<CLUSTER, 9, false>{});
    case 10: return f(GvrInstance<CLUSTER, 10, false>{});
    default: return f(GvrInstance<CLUSTER, 12, false>{});
    }
}

template <class F>
auto visit_gvr(int C, int vec, bool stream, F &&f)
{
    return C > 1 ? visit_gvr_vec<true>(vec, stream, f) : visit_gvr_vec<false>(vec, stream, f);
}

int gvr_resident_rows(int dev, int C, int vec, bool stream)
{
    return visit_gvr(C, vec, stream, [&](auto inst) { return decltype(inst)::resident_rows(dev, C); });
}

/* The row held in registers by the smallest VEC whose cluster (at most 16 CTAs) holds it while all B
 * rows run at once (one wave); else the row streamed in chunks by the largest cluster (at most 8)
 * that keeps one wave, or one CTA per row. */
cudaError_t plan_gvr(const gvr_topk_params *p, int dev, GvrGeometry *g)
{
    const long long npos = gvr_topk_row_positions(p);
    for (int v : GVR_TILE_VECS) {
        const long long c = (npos + THREADS * 4 * v - 1) / (THREADS * 4 * v);
        if (c <= MAX_C && p->B <= gvr_resident_rows(dev, (int)c, v, false)) {
            *g = GvrGeometry{(int)c, v, 1, false};
            return cudaSuccess;
        }
    }
    int sms = 0;
    const cudaError_t e = sm_count(dev, &sms);
    if (e != cudaSuccess)
        return e;
    constexpr long long PS = THREADS * 4 * GVR_STREAM_VEC;
    const long long chunks = (npos + PS - 1) / PS;
    int C = sms / (p->B > 0 ? p->B : 1); /* one CTA per SM */
    C = C < 1 ? 1 : (C > GVR_STREAM_MAX_C ? GVR_STREAM_MAX_C : C);
    if (C > chunks)
        C = (int)chunks;
    while (C > 1 && p->B > gvr_resident_rows(dev, C, GVR_STREAM_VEC, true))
        C--;
    *g = GvrGeometry{C, GVR_STREAM_VEC, (int)((chunks + C - 1) / C), true};
    return cudaSuccess;
}

/* ---- radix -------------------------------------------------------------------------------------- */

/* The smallest per-thread share (float4s held in registers) whose cluster size (at most 16) holds
 * the row while the grid stays within about two CTAs per SM; otherwise the fewest CTAs per row. */
cudaError_t plan_radix(const gvr_topk_params *p, int dev, int *C_out, int *vec_out)
{
    int sms = 0;
    const cudaError_t e = sm_count(dev, &sms);
    if (e != cudaSuccess)
        return e;
    const long long npos = gvr_topk_row_positions(p);
    int C = 0, vec = 0;
    for (int v = 2; v <= RADIX_MAX_VEC && !C; v *= 2) {
        int c = 1;
        while ((long long)c * THREADS * 4 * v < npos)
            c *= 2;
        if (c <= MAX_C && (long long)p->B * c <= 2LL * sms) {
            C = c;
            vec = v;
        }
    }
    if (!C) {
        vec = RADIX_MAX_VEC;
        C = 1;
        while ((long long)C * THREADS * 4 * vec < npos)
            C *= 2;
    }
    *C_out = C;
    *vec_out = vec;
    return cudaSuccess;
}

template <int C>
cudaError_t launch_radix_vec(const gvr_topk_params *p, int dev, int vec, cudaStream_t stream)
{
    switch (vec) {
    case 2: return RadixInstance<C, 2>::launch(p, dev, stream);
    case 4: return RadixInstance<C, 4>::launch(p, dev, stream);
    case 8: return RadixInstance<C, 8>::launch(p, dev, stream);
    default: return RadixInstance<C, 16>::launch(p, dev, stream);
    }
}

#ifdef GVR_PROFILE
template <int C>
void note_radix_profile(int vec)
{
    switch (vec) {
    case 2: g_prof_read = RadixInstance<C, 2>::profile_read; break;
    case 4: g_prof_read = RadixInstance<C, 4>::profile_read; break;
    case 8: g_prof_read = RadixInstance<C, 8>::profile_read; break;
    default: g_prof_read = RadixInstance<C, 16>::profile_read; break;
    }
}
#endif

cudaError_t launch_radix(const gvr_topk_params *p, int dev, int C, int vec, cudaStream_t stream)
{
#ifdef GVR_PROFILE
    switch (C) {
    case 1: note_radix_profile<1>(vec); break;
    case 2: note_radix_profile<2>(vec); break;
    case 4: note_radix_profile<4>(vec); break;
    case 8: note_radix_profile<8>(vec); break;
    default: note_radix_profile<16>(vec); break;
    }
#endif
    switch (C) {
    case 1: return launch_radix_vec<1>(p, dev, vec, stream);
    case 2: return launch_radix_vec<2>(p, dev, vec, stream);
    case 4: return launch_radix_vec<4>(p, dev, vec, stream);
    case 8: return launch_radix_vec<8>(p, dev, vec, stream);
    default: return launch_radix_vec<16>(p, dev, vec, stream);
    }
}

} // namespace
} // namespace gvr::topk

using namespace gvr::topk;

GVR_API size_t gvr_topk_decode_workspace_size(const gvr_topk_params *p)
{
    (void)p;
    return 0;
}

GVR_API int gvr_topk_decode(const gvr_topk_params *p_in, void *workspace, size_t workspace_bytes, void *stream_)
{
    (void)workspace;
    (void)workspace_bytes;
    cudaStream_t stream = (cudaStream_t)stream_;
    if (p_in->B == 0 || p_in->k == 0)
        return 0;
    /* AUTO leaves the previous step's Top-K out: on the H100 the sample's guess measured as fast or faster
     * at every overlap of consecutive Top-K sets (2-95%, B 1/8/64, N 32K-256K; benchmarks/RESULTS.md, the
     * hint-quality sweep), and the hint up to 1.8x slower at B 64 -- a prediction must never cost time.
     * Method GVR forced still takes it. */
    gvr_topk_params q = *p_in;
    if (q.method == GVR_TOPK_AUTO) {
        q.prev = nullptr;
        q.Kp = 0;
    }
    const gvr_topk_params *p = &q;
    /* AUTO: the GVR kernel, except for rows that one CTA's registers hold at two float4s per thread,
     * where the radix path's single-CTA digit rounds measured faster on an H100 */
    const int method = p->method != GVR_TOPK_AUTO ? p->method : p->N <= AUTO_RADIX_MAX_N ? GVR_TOPK_RADIX : GVR_TOPK_GVR;
    /* the intake (csrc/) enforces the limits; this only keeps a bad call from launching */
    if (p->N > GVR_TOPK_MAX_N || (p->sorted && p->k > GVR_TOPK_SORTED_MAX_K) ||
        (method != GVR_TOPK_GVR && gvr_topk_row_positions(p) > GVR_RADIX_MAX_POSITIONS))
        return gvr::set_message(1, "gvr_topk_decode: parameters beyond the limits of gvr_kernels.h");
    int dev = 0;
    cudaError_t e = gvr::current_device(&dev);
    if (e != cudaSuccess)
        return gvr::set_error("gvr_topk_decode: cudaGetDevice", e);
    if (method == GVR_TOPK_GVR) {
        GvrGeometry g;
        e = plan_gvr(p, dev, &g);
        if (e != cudaSuccess)
            return gvr::set_error("gvr_topk_decode: device query", e);
        e = visit_gvr(g.C, g.vec, g.stream, [&](auto inst) {
#ifdef GVR_PROFILE
            g_prof_read = decltype(inst)::profile_read;
#endif
            return decltype(inst)::launch(p, dev, g.C, g.nch, stream);
        });
        if (e != cudaSuccess)
            return gvr::set_error("gvr_topk_decode: GVR kernel launch", e);
    } else {
        int C = 0, vec = 0;
        e = plan_radix(p, dev, &C, &vec);
        if (e != cudaSuccess)
            return gvr::set_error("gvr_topk_decode: device query", e);
        e = launch_radix(p, dev, C, vec, stream);
        if (e != cudaSuccess)
            return gvr::set_error("gvr_topk_decode: radix kernel launch", e);
    }
    if (p->sorted) {
        e = sort_launch(p, stream);
        if (e != cudaSuccess)
            return gvr::set_error("gvr_topk_decode: sort kernel launch", e);
    }
    return 0;
}

#ifdef GVR_PROFILE
/* debug builds only (scripts/profile_phases.py): the phase stamps of the last Top-K launch */
GVR_API int gvr_debug_clocks(long long *host)
{
    return g_prof_read ? (int)g_prof_read(host) : (int)cudaErrorInvalidValue;
}
#endif

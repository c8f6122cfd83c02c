/* PRR's selection stage: the specs, CPU calls and CUDA calls of Quest's block metadata (build and
 * in-place update) and block scores. Semantics: kernels/gvr_kernels.h, section "PRR selection stage".
 * select_blocks is block_scores (with counts, and with scores_out: the scores before the keep ranges
 * from the same pass) followed by topk_decode, composed in gvr/_prr_select.py. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "cpu/prr_select_cpu.h"
#include "cuda_lib.h"
#include "dispatch.h"
#include "intake.h"
#include "ops.h"

#define FLOATS (GVR_DT(GVR_DTYPE_F32) | GVR_DT(GVR_DTYPE_F16) | GVR_DT(GVR_DTYPE_BF16))
#define I32 GVR_DT(GVR_DTYPE_I32)
#define F32 GVR_DT(GVR_DTYPE_F32)
#define F8 GVR_DT(GVR_DTYPE_F8E4M3)
#define ON_CALL (GVR_HOST | GVR_DEVICE)

/* a CUDA buffer the kernels read in 16-byte pieces: aligned start, strides in multiples of 16 bytes */
static int check_vec16(const char *name, const void *ptr, const int64_t *s, int n, int itemsize)
{
    const int per = 16 / (itemsize > 0 ? itemsize : 1); /* elements per 16 bytes */
    int ok = (uintptr_t)ptr % 16 == 0;
    for (int i = 0; i < n; i++)
        ok &= s[i] % per == 0;
    if (ok)
        return 0;
    char buf[160] = "";
    size_t at = 0;
    for (int i = 0; i < n && at < sizeof buf; i++)
        at += (size_t)snprintf(buf + at, sizeof buf - at, "%s%lld", i ? ", " : "", (long long)s[i]);
    PyErr_Format(PyExc_ValueError, "'%s' on CUDA must start on a 16-byte boundary with strides in multiples of %d "
                 "elements (16 bytes), got address %% 16 = %d and strides (%s)", name, per, (int)((uintptr_t)ptr % 16),
                 buf);
    return -1;
}

static int check_cuda_dtype_and_d(const gvr_view *v, const char *name, int D)
{
    if (v->dtype == GVR_DTYPE_F32) {
        PyErr_Format(PyExc_ValueError, "'%s' on CUDA must be float16 or bfloat16 (float32 is served on the CPU), got "
                     "float32", name);
        return -1;
    }
    if (D != 64 && D != 128 && D != 256) {
        PyErr_Format(PyExc_ValueError, "'%s' on CUDA must have head dim D = 64, 128 or 256, got D = %d", name, D);
        return -1;
    }
    return 0;
}

static int parse_block_size(PyObject *o, int32_t *bs)
{
    Py_ssize_t v;
    if (!o || o == Py_None) {
        PyErr_SetString(PyExc_TypeError, "'block_size' must be given (the metadata block size G, in tokens)");
        return -1;
    }
    if (gvr_parse_int(o, "block_size", &v) < 0)
        return -1;
    if (v < 1 || v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "'block_size' must lie in [1, %d], got %zd", INT32_MAX, v);
        return -1;
    }
    *bs = (int32_t)v;
    return 0;
}

/* ================================================================================================
 * block metadata (build; update in place with start)
 * ================================================================================================ */

enum { MK, MBT, MLEN, MST, MMETA, META_NARGS };

static const gvr_arg_spec build_args[META_NARGS] = {
    [MK] = {"k_cache", FLOATS | F8, "num_pages,P,Hkv,D", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [MBT] = {"block_table", I32, "B,max_pages", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [MLEN] = {"lengths", I32, "B", ON_CALL, GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [MST] = {"start", I32, "B", ON_CALL, GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [MMETA] = {"out", FLOATS | F8, "B,Hkv,Nb,2,D", ON_CALL, GVR_OUTPUT | GVR_UNIT_LAST, "k_cache", NULL},
};
static const gvr_spec build_spec = {"prr.block_metadata", META_NARGS, build_args};

static const gvr_arg_spec update_args[META_NARGS] = {
    [MK] = {"k_cache", FLOATS | F8, "num_pages,P,Hkv,D", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [MBT] = {"block_table", I32, "B,max_pages", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [MLEN] = {"end", I32, "B", ON_CALL, GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [MST] = {"start", I32, "B", ON_CALL, GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [MMETA] = {"meta", FLOATS | F8, "B,Hkv,Nb,2,D", ON_CALL, GVR_OUTPUT | GVR_UNIT_LAST, "k_cache", NULL},
};
static const gvr_spec update_spec = {"prr.update_block_metadata", META_NARGS, update_args};

const char gvr_block_metadata_doc[] =
    "block_metadata(k_cache, block_table, lengths, out, block_size, start, stream, nosync)\n--\n\n"
    "Quest block metadata (per-block, per-KV-head, per-channel min and max of the keys) into out\n"
    "[B, Hkv, Nb, 2, D]; with start: update in place with the tokens [start, lengths) of each row.\n"
    "See gvr.prr.block_metadata and gvr.prr.update_block_metadata.";

static int cpu_meta(const void *p) { return prr_block_metadata_cpu((const gvr_block_meta_params *)p); }

static int cuda_meta(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    (void)ws;
    (void)ws_bytes;
    return cu->prr_block_metadata((const gvr_block_meta_params *)p, stream);
}

PyObject *gvr_py_block_metadata(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"k_cache", "block_table", "lengths", "out", "block_size", "start", "stream", "nosync",
                             NULL};
    PyObject *obj[META_NARGS] = {Py_None, Py_None, Py_None, Py_None, Py_None};
    PyObject *o_bs = NULL, *o_stream = Py_None, *o_nosync = NULL, *result = NULL;
    int32_t *copy = NULL;
    gvr_intake in;
    gvr_intake_init(&in);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OOOOOO:block_metadata", kwlist, &obj[MK], &obj[MBT], &obj[MLEN],
                                     &obj[MMETA], &o_bs, &obj[MST], &o_stream, &o_nosync))
        return NULL;
    const int update = obj[MST] != Py_None;
    const char *op = update ? "prr.update_block_metadata" : "prr.block_metadata";
    unsigned nosync;
    intptr_t stream;
    int32_t G;
    if (gvr_parse_nosync(o_nosync, META_NARGS, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0 ||
        parse_block_size(o_bs, &G) < 0)
        goto fail;
    if (gvr_intake_run(&in, update ? &update_spec : &build_spec, obj, stream, nosync) < 0)
        goto fail;
    const gvr_view *k = &in.view[MK], *bt = &in.view[MBT], *ln = &in.view[MLEN], *st = &in.view[MST],
                   *m = &in.view[MMETA];
    const char *mname = update ? "meta" : "out";
    if (!m->data) {
        PyErr_Format(PyExc_TypeError, "%s: '%s' must be given (gvr.prr allocates it)", op, mname);
        goto fail;
    }
    const int64_t B = bt->shape[0], maxp = bt->shape[1], Hkv = k->shape[2], D = k->shape[3], P = k->shape[1],
                  Nb = m->shape[2];
    if (B > INT32_MAX || Hkv > INT32_MAX || D > INT32_MAX || P > INT32_MAX || maxp > INT32_MAX || Nb > INT32_MAX ||
        maxp * P > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: B, Hkv, D, P, max_pages and max_pages * P must fit in int32", op);
        goto fail;
    }
    if (D < 1 || P < 1) {
        PyErr_Format(PyExc_ValueError, "'k_cache' must have shape [num_pages, P, Hkv, D] with P >= 1 and D >= 1, got "
                     "P = %lld, D = %lld", (long long)P, (long long)D);
        goto fail;
    }
    if (G % P && P % G) {
        PyErr_Format(PyExc_ValueError, "'block_size' must divide or be a multiple of the page size P = %lld (from "
                     "'k_cache'), got %d", (long long)P, G);
        goto fail;
    }
    const int64_t cap = maxp * P, want_nb = (cap + G - 1) / G;
    if (Nb != want_nb) {
        PyErr_Format(PyExc_ValueError, "'%s' must have shape [B, Hkv, Nb, 2, D] with Nb = ceil(max_pages * P / "
                     "block_size) = %lld, got Nb = %lld", mname, (long long)want_nb, (long long)Nb);
        goto fail;
    }
    gvr_block_meta_params p;
    memset(&p, 0, sizeof p);
    p.dtype = gvr_elem_of(k->dtype);
    p.B = (int32_t)B;
    p.Hkv = (int32_t)Hkv;
    p.D = (int32_t)D;
    p.k = k->data;
    p.k_stride_page = k->strides[0];
    p.k_stride_tok = k->strides[1];
    p.k_stride_head = k->strides[2];
    p.num_pages = k->shape[0];
    p.P = (int32_t)P;
    p.block_table = (const int32_t *)bt->data;
    p.bt_stride_b = bt->strides[0];
    p.max_pages = (int32_t)maxp;
    p.block_size = G;
    p.Nb = (int32_t)Nb;
    p.start = (const int32_t *)st->data;
    p.end = (const int32_t *)ln->data;
    p.meta = m->data;
    p.meta_stride_b = m->strides[0];
    p.meta_stride_h = m->strides[1];
    p.meta_stride_j = m->strides[2];
    p.meta_stride_m = m->strides[3];
    if (in.device == GVR_DEV_CUDA) {
        const int64_t ks[3] = {p.k_stride_page, p.k_stride_tok, p.k_stride_head};
        const int64_t ms[4] = {p.meta_stride_b, p.meta_stride_h, p.meta_stride_j, p.meta_stride_m};
        if (check_cuda_dtype_and_d(k, "k_cache", p.D) < 0 || check_vec16("k_cache", p.k, ks, 3, k->itemsize) < 0 ||
            check_vec16(mname, p.meta, ms, 4, m->itemsize) < 0)
            goto fail;
        if (gvr_run_on_device(&in, cuda_meta, &p, NULL, 0, stream, update ? "gvr_prr_block_metadata (update)"
                                                              : "gvr_prr_block_metadata") < 0)
            goto fail;
    } else {
        if (gvr_read_host_range(ln, st, update, B, cap, &copy, &p.end, &p.start) < 0 ||
            gvr_run_on_host(cpu_meta, &p) < 0)
            goto fail;
    }
    result = obj[MMETA];
    Py_INCREF(result);
fail:
    free(copy);
    gvr_intake_release(&in);
    return result;
}

/* ================================================================================================
 * block scores
 * ================================================================================================ */

enum { SQ, SMETA, SLEN, SOUT, SCNT, SRAW, SCORES_NARGS };

static const gvr_arg_spec scores_args[SCORES_NARGS] = {
    [SQ] = {"q", FLOATS, "B,Hq,D", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    /* q's dtype or float8_e4m3fn (the metadata of an fp8 cache): checked in gvr_py_block_scores */
    [SMETA] = {"meta", FLOATS | F8, "B,Hkv,Nb,2,D", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [SLEN] = {"lengths", I32, "B", ON_CALL, GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [SOUT] = {"out", F32, "B,Hkv,Nb", ON_CALL, GVR_OUTPUT | GVR_ALLOC | GVR_UNIT_LAST, NULL, NULL},
    [SCNT] = {"counts", I32, "B,Hkv", ON_CALL, GVR_OPTIONAL | GVR_OUTPUT, NULL, NULL},
    [SRAW] = {"scores_out", F32, "B,Hkv,Nb", ON_CALL, GVR_OPTIONAL | GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
};
static const gvr_spec scores_spec = {"prr.block_scores", SCORES_NARGS, scores_args};

const char gvr_block_scores_doc[] =
    "block_scores(q, meta, lengths, out, counts, block_size, group_reduce, keep_first, keep_last, stream,\n"
    "             nosync, scores_out, window=1)\n--\n\n"
    "Quest block scores (upper bounds of q.k per block) into out float32 [B, Hkv, Nb]; counts int32\n"
    "[B, Hkv] (optional): the valid blocks of each row; scores_out float32 [B, Hkv, Nb] (optional): the\n"
    "same scores before keep_first / keep_last, from the same pass. See gvr.prr.block_scores and\n"
    "gvr.prr.select_blocks. window W > 1: lengths are token counts and the blocks are SparDA's windows of W\n"
    "tokens every block_size (gvr.sparda.forecast_select): row b has (lengths[b] - W) // block_size + 1\n"
    "of them (0 when lengths[b] < W).";

static int cpu_scores(const void *p) { return prr_block_scores_cpu((const gvr_block_scores_params *)p); }

static int cuda_scores(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    (void)ws;
    (void)ws_bytes;
    return cu->prr_block_scores((const gvr_block_scores_params *)p, stream);
}

static int parse_group_reduce(PyObject *o, int32_t *v)
{
    if (!o || o == Py_None) {
        *v = GVR_GROUP_MAX;
        return 0;
    }
    if (!PyUnicode_Check(o)) {
        PyErr_Format(PyExc_TypeError, "'group_reduce' must be 'max' or 'sum', got %s", Py_TYPE(o)->tp_name);
        return -1;
    }
    if (PyUnicode_CompareWithASCIIString(o, "max") == 0) {
        *v = GVR_GROUP_MAX;
        return 0;
    }
    if (PyUnicode_CompareWithASCIIString(o, "sum") == 0) {
        *v = GVR_GROUP_SUM;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "'group_reduce' must be 'max' or 'sum', got %R", o);
    return -1;
}

static int parse_keep(PyObject *o, const char *name, int32_t *v)
{
    Py_ssize_t x = 0;
    if (o && o != Py_None && gvr_parse_int(o, name, &x) < 0)
        return -1;
    *v = x > INT32_MAX ? INT32_MAX : (int32_t)x;
    return 0;
}

PyObject *gvr_py_block_scores(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"q", "meta", "lengths", "out", "counts", "block_size", "group_reduce", "keep_first",
                             "keep_last", "stream", "nosync", "scores_out", "window", NULL};
    PyObject *obj[SCORES_NARGS] = {Py_None, Py_None, Py_None, Py_None, Py_None, Py_None};
    PyObject *o_bs = NULL, *o_red = NULL, *o_kf = NULL, *o_kl = NULL, *o_stream = Py_None, *o_nosync = NULL;
    PyObject *o_win = NULL;
    PyObject *result = NULL;
    int32_t *copy = NULL;
    gvr_intake in;
    gvr_intake_init(&in);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OOOOOOOOOOO:block_scores", kwlist, &obj[SQ], &obj[SMETA],
                                     &obj[SLEN], &obj[SOUT], &obj[SCNT], &o_bs, &o_red, &o_kf, &o_kl, &o_stream,
                                     &o_nosync, &obj[SRAW], &o_win))
        return NULL;
    unsigned nosync;
    intptr_t stream;
    int32_t G, red, kf, kl;
    Py_ssize_t W = 1;
    if (gvr_parse_nosync(o_nosync, SCORES_NARGS, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0 ||
        parse_block_size(o_bs, &G) < 0 || parse_group_reduce(o_red, &red) < 0 ||
        parse_keep(o_kf, "keep_first", &kf) < 0 || parse_keep(o_kl, "keep_last", &kl) < 0 ||
        (o_win && o_win != Py_None && gvr_parse_int(o_win, "window", &W) < 0))
        goto fail;
    if (W < 1 || W > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "'window' must lie in [1, %d], got %zd", INT32_MAX, W);
        goto fail;
    }
    if (gvr_intake_run(&in, &scores_spec, obj, stream, nosync) < 0)
        goto fail;
    const gvr_view *q = &in.view[SQ], *m = &in.view[SMETA], *ln = &in.view[SLEN], *o = &in.view[SOUT],
                   *cn = &in.view[SCNT], *raw = &in.view[SRAW];
    const int64_t B = q->shape[0], Hq = q->shape[1], D = q->shape[2], Hkv = m->shape[1], Nb = m->shape[2];
    if (B > INT32_MAX || Hq > INT32_MAX || D > INT32_MAX || Hkv > INT32_MAX || Nb > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "prr.block_scores: B, Hq, Hkv, D and Nb must fit in int32");
        goto fail;
    }
    if (D < 1) {
        PyErr_Format(PyExc_ValueError, "'q' must have shape [B, Hq, D] with D >= 1, got D = %lld", (long long)D);
        goto fail;
    }
    if (m->dtype != q->dtype && m->dtype != GVR_DTYPE_F8E4M3) {
        PyErr_Format(PyExc_TypeError, "'meta' must be %s like 'q', or float8_e4m3fn, got %s", q->dtype_str, m->dtype_str);
        goto fail;
    }
    if (Hkv == 0 || Hq % Hkv) {
        PyErr_Format(PyExc_ValueError, "prr.block_scores: the query heads Hq = %lld (from 'q') must be a multiple of "
                     "the KV heads Hkv = %lld (from 'meta')", (long long)Hq, (long long)Hkv);
        goto fail;
    }
    gvr_block_scores_params p;
    memset(&p, 0, sizeof p);
    p.dtype = gvr_elem_of(q->dtype);
    p.meta_dtype = gvr_elem_of(m->dtype);
    p.B = (int32_t)B;
    p.Hq = (int32_t)Hq;
    p.Hkv = (int32_t)Hkv;
    p.D = (int32_t)D;
    p.Nb = (int32_t)Nb;
    p.q = q->data;
    p.q_stride_b = q->strides[0];
    p.q_stride_h = q->strides[1];
    p.meta = m->data;
    p.meta_stride_b = m->strides[0];
    p.meta_stride_h = m->strides[1];
    p.meta_stride_j = m->strides[2];
    p.meta_stride_m = m->strides[3];
    p.lengths = (const int32_t *)ln->data;
    p.block_size = G;
    p.window = (int32_t)W;
    p.group_reduce = red;
    p.keep_first = kf;
    p.keep_last = kl;
    p.scores = (float *)o->data;
    p.scores_stride_b = o->strides[0];
    p.scores_stride_h = o->strides[1];
    if (cn->data) {
        p.counts = (int32_t *)cn->data;
        p.counts_stride_b = cn->strides[0];
        p.counts_stride_h = cn->strides[1];
    }
    if (raw->data) {
        p.raw_scores = (float *)raw->data;
        p.raw_stride_b = raw->strides[0];
        p.raw_stride_h = raw->strides[1];
    }
    const int64_t cap = W - 1 + Nb * (int64_t)G; /* the longest row of at most Nb blocks / windows */
    if (in.device == GVR_DEV_CUDA) {
        const int64_t ms[4] = {p.meta_stride_b, p.meta_stride_h, p.meta_stride_j, p.meta_stride_m};
        if (check_cuda_dtype_and_d(q, "q", p.D) < 0 || check_vec16("meta", p.meta, ms, 4, m->itemsize) < 0)
            goto fail;
        if (Hq / Hkv > GVR_PRR_SCORES_MAX_GQA) {
            PyErr_Format(PyExc_ValueError, "the GQA ratio Hq / Hkv on CUDA must be at most %d, got %lld / %lld",
                         GVR_PRR_SCORES_MAX_GQA, (long long)Hq, (long long)Hkv);
            goto fail;
        }
        if (gvr_run_on_device(&in, cuda_scores, &p, NULL, 0, stream, "gvr_prr_block_scores") < 0)
            goto fail;
    } else {
        if (ln->data) {
            if (!(copy = malloc((size_t)(B ? B : 1) * sizeof *copy))) {
                PyErr_NoMemory();
                goto fail;
            }
            if (gvr_read_host_counts(ln, "lengths", W > 1 ? "window - 1 + Nb * block_size" : "Nb * block_size", B,
                                     cap > INT32_MAX ? INT32_MAX : cap, copy) < 0)
                goto fail;
            p.lengths = copy;
        }
        if (gvr_run_on_host(cpu_scores, &p) < 0)
            goto fail;
    }
    result = gvr_intake_object(&in, obj, SOUT);
    Py_INCREF(result);
fail:
    free(copy);
    gvr_intake_release(&in);
    return result;
}

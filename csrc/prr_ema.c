/* PRR's EMA predictor and its calibration: the specs, CPU calls and CUDA calls of prr_ema_predict,
 * prr_ema_update and prr_ema_calibrate. Semantics: kernels/gvr_kernels.h, section "PRR EMA predictor
 * and calibration". The Python side (gvr/_prr_ema.py: EMAPredictor, calibrate) owns the buffers. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "cpu/prr_ema_cpu.h"
#include "cuda_lib.h"
#include "dispatch.h"
#include "intake.h"
#include "ops.h"

#define I32 GVR_DT(GVR_DTYPE_I32)
#define I64 GVR_DT(GVR_DTYPE_I64)
#define F32 GVR_DT(GVR_DTYPE_F32)
#define U8 GVR_DT(GVR_DTYPE_U8)
#define ON_CALL (GVR_HOST | GVR_DEVICE)

/* a hyper-parameter: a real number in (0, 1) (open) or [0, 1] */
static int parse_unit(PyObject *o, const char *name, int open, float *v)
{
    if (!o || PyBool_Check(o) || !PyNumber_Check(o)) {
        PyErr_Format(PyExc_TypeError, "'%s' must be a float, got %s", name, o ? Py_TYPE(o)->tp_name : "nothing");
        return -1;
    }
    const double d = PyFloat_AsDouble(o);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "'%s' must be a float, got %s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    const float f = (float)d;
    if (open ? !(f > 0.0f && f < 1.0f) : !(f >= 0.0f && f <= 1.0f)) {
        char num[32]; /* PyErr_Format has no %g */
        snprintf(num, sizeof num, "%g", d);
        PyErr_Format(PyExc_ValueError, "'%s' must lie in %s, got %s", name, open ? "(0, 1)" : "[0, 1]", num);
        return -1;
    }
    *v = f;
    return 0;
}

static int dims_fit(const gvr_intake *in, const char *op)
{
    static const char *names[] = {"B", "H", "N", "Ns", "W"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (gvr_intake_dim(in, names[i]) > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "%s: dimension %s must fit in int32, got %lld", op, names[i],
                         (long long)gvr_intake_dim(in, names[i]));
            return -1;
        }
    return 0;
}

/* an int argument in [0, INT32_MAX] (None or left out: dflt) */
static int parse_i32(PyObject *o, const char *name, int32_t dflt, int32_t *v)
{
    if (!o || o == Py_None) {
        *v = dflt;
        return 0;
    }
    Py_ssize_t x;
    if (gvr_parse_int(o, name, &x) < 0)
        return -1;
    if (x > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "'%s' must fit in int32, got %zd", name, x);
        return -1;
    }
    *v = (int32_t)x;
    return 0;
}

/* Host nblocks [B] copied into dst, each row's block count checked against [0, cap] (what names cap):
 * block_size <= 1, the values themselves (gvr_read_host_counts); block_size G > 1, token counts: each
 * >= 0 and its block count ceil(n / G) <= cap (dst keeps the token counts: the CPU path derives nb). */
static int read_host_blocks(const gvr_view *v, int32_t G, const char *what, int64_t B, int64_t cap, int32_t *dst)
{
    if (G <= 1)
        return gvr_read_host_counts(v, "nblocks", what, B, cap, dst);
    for (int64_t b = 0; b < B; b++) {
        const int32_t x = ((const int32_t *)v->data)[b * v->strides[0]];
        if (x < 0) {
            PyErr_Format(PyExc_ValueError, "'nblocks' holds token counts (block_size = %d): each must be >= 0, got "
                         "nblocks[%lld] = %d", (int)G, (long long)b, x);
            return -1;
        }
        const int64_t nb = ((int64_t)x + G - 1) / G;
        if (nb > cap) {
            PyErr_Format(PyExc_ValueError, "'nblocks' holds token counts (block_size = %d): the block counts "
                         "ceil(nblocks / block_size) must lie in [0, %s] = [0, %lld], got nblocks[%lld] = %d tokens = "
                         "%lld blocks", (int)G, what, (long long)cap, (long long)b, x, (long long)nb);
            return -1;
        }
        dst[b] = x;
    }
    return 0;
}

/* the predictor's state (level, trend, known) into p */
static void fill_state(gvr_ema_params *p, const gvr_view *l, const gvr_view *t, const gvr_view *k)
{
    p->B = (int32_t)l->shape[0];
    p->H = (int32_t)l->shape[1];
    p->N = (int32_t)l->shape[2];
    p->level = (float *)l->data;
    p->level_stride_b = l->strides[0];
    p->level_stride_h = l->strides[1];
    p->trend = (float *)t->data;
    p->trend_stride_b = t->strides[0];
    p->trend_stride_h = t->strides[1];
    p->known = (int32_t *)k->data;
    p->known_stride_b = k->strides[0];
    p->known_stride_h = k->strides[1];
}

static int cpu_predict(const void *p) { return prr_ema_predict_cpu((const gvr_ema_params *)p); }
static int cpu_update(const void *p) { return prr_ema_update_cpu((const gvr_ema_params *)p); }
static int cpu_calibrate(const void *p) { return prr_ema_calibrate_cpu((const gvr_ema_calibrate_params *)p); }

static int cuda_predict(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    (void)ws;
    (void)ws_bytes;
    return cu->prr_ema_predict((const gvr_ema_params *)p, stream);
}

static int cuda_update(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    (void)ws;
    (void)ws_bytes;
    return cu->prr_ema_update((const gvr_ema_params *)p, stream);
}

static int cuda_calibrate(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    return cu->prr_ema_calibrate((const gvr_ema_calibrate_params *)p, ws, ws_bytes, stream);
}

/* ================================================================================================
 * prr_ema_predict
 * ================================================================================================ */

enum { PL, PT, PK, PNB, PPRED, PLEN, PRED_NARGS };

static const gvr_arg_spec predict_args[PRED_NARGS] = {
    [PL] = {"level", F32, "B,H,N", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [PT] = {"trend", F32, "B,H,N", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [PK] = {"known", I32, "B,H", ON_CALL, 0, NULL, NULL},
    [PNB] = {"nblocks", I32, "B", ON_CALL, GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [PPRED] = {"pred", F32, "B,H,W", ON_CALL, GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
    [PLEN] = {"row_len", I32, "B,H", ON_CALL, GVR_OUTPUT, NULL, NULL},
};
static const gvr_spec predict_spec = {"prr.EMAPredictor.predict", PRED_NARGS, predict_args};

const char gvr_ema_predict_doc[] =
    "prr_ema_predict(level, trend, known, nblocks, pred, row_len, phi, stream, nosync, block_size=1,\n"
    "                keep_first=0, keep_last=0)\n--\n\n"
    "The EMA predictor's predicted block scores into pred [B, H, W] and the rows' lengths into row_len\n"
    "(the Top-K of each row is the prediction). block_size > 1: nblocks holds token counts (a row has\n"
    "ceil(nblocks[b] / block_size) blocks); the first keep_first and the last keep_last blocks of each\n"
    "row are predicted +inf. See gvr.prr.EMAPredictor.";

PyObject *gvr_py_prr_ema_predict(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"level", "trend", "known", "nblocks", "pred", "row_len", "phi", "stream", "nosync",
                             "block_size", "keep_first", "keep_last", NULL};
    PyObject *obj[PRED_NARGS] = {NULL};
    PyObject *o_phi = NULL, *o_stream = Py_None, *o_nosync = NULL, *result = NULL;
    PyObject *o_bs = NULL, *o_kf = NULL, *o_kl = NULL;
    int32_t *nb_copy = NULL;
    gvr_intake in;
    gvr_intake_init(&in);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOO|OO$OOO:prr_ema_predict", kwlist, &obj[PL], &obj[PT],
                                     &obj[PK], &obj[PNB], &obj[PPRED], &obj[PLEN], &o_phi, &o_stream, &o_nosync,
                                     &o_bs, &o_kf, &o_kl))
        return NULL;
    unsigned nosync;
    intptr_t stream;
    gvr_ema_params p;
    memset(&p, 0, sizeof p);
    if (gvr_parse_nosync(o_nosync, PRED_NARGS, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0 ||
        parse_unit(o_phi, "phi", 0, &p.phi) < 0 || parse_i32(o_bs, "block_size", 1, &p.block_size) < 0 ||
        parse_i32(o_kf, "keep_first", 0, &p.keep_first) < 0 || parse_i32(o_kl, "keep_last", 0, &p.keep_last) < 0 ||
        gvr_intake_run(&in, &predict_spec, obj, stream, nosync) < 0 || dims_fit(&in, "prr.EMAPredictor.predict") < 0)
        goto fail;
    const gvr_view *l = &in.view[PL], *t = &in.view[PT], *k = &in.view[PK], *nb = &in.view[PNB],
                   *pr = &in.view[PPRED], *rl = &in.view[PLEN];
    fill_state(&p, l, t, k);
    p.pred = (float *)pr->data;
    p.pred_stride_b = pr->strides[0];
    p.pred_stride_h = pr->strides[1];
    p.W = (int32_t)pr->shape[2];
    p.row_len = (int32_t *)rl->data;
    p.row_len_stride_b = rl->strides[0];
    p.row_len_stride_h = rl->strides[1];
    if (in.device == GVR_DEV_CUDA) {
        p.nblocks = (const int32_t *)nb->data;
        if (gvr_run_on_device(&in, cuda_predict, &p, NULL, 0, stream, "gvr_prr_ema_predict") < 0)
            goto fail;
    } else {
        if (!(nb_copy = malloc((size_t)(p.B ? p.B : 1) * sizeof *nb_copy))) {
            PyErr_NoMemory();
            goto fail;
        }
        if (read_host_blocks(nb, p.block_size, "the predictor's max_blocks", p.B, p.N, nb_copy) < 0)
            goto fail;
        p.nblocks = nb_copy;
        if (gvr_run_on_host(cpu_predict, &p) < 0)
            goto fail;
    }
    result = Py_BuildValue("(OO)", obj[PPRED], obj[PLEN]);
fail:
    free(nb_copy);
    gvr_intake_release(&in);
    return result;
}

/* ================================================================================================
 * prr_ema_update
 * ================================================================================================ */

enum { UL, UT, UK, UNB, US, UPRED, ULEN, UPD_NARGS };

static const gvr_arg_spec update_args[UPD_NARGS] = {
    [UL] = {"level", F32, "B,H,N", ON_CALL, GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
    [UT] = {"trend", F32, "B,H,N", ON_CALL, GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
    [UK] = {"known", I32, "B,H", ON_CALL, GVR_OUTPUT, NULL, NULL},
    [UNB] = {"nblocks", I32, "B", ON_CALL, GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [US] = {"scores", F32, "B,H,Ns", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    /* the fused update + predict: the prediction after the update */
    [UPRED] = {"pred", F32, "B,H,W", ON_CALL, GVR_OPTIONAL | GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
    [ULEN] = {"row_len", I32, "B,H", ON_CALL, GVR_OPTIONAL | GVR_OUTPUT, NULL, NULL},
};
static const gvr_spec update_spec = {"prr.EMAPredictor.update", UPD_NARGS, update_args};

const char gvr_ema_update_doc[] =
    "prr_ema_update(level, trend, known, nblocks, scores, alpha, beta, phi, stream, nosync, block_size=1,\n"
    "               pred=None, row_len=None, keep_first=0, keep_last=0)\n--\n\n"
    "The EMA predictor's state update with this step's block scores [B, H, Ns], in place. block_size > 1:\n"
    "nblocks holds token counts. pred [B, H, W] / row_len [B, H] given: also the prediction after the\n"
    "update (prr_ema_predict's, with keep_first / keep_last), in the same pass. See gvr.prr.EMAPredictor.";

PyObject *gvr_py_prr_ema_update(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"level", "trend", "known", "nblocks", "scores", "alpha", "beta", "phi", "stream",
                             "nosync", "block_size", "pred", "row_len", "keep_first", "keep_last", NULL};
    PyObject *obj[UPD_NARGS] = {NULL};
    PyObject *o_a = NULL, *o_b = NULL, *o_phi = NULL, *o_stream = Py_None, *o_nosync = NULL, *result = NULL;
    PyObject *o_bs = NULL, *o_kf = NULL, *o_kl = NULL;
    int32_t *nb_copy = NULL;
    gvr_intake in;
    gvr_intake_init(&in);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOO|OO$OOOOO:prr_ema_update", kwlist, &obj[UL], &obj[UT],
                                     &obj[UK], &obj[UNB], &obj[US], &o_a, &o_b, &o_phi, &o_stream, &o_nosync, &o_bs,
                                     &obj[UPRED], &obj[ULEN], &o_kf, &o_kl))
        return NULL;
    unsigned nosync;
    intptr_t stream;
    gvr_ema_params p;
    memset(&p, 0, sizeof p);
    if (gvr_parse_nosync(o_nosync, UPD_NARGS, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0 ||
        parse_unit(o_a, "alpha", 1, &p.alpha) < 0 || parse_unit(o_b, "beta", 1, &p.beta) < 0 ||
        parse_unit(o_phi, "phi", 0, &p.phi) < 0 || parse_i32(o_bs, "block_size", 1, &p.block_size) < 0 ||
        parse_i32(o_kf, "keep_first", 0, &p.keep_first) < 0 || parse_i32(o_kl, "keep_last", 0, &p.keep_last) < 0 ||
        gvr_intake_run(&in, &update_spec, obj, stream, nosync) < 0 || dims_fit(&in, "prr.EMAPredictor.update") < 0)
        goto fail;
    const gvr_view *l = &in.view[UL], *t = &in.view[UT], *k = &in.view[UK], *nb = &in.view[UNB], *s = &in.view[US];
    fill_state(&p, l, t, k);
    p.scores = (const float *)s->data;
    p.scores_stride_b = s->strides[0];
    p.scores_stride_h = s->strides[1];
    p.Ns = (int32_t)s->shape[2];
    if (in.given[UPRED]) {
        const gvr_view *pr = &in.view[UPRED];
        p.pred = (float *)pr->data;
        p.pred_stride_b = pr->strides[0];
        p.pred_stride_h = pr->strides[1];
        p.W = (int32_t)pr->shape[2];
        if (p.W == 0)
            p.pred = NULL; /* nothing to write (an empty buffer's address may be anything) */
    }
    if (in.given[ULEN]) {
        const gvr_view *rl = &in.view[ULEN];
        p.row_len = (int32_t *)rl->data;
        p.row_len_stride_b = rl->strides[0];
        p.row_len_stride_h = rl->strides[1];
    }
    if (in.device == GVR_DEV_CUDA) {
        p.nblocks = (const int32_t *)nb->data;
        if (gvr_run_on_device(&in, cuda_update, &p, NULL, 0, stream, "gvr_prr_ema_update") < 0)
            goto fail;
    } else {
        if (!(nb_copy = malloc((size_t)(p.B ? p.B : 1) * sizeof *nb_copy))) {
            PyErr_NoMemory();
            goto fail;
        }
        const int limit_scores = p.Ns < p.N;
        if (read_host_blocks(nb, p.block_size, limit_scores ? "the width of 'scores'" : "the predictor's max_blocks",
                             p.B, limit_scores ? p.Ns : p.N, nb_copy) < 0)
            goto fail;
        p.nblocks = nb_copy;
        if (gvr_run_on_host(cpu_update, &p) < 0)
            goto fail;
    }
    result = Py_None;
    Py_INCREF(result);
fail:
    free(nb_copy);
    gvr_intake_release(&in);
    return result;
}

/* ================================================================================================
 * prr_ema_calibrate
 * ================================================================================================ */

enum { CS, CG, CH, CWS, CAL_NARGS };

static const gvr_arg_spec calibrate_args[CAL_NARGS] = {
    [CS] = {"prefill_scores", F32, "T,N", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [CG] = {"grid", F32, "G,3", ON_CALL, GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    /* float64 [G], passed as its int64 view (the intake has no float64) */
    [CH] = {"hit", I64, "G", ON_CALL, GVR_OUTPUT | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [CWS] = {"workspace", U8, "ws_bytes", GVR_DEVICE, GVR_OPTIONAL | GVR_OUTPUT | GVR_CONTIGUOUS_ON_DEVICE, NULL,
             NULL},
};
static const gvr_spec calibrate_spec = {"prr.calibrate", CAL_NARGS, calibrate_args};

const char gvr_ema_calibrate_doc[] =
    "prr_ema_calibrate(prefill_scores, grid, hit, k, workspace, stream, nosync)\n--\n\n"
    "The mean score-weighted hit rate of the EMA predictor over the trajectory prefill_scores [T, N]\n"
    "for each grid point (grid float32 [G, 3]: alpha, beta, phi) into hit (float64 [G], as its int64\n"
    "view). See gvr.prr.calibrate.";

static void calib_params(const gvr_intake *in, int32_t k, gvr_ema_calibrate_params *p)
{
    const gvr_view *s = &in->view[CS];
    memset(p, 0, sizeof *p);
    p->scores = (const float *)s->data;
    p->stride_t = s->strides[0];
    p->T = (int32_t)s->shape[0];
    p->N = (int32_t)s->shape[1];
    p->k = k;
    p->G = (int32_t)in->view[CG].shape[0];
}

PyObject *gvr_py_prr_ema_calibrate(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"prefill_scores", "grid", "hit", "k", "workspace", "stream", "nosync", NULL};
    PyObject *obj[CAL_NARGS] = {NULL, NULL, NULL, Py_None};
    PyObject *o_k = NULL, *o_stream = Py_None, *o_nosync = NULL, *result = NULL;
    float *grid_copy = NULL;
    double *hit_copy = NULL;
    gvr_intake in;
    gvr_intake_init(&in);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|OOO:prr_ema_calibrate", kwlist, &obj[CS], &obj[CG], &obj[CH],
                                     &o_k, &obj[CWS], &o_stream, &o_nosync))
        return NULL;
    unsigned nosync;
    intptr_t stream;
    Py_ssize_t k;
    if (gvr_parse_nosync(o_nosync, CAL_NARGS, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0 ||
        gvr_parse_int(o_k, "k", &k) < 0)
        goto fail;
    if (k < 1) {
        PyErr_SetString(PyExc_ValueError, "'k' must be >= 1, got 0");
        goto fail;
    }
    if (gvr_intake_run(&in, &calibrate_spec, obj, stream, nosync) < 0)
        goto fail;
    const gvr_view *s = &in.view[CS], *g = &in.view[CG], *h = &in.view[CH];
    const int64_t T = s->shape[0], N = s->shape[1], G = g->shape[0];
    if (T < 2) {
        PyErr_Format(PyExc_ValueError, "'prefill_scores' must have shape [T, N] with T >= 2 steps (the first only "
                     "initialises the state), got T = %lld", (long long)T);
        goto fail;
    }
    if (N < 1 || N > INT32_MAX || T > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "'prefill_scores' must have shape [T, N] with 1 <= N and T, N < 2^31, got "
                     "[%lld, %lld]", (long long)T, (long long)N);
        goto fail;
    }
    if (G < 1 || G > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "'grid' must hold at least one point, got G = %lld", (long long)G);
        goto fail;
    }
    if (h->itemsize != 8) {
        PyErr_SetString(PyExc_TypeError, "'hit' must be a float64 buffer's int64 view");
        goto fail;
    }
    gvr_ema_calibrate_params p;
    calib_params(&in, k > INT32_MAX ? INT32_MAX : (int32_t)k, &p);
    if (in.device == GVR_DEV_CUDA) {
        if (N > GVR_EMA_CALIBRATE_MAX_BLOCKS) {
            PyErr_Format(PyExc_ValueError, "'prefill_scores' on CUDA must have at most %d blocks (N), got N = %lld "
                         "(calibrate on the CPU)", GVR_EMA_CALIBRATE_MAX_BLOCKS, (long long)N);
            goto fail;
        }
        p.grid = (const float *)g->data;
        p.hit = (double *)h->data;
        const gvr_view *ws = &in.view[CWS];
        if (gvr_run_on_device(&in, cuda_calibrate, &p, ws->data, ws->data ? (size_t)ws->shape[0] : 0, stream,
                          "gvr_prr_ema_calibrate") < 0)
            goto fail;
    } else {
        grid_copy = malloc((size_t)G * 3 * sizeof *grid_copy);
        hit_copy = malloc((size_t)G * sizeof *hit_copy);
        if (!grid_copy || !hit_copy) {
            PyErr_NoMemory();
            goto fail;
        }
        static const char *what[3] = {"alpha", "beta", "phi"};
        for (int64_t i = 0; i < G; i++)
            for (int c = 0; c < 3; c++) {
                const float v = ((const float *)g->data)[i * g->strides[0] + c * g->strides[1]];
                if (c < 2 ? !(v > 0.0f && v < 1.0f) : !(v >= 0.0f && v <= 1.0f)) {
                    char num[32];
                    snprintf(num, sizeof num, "%g", (double)v);
                    PyErr_Format(PyExc_ValueError, "'grid': every %s must lie in %s, got %s (point %lld)", what[c],
                                 c < 2 ? "(0, 1)" : "[0, 1]", num, (long long)i);
                    goto fail;
                }
                grid_copy[i * 3 + c] = v;
            }
        p.grid = grid_copy;
        p.hit = hit_copy;
        if (gvr_run_on_host(cpu_calibrate, &p) < 0)
            goto fail;
        for (int64_t i = 0; i < G; i++)
            memcpy((char *)h->data + i * h->strides[0] * 8, &hit_copy[i], 8);
    }
    result = gvr_intake_object(&in, obj, CH);
    Py_INCREF(result);
fail:
    free(grid_copy);
    free(hit_copy);
    gvr_intake_release(&in);
    return result;
}

/* prr_ema_calibrate_workspace_size(device, T, N, k, G) -> bytes of CUDA workspace a call of these
 * shapes needs */
PyObject *gvr_py_prr_ema_calibrate_workspace_size(PyObject *self, PyObject *args)
{
    (void)self;
    int dev, T, N, k, G;
    if (!PyArg_ParseTuple(args, "iiiii:prr_ema_calibrate_workspace_size", &dev, &T, &N, &k, &G))
        return NULL;
    const gvr_cuda_api *cu = gvr_cuda();
    if (!cu)
        return NULL;
    gvr_ema_calibrate_params p;
    memset(&p, 0, sizeof p);
    p.T = T;
    p.N = N;
    p.k = k;
    p.G = G;
    int prev = -1;
    if (cu->set_device(dev, &prev))
        return gvr_cuda_raise("selecting the CUDA device");
    const size_t need = cu->prr_ema_calibrate_workspace_size(&p);
    if (prev >= 0 && prev != dev)
        cu->set_device(prev, NULL);
    return PyLong_FromSize_t(need);
}

/* Sparse attention and attention states: the specs, CPU calls and CUDA calls of sparse_attention
 * (with prr.repair as its accumulate form), merge_states, prr.missed and prr.finalize. Semantics:
 * kernels/gvr_kernels.h, section "sparse attention, attention states, PRR repair". */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/attention_cpu.h"
#include "cpu/elem.h"
#include "cuda_lib.h"
#include "dispatch.h"
#include "intake.h"
#include "ops.h"

#define FLOATS (GVR_DT(GVR_DTYPE_F32) | GVR_DT(GVR_DTYPE_F16) | GVR_DT(GVR_DTYPE_BF16))
#define I32 GVR_DT(GVR_DTYPE_I32)
#define I64 GVR_DT(GVR_DTYPE_I64)
#define F32 GVR_DT(GVR_DTYPE_F32)
#define U8 GVR_DT(GVR_DTYPE_U8)
#define F8 GVR_DT(GVR_DTYPE_F8E4M3)
#define ON_CALL (GVR_HOST | GVR_DEVICE)

static int parse_float(PyObject *o, const char *name, float *v)
{
    if (!o || o == Py_None)
        return 0;
    if (PyBool_Check(o) || !(PyFloat_Check(o) || PyLong_Check(o) || PyNumber_Check(o))) {
        PyErr_Format(PyExc_TypeError, "'%s' must be a float, got %s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    double d = PyFloat_AsDouble(o);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "'%s' must be a float, got %s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    if (!isfinite(d)) { /* PyErr_Format has no %g */
        PyErr_Format(PyExc_ValueError, "'%s' must be finite, got %s", name, isnan(d) ? "nan" : d > 0 ? "inf" : "-inf");
        return -1;
    }
    *v = (float)d;
    return 0;
}

/* ================================================================================================
 * sparse_attention (accumulate = 1: prr.repair)
 * ================================================================================================ */

enum { Q, KC, VC, IDX, BT, LEN, OUT, LSE, POUT, PLSE, WS, EXC, CNT, CAST, ATT_NARGS };

static const gvr_arg_spec attention_args[ATT_NARGS] = {
    [Q] = {"q", FLOATS, "B,Hq,D", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    /* q's dtype or float8_e4m3fn, both the same (check_attention) */
    [KC] = {"k_cache", FLOATS | F8, "num_pages,P,Hkv,D", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [VC] = {"v_cache", FLOATS | F8, "num_pages,P,Hkv,D", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [IDX] = {"indices", I32, "B,Hsel,n", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [BT] = {"block_table", I32, "B,max_pages", ON_CALL, GVR_OPTIONAL | GVR_UNIT_LAST, NULL, NULL},
    [LEN] = {"lengths", I32, "B", ON_CALL, GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [OUT] = {"out", FLOATS, "B,Hq,D", ON_CALL, GVR_OPTIONAL | GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
    [LSE] = {"lse", F32, "B,Hq", ON_CALL, GVR_OPTIONAL | GVR_OUTPUT, NULL, NULL},
    [POUT] = {"part_out", F32, "B,Hq,n,D", ON_CALL, GVR_OPTIONAL | GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
    [PLSE] = {"part_lse", F32, "B,Hq,n", ON_CALL, GVR_OPTIONAL | GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
    [WS] = {"workspace", U8, "ws_bytes", GVR_DEVICE, GVR_OPTIONAL | GVR_OUTPUT | GVR_CONTIGUOUS_ON_DEVICE, NULL,
            NULL},
    /* prr.repair's fused extras */
    [EXC] = {"exclude", I32, "B,Hx,nx", ON_CALL, GVR_OPTIONAL | GVR_UNIT_LAST, NULL, NULL},
    [CNT] = {"counts", I64, "ncounts", ON_CALL, GVR_OPTIONAL | GVR_OUTPUT | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [CAST] = {"cast_out", FLOATS, "B,Hq,D", ON_CALL, GVR_OPTIONAL | GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
};
const gvr_spec gvr_attention_spec = {"sparse_attention", ATT_NARGS, attention_args};

const char gvr_attention_doc[] =
    "sparse_attention(q, k_cache, v_cache, indices, block_table, lengths, block_size, scale, out, lse,\n"
    "                 part_out, part_lse, accumulate, workspace, stream, nosync, exclude, counts, cast_out,\n"
    "                 k_scale, v_scale)\n--\n\n"
    "Attention over the selected entries of a paged KV cache (q's dtype or float8_e4m3fn, scaled by\n"
    "k_scale / v_scale) into (out, lse); accumulate: merge into the state (out float32, lse) already there\n"
    "(prr.repair), with its extras exclude (entries skipped), counts (int64 [2] or [4], += hits and\n"
    "entries) and cast_out (the result converted). See gvr.sparse_attention and gvr.prr.repair.";

/* Shape checks beyond the spec (the spec ties the named dimensions). */
static int check_attention(const gvr_intake *in, const gvr_attention_params *p, int accumulate)
{
    const char *op = accumulate ? "prr.repair" : "sparse_attention";
    if (p->D < 1) {
        PyErr_Format(PyExc_ValueError, "'q' must have shape [B, Hq, D] with D >= 1, got D = %d", p->D);
        return -1;
    }
    if (p->Hkv == 0 || p->Hq % p->Hkv) {
        PyErr_Format(PyExc_ValueError, "%s: the query heads Hq = %d (from 'q') must be a multiple of the KV heads "
                     "Hkv = %d (from 'k_cache')", op, p->Hq, p->Hkv);
        return -1;
    }
    if (p->Hsel != 1 && p->Hsel != p->Hkv) {
        PyErr_Format(PyExc_ValueError, "'indices' must have shape [B, Hsel, n] with Hsel = 1 or Hkv = %d, got Hsel = %d",
                     p->Hkv, p->Hsel);
        return -1;
    }
    if (p->block_size < 1) {
        PyErr_Format(PyExc_ValueError, "'block_size' must be >= 1, got %d", p->block_size);
        return -1;
    }
    if (!p->block_table) {
        if (p->block_size != 1) {
            PyErr_Format(PyExc_ValueError, "'block_size' must be 1 without 'block_table' (entries are physical token "
                         "slots), got %d", p->block_size);
            return -1;
        }
        if (in->view[LEN].data) {
            PyErr_SetString(PyExc_ValueError, "'lengths' applies only with 'block_table' (without it, entries are "
                            "physical token slots): pass lengths=None");
            return -1;
        }
    } else if (p->P > 0 && p->block_size % p->P && p->P % p->block_size) {
        PyErr_Format(PyExc_ValueError, "'block_size' must divide or be a multiple of the page size P = %d (from "
                     "'k_cache'), got %d", p->P, p->block_size);
        return -1;
    }
    if ((p->part_out != NULL) != (p->part_lse != NULL)) {
        PyErr_SetString(PyExc_ValueError, "'partials' must be a pair (part_out, part_lse): one of them is missing");
        return -1;
    }
    const gvr_dtype qd = in->view[Q].dtype, od = in->view[OUT].dtype;
    const gvr_dtype kd = in->view[KC].dtype, vd = in->view[VC].dtype;
    if (kd != qd && kd != GVR_DTYPE_F8E4M3) {
        PyErr_Format(PyExc_TypeError, "'k_cache' must be %s like 'q', or float8_e4m3fn, got %s", in->view[Q].dtype_str,
                     in->view[KC].dtype_str);
        return -1;
    }
    if (vd != kd) {
        PyErr_Format(PyExc_TypeError, "'v_cache' must be %s like 'k_cache', got %s", in->view[KC].dtype_str,
                     in->view[VC].dtype_str);
        return -1;
    }
    if (accumulate && od != GVR_DTYPE_F32) {
        PyErr_Format(PyExc_ValueError, "'out' of prr.repair must be float32 (a state meant to be repaired is kept in "
                     "float32), got %s", in->view[OUT].dtype_str);
        return -1;
    }
    if (od != qd && od != GVR_DTYPE_F32) {
        PyErr_Format(PyExc_ValueError, "'out' must have q's dtype (%s) or float32, got %s", in->view[Q].dtype_str,
                     in->view[OUT].dtype_str);
        return -1;
    }
    const gvr_view *xv = &in->view[EXC], *cv = &in->view[CNT], *av = &in->view[CAST];
    if ((xv->data || cv->data || av->data) && !accumulate) {
        PyErr_Format(PyExc_ValueError, "%s: 'exclude', 'counts' and 'cast_out' belong to prr.repair", op);
        return -1;
    }
    if ((xv->data || cv->data || av->data) && p->part_out) {
        PyErr_SetString(PyExc_ValueError, "prr.repair: 'exclude', 'counts' and 'cast_out' do not combine with 'partials'");
        return -1;
    }
    if (xv->data) {
        if (xv->shape[1] != 1 && xv->shape[1] != p->Hsel) {
            PyErr_Format(PyExc_ValueError, "'exclude' must have shape [B, Hx, nx] with Hx = 1 or the selection's heads "
                         "Hsel = %d (from 'indices'), got Hx = %lld", p->Hsel, (long long)xv->shape[1]);
            return -1;
        }
        if (xv->shape[2] > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "'exclude' must have fewer than 2^31 entries per row");
            return -1;
        }
    }
    if (cv->data && cv->shape[0] != 2 && cv->shape[0] != 4) {
        PyErr_Format(PyExc_ValueError, "'counts' must be int64 of shape [2] or [4], got [%lld]", (long long)cv->shape[0]);
        return -1;
    }
    if (cv->data && cv->strides[0] != 1) {
        PyErr_Format(PyExc_ValueError, "'counts' must be contiguous, got a stride of %lld elements",
                     (long long)cv->strides[0]);
        return -1;
    }
    if (av->data && av->dtype != in->view[Q].dtype && av->dtype != GVR_DTYPE_F32) {
        PyErr_Format(PyExc_ValueError, "'cast_out' must have q's dtype (%s) or float32, got %s", in->view[Q].dtype_str,
                     av->dtype_str);
        return -1;
    }
    if ((int64_t)p->n * (p->block_table ? p->block_size : 1) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "'indices' names more than 2^31 tokens per row");
        return -1;
    }
    if (in->device == GVR_DEV_CUDA) {
        if (qd == GVR_DTYPE_F32) {
            PyErr_SetString(PyExc_ValueError, "'q' on CUDA must be float16 or bfloat16 (float32 q and caches are "
                            "served on the CPU), got float32");
            return -1;
        }
        if (!gvr_attention_cuda_head_dim_ok(p->D)) {
            PyErr_Format(PyExc_ValueError, "'q' on CUDA must have head dim D = 64, 128 or 256, got D = %d", p->D);
            return -1;
        }
        /* the kernels read K and V in pieces of 8 elements (16 bytes; 8 for fp8) */
        const int piece = 8 * (int)in->view[KC].itemsize;
        const struct {
            const char *name;
            const void *ptr;
            int64_t s[3];
        } vec[2] = {{"k_cache", p->k, {p->k_stride_page, p->k_stride_tok, p->k_stride_head}},
                    {"v_cache", p->v, {p->v_stride_page, p->v_stride_tok, p->v_stride_head}}};
        for (int i = 0; i < 2; i++)
            if ((uintptr_t)vec[i].ptr % piece || vec[i].s[0] % 8 || vec[i].s[1] % 8 || vec[i].s[2] % 8) {
                PyErr_Format(PyExc_ValueError, "'%s' on CUDA must start on a %d-byte boundary with strides in "
                             "multiples of 8 elements (%d bytes), got address %% %d = %d and strides (%lld, %lld, "
                             "%lld)", vec[i].name, piece, piece, piece, (int)((uintptr_t)vec[i].ptr % piece),
                             (long long)vec[i].s[0], (long long)vec[i].s[1], (long long)vec[i].s[2]);
                return -1;
            }
        if (p->Hq / p->Hkv > GVR_ATTN_MAX_GQA) {
            PyErr_Format(PyExc_ValueError, "the GQA ratio Hq / Hkv on CUDA must be at most %d, got %d / %d",
                         GVR_ATTN_MAX_GQA, p->Hq, p->Hkv);
            return -1;
        }
    }
    return 0;
}

static void fill_attention(const gvr_intake *in, gvr_attention_params *p)
{
    const gvr_view *q = &in->view[Q], *k = &in->view[KC], *v = &in->view[VC], *ix = &in->view[IDX],
                   *bt = &in->view[BT], *ln = &in->view[LEN], *o = &in->view[OUT], *l = &in->view[LSE],
                   *po = &in->view[POUT], *pl = &in->view[PLSE];
    memset(p, 0, sizeof *p);
    p->dtype = gvr_elem_of(q->dtype);
    p->kv_dtype = gvr_elem_of(k->dtype);
    p->k_scale = 1.0f;
    p->v_scale = 1.0f;
    p->B = (int32_t)q->shape[0];
    p->Hq = (int32_t)q->shape[1];
    p->D = (int32_t)q->shape[2];
    p->Hkv = (int32_t)k->shape[2];
    p->q = q->data;
    p->q_stride_b = q->strides[0];
    p->q_stride_h = q->strides[1];
    p->k = k->data;
    p->k_stride_page = k->strides[0];
    p->k_stride_tok = k->strides[1];
    p->k_stride_head = k->strides[2];
    p->v = v->data;
    p->v_stride_page = v->strides[0];
    p->v_stride_tok = v->strides[1];
    p->v_stride_head = v->strides[2];
    p->num_pages = k->shape[0];
    p->P = (int32_t)k->shape[1];
    p->indices = (const int32_t *)ix->data;
    p->idx_stride_b = ix->strides[0];
    p->idx_stride_h = ix->strides[1];
    p->Hsel = (int32_t)ix->shape[1];
    p->n = (int32_t)ix->shape[2];
    p->block_table = (const int32_t *)bt->data;
    p->bt_stride_b = bt->data ? bt->strides[0] : 0;
    p->max_pages = bt->data ? (int32_t)bt->shape[1] : 0;
    p->lengths = (const int32_t *)ln->data;
    p->out = o->data;
    p->out_dtype = gvr_elem_of(o->dtype);
    p->out_stride_b = o->strides[0];
    p->out_stride_h = o->strides[1];
    p->lse = (float *)l->data;
    p->lse_stride_b = l->strides[0];
    p->lse_stride_h = l->strides[1];
    if (po->data) {
        p->part_out = (float *)po->data;
        p->part_out_stride_b = po->strides[0];
        p->part_out_stride_h = po->strides[1];
        p->part_out_stride_e = po->strides[2];
    }
    if (pl->data) {
        p->part_lse = (float *)pl->data;
        p->part_lse_stride_b = pl->strides[0];
        p->part_lse_stride_h = pl->strides[1];
    }
    const gvr_view *x = &in->view[EXC], *c = &in->view[CNT], *a = &in->view[CAST];
    if (x->data) {
        p->exclude = (const int32_t *)x->data;
        p->exc_stride_b = x->strides[0];
        p->exc_stride_h = x->strides[1];
        p->Hx = (int32_t)x->shape[1];
        p->nx = (int32_t)x->shape[2];
    }
    if (c->data) {
        p->counts = (int64_t *)c->data;
        p->ncounts = (int32_t)c->shape[0];
    }
    if (a->data) {
        p->cast_out = a->data;
        p->cast_dtype = gvr_elem_of(a->dtype);
        p->cast_stride_b = a->strides[0];
        p->cast_stride_h = a->strides[1];
    }
}

static int cpu_missed_fn(const void *p) { return prr_missed_cpu((const gvr_missed_params *)p); }

/* The CPU form of prr.repair's extras around the attention: the excluded entries removed first (the
 * entries of gvr_prr_missed, into a scratch index array, with the counts), the result converted after. */
static int cpu_repair_prepare(gvr_attention_params *p, int32_t **scratch)
{
    *scratch = NULL;
    if (!p->exclude && !p->counts)
        return 0;
    int64_t c4[4] = {0, 0, 0, 0};
    if (p->exclude) {
        const size_t cnt = (size_t)p->B * (size_t)p->Hsel * (size_t)(p->n ? p->n : 1);
        int32_t *m = malloc(cnt * sizeof *m);
        if (!m) {
            PyErr_NoMemory();
            return -1;
        }
        gvr_missed_params mp;
        memset(&mp, 0, sizeof mp);
        mp.B = p->B;
        mp.H = p->Hsel;
        mp.n_sel = p->n;
        mp.Hp = p->Hx;
        mp.n_pred = p->nx;
        mp.selected = p->indices;
        mp.sel_stride_b = p->idx_stride_b;
        mp.sel_stride_h = p->idx_stride_h;
        mp.predicted = p->exclude;
        mp.pred_stride_b = p->exc_stride_b;
        mp.pred_stride_h = p->Hx == 1 ? 0 : p->exc_stride_h;
        mp.out = m;
        mp.out_stride_b = (int64_t)p->Hsel * p->n;
        mp.out_stride_h = p->n;
        mp.counts = c4;
        if (gvr_run_on_host(cpu_missed_fn, &mp) < 0) {
            free(m);
            return -1;
        }
        p->indices = m;
        p->idx_stride_b = mp.out_stride_b;
        p->idx_stride_h = mp.out_stride_h;
        *scratch = m;
    } else {
        for (int64_t b = 0; b < p->B; b++)
            for (int64_t s = 0; s < p->Hsel; s++)
                for (int64_t e = 0; e < p->n; e++)
                    c4[1] += p->indices[b * p->idx_stride_b + s * p->idx_stride_h + e] >= 0;
    }
    for (int i = 0; i < p->ncounts; i++)
        p->counts[i] += c4[i & 1];
    return 0;
}

static void cpu_repair_cast(const gvr_attention_params *p)
{
    if (!p->cast_out)
        return;
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < p->Hq; h++) {
            const float *src = (const float *)p->out + b * p->out_stride_b + h * p->out_stride_h;
            const int64_t off = b * p->cast_stride_b + h * p->cast_stride_h;
            if (p->cast_dtype == GVR_ELEM_F32) {
                memcpy((float *)p->cast_out + off, src, (size_t)p->D * sizeof(float));
            } else {
                uint16_t *dst = (uint16_t *)p->cast_out + off;
                for (int64_t d = 0; d < p->D; d++)
                    dst[d] = p->cast_dtype == GVR_ELEM_BF16 ? gvr_f32_to_bf16(src[d]) : gvr_f32_to_f16(src[d]);
            }
        }
}

static int cpu_attention(const void *p) { return sparse_attention_cpu((const gvr_attention_params *)p); }

static int cuda_attention(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    return cu->sparse_attention((const gvr_attention_params *)p, ws, ws_bytes, stream);
}

PyObject *gvr_py_sparse_attention(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"q", "k_cache", "v_cache", "indices", "block_table", "lengths", "block_size", "scale",
                             "out", "lse", "part_out", "part_lse", "accumulate", "workspace", "stream", "nosync",
                             "exclude", "counts", "cast_out", "k_scale", "v_scale", NULL};
    PyObject *obj[ATT_NARGS] = {NULL};
    PyObject *o_bs = NULL, *o_scale = Py_None, *o_acc = Py_False, *o_stream = Py_None, *o_nosync = NULL;
    PyObject *o_ks = Py_None, *o_vs = Py_None;
    PyObject *result = NULL;
    int32_t *len_copy = NULL, *scratch = NULL;
    for (int i = 0; i < ATT_NARGS; i++)
        obj[i] = Py_None;
    gvr_intake in;
    gvr_intake_init(&in);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|OOOOOOOOOOOOOOOOO:sparse_attention", kwlist, &obj[Q],
                                     &obj[KC], &obj[VC], &obj[IDX], &obj[BT], &obj[LEN], &o_bs, &o_scale, &obj[OUT],
                                     &obj[LSE], &obj[POUT], &obj[PLSE], &o_acc, &obj[WS], &o_stream, &o_nosync,
                                     &obj[EXC], &obj[CNT], &obj[CAST], &o_ks, &o_vs))
        return NULL;
    unsigned nosync;
    intptr_t stream;
    Py_ssize_t bs = 1;
    int accumulate;
    float scale = NAN, k_scale = 1.0f, v_scale = 1.0f;
    if (gvr_parse_nosync(o_nosync, ATT_NARGS, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0 ||
        (o_bs && o_bs != Py_None && gvr_parse_int(o_bs, "block_size", &bs) < 0) ||
        parse_float(o_scale, "scale", &scale) < 0 || parse_float(o_ks, "k_scale", &k_scale) < 0 ||
        parse_float(o_vs, "v_scale", &v_scale) < 0 || gvr_parse_bool(o_acc, "accumulate", &accumulate) < 0)
        goto fail;
    if (bs > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "'block_size' must be at most %d, got %zd", INT32_MAX, bs);
        goto fail;
    }
    if (gvr_intake_run(&in, &gvr_attention_spec, obj, stream, nosync) < 0)
        goto fail;
    if (!in.view[OUT].data || !in.view[LSE].data) {
        PyErr_SetString(PyExc_TypeError, "sparse_attention: 'out' and 'lse' must be given (gvr.sparse_attention "
                        "allocates them)");
        goto fail;
    }
    gvr_attention_params p;
    fill_attention(&in, &p);
    p.block_size = (int32_t)bs;
    p.accumulate = accumulate;
    p.scale = isnan(scale) ? (float)(1.0 / sqrt((double)(p.D ? p.D : 1))) : scale;
    p.k_scale = k_scale;
    p.v_scale = v_scale;
    if (check_attention(&in, &p, accumulate) < 0)
        goto fail;
    if (in.device == GVR_DEV_CUDA) {
        const gvr_cuda_api *cu = gvr_cuda();
        if (!cu)
            goto fail;
        const gvr_view *ws = &in.view[WS];
        const size_t need = cu->attention_workspace_size(&p);
        const size_t have = ws->data ? (size_t)ws->shape[0] : 0;
        if (need > have) {
            PyErr_Format(PyExc_ValueError, "'workspace' must hold %zu bytes for this call, got %zu (gvr.sparse_attention "
                         "manages it)", need, have);
            goto fail;
        }
        if (gvr_run_on_device(&in, cuda_attention, &p, ws->data, have, stream, "gvr_sparse_attention") < 0)
            goto fail;
    } else {
        if (in.view[LEN].data) {
            if (!(len_copy = malloc((size_t)(p.B ? p.B : 1) * sizeof *len_copy))) {
                PyErr_NoMemory();
                goto fail;
            }
            if (gvr_read_host_counts(&in.view[LEN], "lengths", "max_pages * P", p.B, (int64_t)p.max_pages * p.P,
                                     len_copy) < 0)
                goto fail;
            p.lengths = len_copy;
        }
        if (cpu_repair_prepare(&p, &scratch) < 0 || gvr_run_on_host(cpu_attention, &p) < 0)
            goto fail;
        cpu_repair_cast(&p);
    }
    result = Py_BuildValue("(OO)", obj[OUT], obj[LSE]);
fail:
    free(len_copy);
    free(scratch);
    gvr_intake_release(&in);
    return result;
}

/* attention_workspace_size(device, B, Hq, Hkv, D, Hsel, n, P, num_pages, block_size, block_table, partials,
 * accumulate, dtype_code) -> bytes: what gvr_sparse_attention needs for a call of these shapes (the plan
 * depends on shapes and the device's SM count only). */
PyObject *gvr_py_attention_workspace_size(PyObject *self, PyObject *args)
{
    (void)self;
    int dev, B, Hq, Hkv, D, Hsel, n, P, bs, has_bt, partials, acc;
    long long num_pages;
    if (!PyArg_ParseTuple(args, "iiiiiiiiLiiii:attention_workspace_size", &dev, &B, &Hq, &Hkv, &D, &Hsel, &n, &P,
                          &num_pages, &bs, &has_bt, &partials, &acc))
        return NULL;
    const gvr_cuda_api *cu = gvr_cuda();
    if (!cu)
        return NULL;
    static const float dummy = 0.f;
    gvr_attention_params p;
    memset(&p, 0, sizeof p);
    p.dtype = GVR_ELEM_BF16;
    p.kv_dtype = GVR_ELEM_BF16; /* the plan does not depend on the element types */
    p.k_scale = p.v_scale = 1.0f;
    p.B = B;
    p.Hq = Hq;
    p.Hkv = Hkv;
    p.D = D;
    p.Hsel = Hsel;
    p.n = n;
    p.P = P;
    p.num_pages = num_pages;
    p.block_size = bs;
    p.block_table = has_bt ? (const int32_t *)&dummy : NULL;
    p.part_out = partials ? (float *)&dummy : NULL;
    p.part_lse = partials ? (float *)&dummy : NULL;
    p.accumulate = acc;
    p.out_dtype = acc ? GVR_ELEM_F32 : GVR_ELEM_BF16;
    if (Hkv <= 0 || Hq <= 0 || Hq % Hkv)
        return PyLong_FromLong(0); /* the call itself reports the shapes */
    int prev = -1;
    if (cu->set_device(dev, &prev))
        return gvr_cuda_raise("selecting the CUDA device");
    const size_t need = cu->attention_workspace_size(&p);
    if (prev >= 0 && prev != dev)
        cu->set_device(prev, NULL);
    return PyLong_FromSize_t(need);
}

/* ================================================================================================
 * merge_states (and in place)
 * ================================================================================================ */

enum { VA, LA, VB, LB, VO, LO, MERGE_NARGS };

static const gvr_arg_spec merge_args[MERGE_NARGS] = {
    [VA] = {"out_a", FLOATS, "B,H,D|H,D;B=1", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [LA] = {"lse_a", F32, "B,H|H;B=1", ON_CALL, 0, NULL, "out_a"},
    [VB] = {"out_b", FLOATS, "B,H,D|H,D;B=1", ON_CALL, GVR_UNIT_LAST, NULL, "out_a"},
    [LB] = {"lse_b", F32, "B,H|H;B=1", ON_CALL, 0, NULL, "out_a"},
    [VO] = {"out", FLOATS, "B,H,D|H,D;B=1", ON_CALL, GVR_OUTPUT | GVR_UNIT_LAST, NULL, "out_a"},
    [LO] = {"lse", F32, "B,H|H;B=1", ON_CALL, GVR_OUTPUT, NULL, "out_a"},
};
static const gvr_spec merge_spec = {"merge_states", MERGE_NARGS, merge_args};

/* in place: the first state is written */
static const gvr_arg_spec merge_inplace_args[4] = {
    {"out", FLOATS, "B,H,D|H,D;B=1", ON_CALL, GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
    {"lse", F32, "B,H|H;B=1", ON_CALL, GVR_OUTPUT, NULL, "out"},
    {"out_b", FLOATS, "B,H,D|H,D;B=1", ON_CALL, GVR_UNIT_LAST, NULL, "out"},
    {"lse_b", F32, "B,H|H;B=1", ON_CALL, 0, NULL, "out"},
};
static const gvr_spec merge_inplace_spec = {"merge_states_in_place", 4, merge_inplace_args};

const char gvr_merge_doc[] =
    "merge_states(out_a, lse_a, out_b, lse_b, out, lse, base2, stream, nosync)\n--\n\n"
    "Exact merge of two attention states; out=None and lse=None: in place into (out_a, lse_a).\n"
    "See gvr.merge_states.";

static void state_strides(const gvr_view *v, int is_lse, int64_t *sb, int64_t *sh)
{
    const int one = v->ndim == (is_lse ? 1 : 2);
    *sb = one ? 0 : v->strides[0];
    *sh = v->strides[one ? 0 : 1];
}

static int cpu_merge(const void *p) { return merge_states_cpu((const gvr_merge_params *)p); }

static int cuda_merge(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    (void)ws;
    (void)ws_bytes;
    return cu->merge_states((const gvr_merge_params *)p, stream);
}

PyObject *gvr_py_merge_states(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"out_a", "lse_a", "out_b", "lse_b", "out", "lse", "base2", "stream", "nosync", NULL};
    PyObject *obj[MERGE_NARGS] = {NULL};
    PyObject *o_base2 = Py_False, *o_stream = Py_None, *o_nosync = NULL, *result = NULL;
    for (int i = 0; i < MERGE_NARGS; i++)
        obj[i] = Py_None;
    gvr_intake in;
    gvr_intake_init(&in);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|OOOOO:merge_states", kwlist, &obj[VA], &obj[LA], &obj[VB],
                                     &obj[LB], &obj[VO], &obj[LO], &o_base2, &o_stream, &o_nosync))
        return NULL;
    unsigned nosync;
    intptr_t stream;
    int base2;
    if (gvr_parse_nosync(o_nosync, MERGE_NARGS, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0 ||
        gvr_parse_bool(o_base2, "base2", &base2) < 0)
        goto fail;
    const int inplace = obj[VO] == Py_None && obj[LO] == Py_None;
    if (!inplace && (obj[VO] == Py_None || obj[LO] == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "merge_states: 'out' and 'lse' are given together (or neither: in place)");
        goto fail;
    }
    gvr_view *va, *la, *vb, *lb, *vo, *lo;
    if (inplace) {
        PyObject *o4[4] = {obj[VA], obj[LA], obj[VB], obj[LB]};
        if (gvr_intake_run(&in, &merge_inplace_spec, o4, stream, nosync & 15u) < 0)
            goto fail;
        va = vo = &in.view[0];
        la = lo = &in.view[1];
        vb = &in.view[2];
        lb = &in.view[3];
    } else {
        if (gvr_intake_run(&in, &merge_spec, obj, stream, nosync) < 0)
            goto fail;
        va = &in.view[VA];
        la = &in.view[LA];
        vb = &in.view[VB];
        lb = &in.view[LB];
        vo = &in.view[VO];
        lo = &in.view[LO];
    }
    gvr_merge_params p;
    memset(&p, 0, sizeof p);
    p.B = gvr_intake_dim(&in, "B");
    p.H = (int32_t)gvr_intake_dim(&in, "H");
    p.D = (int32_t)gvr_intake_dim(&in, "D");
    if (gvr_intake_dim(&in, "H") > INT32_MAX || gvr_intake_dim(&in, "D") > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "merge_states: H and D must fit in int32");
        goto fail;
    }
    p.dtype_a = gvr_elem_of(va->dtype);
    p.dtype_b = gvr_elem_of(vb->dtype);
    p.dtype_out = gvr_elem_of(vo->dtype);
    p.va = va->data;
    state_strides(va, 0, &p.va_stride_b, &p.va_stride_h);
    p.la = (const float *)la->data;
    state_strides(la, 1, &p.la_stride_b, &p.la_stride_h);
    p.vb = vb->data;
    state_strides(vb, 0, &p.vb_stride_b, &p.vb_stride_h);
    p.lb = (const float *)lb->data;
    state_strides(lb, 1, &p.lb_stride_b, &p.lb_stride_h);
    p.vo = vo->data;
    state_strides(vo, 0, &p.vo_stride_b, &p.vo_stride_h);
    p.lo = (float *)lo->data;
    state_strides(lo, 1, &p.lo_stride_b, &p.lo_stride_h);
    p.base2 = base2;
    if ((in.device == GVR_DEV_CUDA ? gvr_run_on_device(&in, cuda_merge, &p, NULL, 0, stream, "gvr_merge_states")
                                   : gvr_run_on_host(cpu_merge, &p)) < 0)
        goto fail;
    result = inplace ? Py_BuildValue("(OO)", obj[VA], obj[LA]) : Py_BuildValue("(OO)", obj[VO], obj[LO]);
fail:
    gvr_intake_release(&in);
    return result;
}

/* ================================================================================================
 * prr.missed
 * ================================================================================================ */

enum { SEL, PRED, MOUT, MCNT, MISSED_NARGS };

static const gvr_arg_spec missed_args[MISSED_NARGS] = {
    [SEL] = {"selected", I32, "B,H,n_sel", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [PRED] = {"predicted", I32, "B,Hp,n_pred", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [MOUT] = {"out", I32, "B,H,n_sel", ON_CALL, GVR_OUTPUT | GVR_ALLOC | GVR_UNIT_LAST, NULL, NULL},
    [MCNT] = {"counts", I64, "4", ON_CALL, GVR_OPTIONAL | GVR_OUTPUT | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
};
static const gvr_spec missed_spec = {"prr.missed", MISSED_NARGS, missed_args};

const char gvr_missed_doc[] =
    "prr_missed(selected, predicted, out, stream, nosync, counts)\n--\n\n"
    "The entries of selected absent from predicted, per row and head, -1 padded; counts (int64 [4] or None):\n"
    "[hits, selected entries] of this call, then += into [2:4]. See gvr.prr.missed.";

static int cpu_missed(const void *p) { return prr_missed_cpu((const gvr_missed_params *)p); }

static int cuda_missed(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    (void)ws;
    (void)ws_bytes;
    return cu->prr_missed((const gvr_missed_params *)p, stream);
}

PyObject *gvr_py_prr_missed(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"selected", "predicted", "out", "stream", "nosync", "counts", NULL};
    PyObject *obj[MISSED_NARGS] = {NULL, NULL, Py_None, Py_None};
    PyObject *o_stream = Py_None, *o_nosync = NULL, *result = NULL;
    gvr_intake in;
    gvr_intake_init(&in);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OOOO:prr_missed", kwlist, &obj[SEL], &obj[PRED], &obj[MOUT],
                                     &o_stream, &o_nosync, &obj[MCNT]))
        return NULL;
    unsigned nosync;
    intptr_t stream;
    if (gvr_parse_nosync(o_nosync, MISSED_NARGS, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0 ||
        gvr_intake_run(&in, &missed_spec, obj, stream, nosync) < 0)
        goto fail;
    const gvr_view *s = &in.view[SEL], *pr = &in.view[PRED], *o = &in.view[MOUT];
    gvr_missed_params p;
    memset(&p, 0, sizeof p);
    const int64_t B = s->shape[0], H = s->shape[1], ns = s->shape[2], Hp = pr->shape[1], np_ = pr->shape[2];
    if (Hp != 1 && Hp != H) {
        PyErr_Format(PyExc_ValueError, "'predicted' must have shape [B, Hp, n_pred] with Hp = 1 or H = %lld (from "
                     "'selected'), got Hp = %lld", (long long)H, (long long)Hp);
        goto fail;
    }
    if (B > INT32_MAX || H > INT32_MAX || ns > INT32_MAX || np_ > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "prr.missed: dimensions must fit in int32");
        goto fail;
    }
    p.B = (int32_t)B;
    p.H = (int32_t)H;
    p.n_sel = (int32_t)ns;
    p.Hp = (int32_t)Hp;
    p.n_pred = (int32_t)np_;
    p.selected = (const int32_t *)s->data;
    p.sel_stride_b = s->strides[0];
    p.sel_stride_h = s->strides[1];
    p.predicted = (const int32_t *)pr->data;
    p.pred_stride_b = pr->strides[0];
    p.pred_stride_h = Hp == 1 ? 0 : pr->strides[1];
    p.out = (int32_t *)o->data;
    p.out_stride_b = o->strides[0];
    p.out_stride_h = o->strides[1];
    p.counts = (int64_t *)in.view[MCNT].data;
    if ((in.device == GVR_DEV_CUDA ? gvr_run_on_device(&in, cuda_missed, &p, NULL, 0, stream, "gvr_prr_missed")
                                   : gvr_run_on_host(cpu_missed, &p)) < 0)
        goto fail;
    result = gvr_intake_object(&in, obj, MOUT);
    Py_INCREF(result);
fail:
    gvr_intake_release(&in);
    return result;
}

/* ================================================================================================
 * prr.finalize
 * ================================================================================================ */

enum { FPO, FPL, FPRED, FSEL, FOUT, FLSE, FIN_NARGS };

static const gvr_arg_spec finalize_args[FIN_NARGS] = {
    [FPO] = {"part_out", F32, "B,Hq,n_pred,D", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [FPL] = {"part_lse", F32, "B,Hq,n_pred", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [FPRED] = {"predicted", I32, "B,Hsel,n_pred", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [FSEL] = {"selected", I32, "B,Hsel,n_sel", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [FOUT] = {"out", FLOATS, "B,Hq,D", ON_CALL, GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
    [FLSE] = {"lse", F32, "B,Hq", ON_CALL, GVR_OUTPUT, NULL, NULL},
};
static const gvr_spec finalize_spec = {"prr.finalize", FIN_NARGS, finalize_args};

const char gvr_finalize_doc[] =
    "prr_finalize(part_out, part_lse, predicted, selected, out, lse, stream, nosync)\n--\n\n"
    "Exact mode: the merge of the partial states of the predicted entries that were selected.\n"
    "See gvr.prr.finalize.";

static int cpu_finalize(const void *p) { return prr_finalize_cpu((const gvr_finalize_params *)p); }

static int cuda_finalize(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    (void)ws;
    (void)ws_bytes;
    return cu->prr_finalize((const gvr_finalize_params *)p, stream);
}

PyObject *gvr_py_prr_finalize(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"part_out", "part_lse", "predicted", "selected", "out", "lse", "stream", "nosync", NULL};
    PyObject *obj[FIN_NARGS] = {NULL};
    PyObject *o_stream = Py_None, *o_nosync = NULL, *result = NULL;
    gvr_intake in;
    gvr_intake_init(&in);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOO|OO:prr_finalize", kwlist, &obj[FPO], &obj[FPL], &obj[FPRED],
                                     &obj[FSEL], &obj[FOUT], &obj[FLSE], &o_stream, &o_nosync))
        return NULL;
    unsigned nosync;
    intptr_t stream;
    if (gvr_parse_nosync(o_nosync, FIN_NARGS, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0 ||
        gvr_intake_run(&in, &finalize_spec, obj, stream, nosync) < 0)
        goto fail;
    const gvr_view *po = &in.view[FPO], *pl = &in.view[FPL], *pr = &in.view[FPRED], *s = &in.view[FSEL],
                   *o = &in.view[FOUT], *l = &in.view[FLSE];
    const int64_t B = po->shape[0], Hq = po->shape[1], npred = po->shape[2], D = po->shape[3], Hsel = pr->shape[1],
                  nsel = s->shape[2];
    if (Hsel == 0 || Hq % Hsel) {
        PyErr_Format(PyExc_ValueError, "'predicted' must have shape [B, Hsel, n_pred] with Hsel dividing Hq = %lld "
                     "(from 'part_out'), got Hsel = %lld", (long long)Hq, (long long)Hsel);
        goto fail;
    }
    if (B > INT32_MAX || Hq > INT32_MAX || npred > INT32_MAX || nsel > INT32_MAX || D > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "prr.finalize: dimensions must fit in int32");
        goto fail;
    }
    gvr_finalize_params p;
    memset(&p, 0, sizeof p);
    p.B = (int32_t)B;
    p.Hq = (int32_t)Hq;
    p.Hsel = (int32_t)Hsel;
    p.n_pred = (int32_t)npred;
    p.n_sel = (int32_t)nsel;
    p.D = (int32_t)D;
    p.part_out = (const float *)po->data;
    p.part_out_stride_b = po->strides[0];
    p.part_out_stride_h = po->strides[1];
    p.part_out_stride_e = po->strides[2];
    p.part_lse = (const float *)pl->data;
    p.part_lse_stride_b = pl->strides[0];
    p.part_lse_stride_h = pl->strides[1];
    p.predicted = (const int32_t *)pr->data;
    p.pred_stride_b = pr->strides[0];
    p.pred_stride_h = pr->strides[1];
    p.selected = (const int32_t *)s->data;
    p.sel_stride_b = s->strides[0];
    p.sel_stride_h = s->strides[1];
    p.out = o->data;
    p.out_dtype = gvr_elem_of(o->dtype);
    p.out_stride_b = o->strides[0];
    p.out_stride_h = o->strides[1];
    p.lse = (float *)l->data;
    p.lse_stride_b = l->strides[0];
    p.lse_stride_h = l->strides[1];
    if ((in.device == GVR_DEV_CUDA ? gvr_run_on_device(&in, cuda_finalize, &p, NULL, 0, stream, "gvr_prr_finalize")
                                   : gvr_run_on_host(cpu_finalize, &p)) < 0)
        goto fail;
    result = Py_BuildValue("(OO)", obj[FOUT], obj[FLSE]);
fail:
    gvr_intake_release(&in);
    return result;
}

/* SparDA: the spec, CPU call and CUDA call of the compressed keys (build; update in place with start).
 * Semantics: kernels/gvr_kernels.h, section "SparDA compressed keys". forecast_select is composed in
 * gvr/sparda.py from prr.select_blocks. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "cpu/sparda_cpu.h"
#include "cuda_lib.h"
#include "dispatch.h"
#include "intake.h"
#include "ops.h"

#define FLOATS (GVR_DT(GVR_DTYPE_F32) | GVR_DT(GVR_DTYPE_F16) | GVR_DT(GVR_DTYPE_BF16))
#define I32 GVR_DT(GVR_DTYPE_I32)
#define ON_CALL (GVR_HOST | GVR_DEVICE)

enum { CK, CBT, CEND, CST, COUT, CK_NARGS };

static const gvr_arg_spec ckeys_args[CK_NARGS] = {
    [CK] = {"k_cache", FLOATS | GVR_DT(GVR_DTYPE_F8E4M3), "num_pages,P,Hkv,D", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [CBT] = {"block_table", I32, "B,max_pages", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [CEND] = {"end", I32, "B", ON_CALL, GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [CST] = {"start", I32, "B", ON_CALL, GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    /* k_cache's dtype; an fp8 cache's: float16, bfloat16 or float32 (checked in gvr_py_sparda_compressed_keys) */
    [COUT] = {"ktilde", FLOATS, "B,Hkv,Nc,D", ON_CALL, GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
};
static const gvr_spec ckeys_spec = {"sparda.compressed_keys", CK_NARGS, ckeys_args};

const char gvr_sparda_ckeys_doc[] =
    "sparda_compressed_keys(k_cache, block_table, end, ktilde, kernel, stride, start, stream, nosync)\n--\n\n"
    "Mean-pooled keys (windows of kernel tokens every stride) of a paged K cache into ktilde\n"
    "[B, Hkv, Nc, D]; with start: update in place with the windows the tokens [start, end) complete.\n"
    "See gvr.sparda.compressed_keys and gvr.sparda.update_compressed_keys.";

static int cpu_ckeys(const void *p) { return sparda_compressed_keys_cpu((const gvr_sparda_ckeys_params *)p); }

static int cuda_ckeys(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    (void)ws;
    (void)ws_bytes;
    return cu->sparda_compressed_keys((const gvr_sparda_ckeys_params *)p, stream);
}

static int parse_pos_int(PyObject *o, const char *name, int32_t *out)
{
    Py_ssize_t v;
    if (gvr_parse_int(o, name, &v) < 0)
        return -1;
    if (v < 1 || v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "'%s' must lie in [1, %d], got %zd", name, INT32_MAX, v);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

PyObject *gvr_py_sparda_compressed_keys(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"k_cache", "block_table", "end", "ktilde", "kernel", "stride", "start", "stream",
                             "nosync", NULL};
    PyObject *obj[CK_NARGS] = {Py_None, Py_None, Py_None, Py_None, Py_None};
    PyObject *o_kernel = NULL, *o_stride = NULL, *o_stream = Py_None, *o_nosync = NULL, *result = NULL;
    int32_t *copy = NULL;
    gvr_intake in;
    gvr_intake_init(&in);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOO|OOO:sparda_compressed_keys", kwlist, &obj[CK], &obj[CBT],
                                     &obj[CEND], &obj[COUT], &o_kernel, &o_stride, &obj[CST], &o_stream, &o_nosync))
        return NULL;
    const int update = obj[CST] != Py_None;
    const char *op = update ? "sparda.update_compressed_keys" : "sparda.compressed_keys";
    unsigned nosync;
    intptr_t stream;
    int32_t K, S;
    if (gvr_parse_nosync(o_nosync, CK_NARGS, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0 ||
        parse_pos_int(o_kernel, "kernel", &K) < 0 || parse_pos_int(o_stride, "stride", &S) < 0)
        goto fail;
    if (update && obj[CEND] == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s: 'end' must be given with 'start'", op);
        goto fail;
    }
    if (gvr_intake_run(&in, &ckeys_spec, obj, stream, nosync) < 0)
        goto fail;
    const gvr_view *k = &in.view[CK], *bt = &in.view[CBT], *en = &in.view[CEND], *st = &in.view[CST],
                   *o = &in.view[COUT];
    const int64_t B = bt->shape[0], maxp = bt->shape[1], Hkv = k->shape[2], D = k->shape[3], P = k->shape[1],
                  Nc = o->shape[2];
    if (B > INT32_MAX || Hkv > INT32_MAX || D > INT32_MAX || P > INT32_MAX || maxp > INT32_MAX || Nc > INT32_MAX ||
        maxp * P > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: B, Hkv, D, P, max_pages and max_pages * P must fit in int32", op);
        goto fail;
    }
    if (D < 1 || P < 1) {
        PyErr_Format(PyExc_ValueError, "'k_cache' must have shape [num_pages, P, Hkv, D] with P >= 1 and D >= 1, got "
                     "P = %lld, D = %lld", (long long)P, (long long)D);
        goto fail;
    }
    const int64_t cap = maxp * P, want = cap >= K ? (cap - K) / S + 1 : 0;
    if (Nc != want) {
        PyErr_Format(PyExc_ValueError, "'ktilde' must have shape [B, Hkv, Nc, D] with Nc = the windows of kernel %d "
                     "every %d in max_pages * P = %lld tokens = %lld, got Nc = %lld", K, S, (long long)cap,
                     (long long)want, (long long)Nc);
        goto fail;
    }
    if (o->dtype != k->dtype && k->dtype != GVR_DTYPE_F8E4M3) {
        PyErr_Format(PyExc_TypeError, "'ktilde' must be %s like 'k_cache', got %s", k->dtype_str, o->dtype_str);
        goto fail;
    }
    gvr_sparda_ckeys_params p;
    memset(&p, 0, sizeof p);
    p.dtype = gvr_elem_of(o->dtype);
    p.k_dtype = gvr_elem_of(k->dtype);
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
    p.kernel = K;
    p.stride = S;
    p.Nc = (int32_t)Nc;
    p.start = (const int32_t *)st->data;
    p.end = (const int32_t *)en->data;
    p.out = o->data;
    p.out_stride_b = o->strides[0];
    p.out_stride_h = o->strides[1];
    p.out_stride_j = o->strides[2];
    if (in.device == GVR_DEV_CUDA) {
        if (k->dtype == GVR_DTYPE_F32) {
            PyErr_SetString(PyExc_ValueError, "'k_cache' on CUDA must be float16, bfloat16 or float8_e4m3fn (float32 "
                            "is served on the CPU), got float32");
            goto fail;
        }
        if (o->dtype == GVR_DTYPE_F32) {
            PyErr_SetString(PyExc_ValueError, "'ktilde' on CUDA must be float16 or bfloat16 (float32 is served on the "
                            "CPU), got float32");
            goto fail;
        }
        if (gvr_run_on_device(&in, cuda_ckeys, &p, NULL, 0, stream, update ? "gvr_sparda_compressed_keys (update)"
                                                                 : "gvr_sparda_compressed_keys") < 0)
            goto fail;
    } else {
        if (gvr_read_host_range(en, st, update, B, cap, &copy, &p.end, &p.start) < 0 ||
            gvr_run_on_host(cpu_ckeys, &p) < 0)
            goto fail;
    }
    result = obj[COUT];
    Py_INCREF(result);
fail:
    free(copy);
    gvr_intake_release(&in);
    return result;
}

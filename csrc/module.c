/* gvr._C: argument intake and validation for every operator, then the CPU implementation (GIL
 * released) or the CUDA library. Every check lives here, once; nothing below validates. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define PY_ARRAY_UNIQUE_SYMBOL gvr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#define NPY_TARGET_VERSION NPY_1_23_API_VERSION
#include <numpy/arrayobject.h>

#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "buffer.h"
#include "cuda_lib.h"
#include "topk_cpu.h"

static int num_threads = 0; /* 0: OpenMP's default */

static int is_host(gvr_device d) { return d == GVR_DEV_CPU || d == GVR_DEV_CUDA_HOST; }

/* Byte range [lo, hi) covered by a view of 4-byte items (empty views cover nothing). */
static void view_extent(const gvr_view *v, uintptr_t *lo, uintptr_t *hi)
{
    uintptr_t a = (uintptr_t)v->data, b = (uintptr_t)v->data;
    for (int i = 0; i < v->ndim && i < GVR_VIEW_MAX_NDIM; i++) {
        if (v->shape[i] == 0) {
            *lo = *hi = 0;
            return;
        }
        int64_t span = (v->shape[i] - 1) * v->strides[i] * 4;
        if (span < 0)
            a += (uintptr_t)span;
        else
            b += (uintptr_t)span;
    }
    *lo = a;
    *hi = b + 4;
}

static int overlaps(const gvr_view *a, const gvr_view *b)
{
    if (!a->data || !b->data || a->device != b->device)
        return 0;
    uintptr_t alo, ahi, blo, bhi;
    view_extent(a, &alo, &ahi);
    view_extent(b, &blo, &bhi);
    return alo < bhi && blo < ahi && alo != ahi && blo != bhi;
}

static int check_same_device(const gvr_view *ref, const gvr_view *v)
{
    if (!v->name)
        return 0; /* argument not given */
    int ok = (is_host(ref->device) && is_host(v->device)) ||
             (ref->device == GVR_DEV_CUDA && v->device == GVR_DEV_CUDA && ref->device_id == v->device_id);
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "mixed devices: '%s' is on %s:%d but '%s' is on %s:%d", ref->name,
                     gvr_device_str(ref->device), ref->device_id, v->name, gvr_device_str(v->device),
                     v->device_id);
        return -1;
    }
    return 0;
}

static int check_int_arg(PyObject *o, const char *name, Py_ssize_t *val)
{
    if (PyBool_Check(o) || !PyIndex_Check(o)) {
        PyErr_Format(PyExc_TypeError, "'%s' must be an int, got %s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    *val = PyNumber_AsSsize_t(o, PyExc_OverflowError);
    if (*val == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "'%s' is out of range", name);
        return -1;
    }
    if (*val < 0) {
        PyErr_Format(PyExc_ValueError, "'%s' must not be negative, got %zd", name, *val);
        return -1;
    }
    return 0;
}

static int check_dtype(const gvr_view *v, gvr_dtype want)
{
    if (v->dtype != want) {
        PyErr_Format(PyExc_TypeError, "'%s' must be %s, got %s", v->name, want == GVR_DTYPE_F32 ? "float32" : "int32",
                     v->dtype_str);
        return -1;
    }
    return 0;
}

static int check_unit_inner(const gvr_view *v)
{
    for (int i = 0; i < v->ndim && i < GVR_VIEW_MAX_NDIM; i++)
        if (v->shape[i] == 0)
            return 0; /* no elements: strides are meaningless */
    if (v->ndim >= 1 && v->shape[v->ndim - 1] > 1 && v->strides[v->ndim - 1] != 1) {
        PyErr_Format(PyExc_ValueError, "'%s' must have unit stride along its last dimension, got stride %lld",
                     v->name, (long long)v->strides[v->ndim - 1]);
        return -1;
    }
    return 0;
}

static intptr_t parse_stream(PyObject *o)
{
    if (!o || o == Py_None)
        return 0;
    Py_ssize_t s = PyNumber_AsSsize_t(o, NULL);
    if (s == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        void *p = PyLong_Check(o) ? PyLong_AsVoidPtr(o) : NULL;
        if (!p || PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "'stream' must be an int (a cudaStream_t handle) or None, got %s",
                         Py_TYPE(o)->tp_name);
            return -1;
        }
        return (intptr_t)p;
    }
    return (intptr_t)s;
}

PyDoc_STRVAR(topk_doc,
             "topk_decode(scores, k, prev_topk, lengths, out, sorted, stream, method, nosync)\n--\n\n"
             "Exact Top-K of each row of scores into out (int32). See gvr.topk_decode.\n"
             "nosync: bit i set (i = 0 scores, 1 prev_topk, 2 lengths, 3 out) when that argument's\n"
             "producer runs on `stream` as its current stream: its DLPack export gets stream=-1.");

static PyObject *py_topk_decode(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"scores", "k", "prev_topk", "lengths", "out", "sorted", "stream", "method", "nosync", NULL};
    PyObject *o_scores, *o_k, *o_prev = Py_None, *o_len = Py_None, *o_out = Py_None, *o_sorted = Py_False,
                                 *o_stream = Py_None;
    PyObject *o_method = NULL, *o_nosync = NULL;
    long nosync = 0;
    gvr_view sc = {0}, pv = {0}, ln = {0}, ot = {0};
    int32_t *len_copy = NULL;
    PyObject *result = NULL, *own_out = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OOOOOOO:topk_decode", kwlist, &o_scores, &o_k, &o_prev,
                                     &o_len, &o_out, &o_sorted, &o_stream, &o_method, &o_nosync))
        return NULL;
    if (o_nosync && o_nosync != Py_None) {
        nosync = PyLong_Check(o_nosync) && !PyBool_Check(o_nosync) ? PyLong_AsLong(o_nosync) : -1;
        if (nosync == -1 && PyErr_Occurred())
            PyErr_Clear();
        if (nosync < 0 || nosync > 15) {
            PyErr_SetString(PyExc_ValueError, "'nosync' must be an int bitmask in [0, 15] (bit i: argument i is on its "
                                              "producer's current stream)");
            return NULL;
        }
    }
    const char *method_s = "auto";
    if (o_method && o_method != Py_None) {
        if (!PyUnicode_Check(o_method)) {
            PyErr_Format(PyExc_TypeError, "'method' must be a str ('auto', 'gvr' or 'radix'), got %s",
                         Py_TYPE(o_method)->tp_name);
            return NULL;
        }
        method_s = PyUnicode_AsUTF8(o_method);
        if (!method_s)
            return NULL;
    }
    int method;
    if (!strcmp(method_s, "auto"))
        method = GVR_TOPK_AUTO;
    else if (!strcmp(method_s, "gvr"))
        method = GVR_TOPK_GVR;
    else if (!strcmp(method_s, "radix"))
        method = GVR_TOPK_RADIX;
    else {
        PyErr_Format(PyExc_ValueError, "'method' must be 'auto', 'gvr' or 'radix', got '%s'", method_s);
        return NULL;
    }
    intptr_t stream = parse_stream(o_stream);
    if (stream == -1 && PyErr_Occurred())
        return NULL;
    if (stream < 0) {
        PyErr_Format(PyExc_ValueError, "'stream' must be a CUDA stream handle (an int >= 0) or None, got %lld",
                     (long long)stream);
        return NULL;
    }
    /* the stream each argument's producer is asked to order its work before */
#define ARG_STREAM(bit) ((nosync >> (bit)) & 1 ? GVR_STREAM_PRODUCER_CURRENT : stream)

    /* scores */
    if (gvr_view_get(o_scores, "scores", 0, ARG_STREAM(0), &sc) < 0)
        goto fail;
    if (check_dtype(&sc, GVR_DTYPE_F32) < 0)
        goto fail;
    if (sc.ndim != 1 && sc.ndim != 2) {
        PyErr_Format(PyExc_ValueError, "'scores' must have shape [B, N] or [N], got %d dimensions", sc.ndim);
        goto fail;
    }
    if (check_unit_inner(&sc) < 0)
        goto fail;
    int one_d = sc.ndim == 1;
    int64_t B = one_d ? 1 : sc.shape[0], N = sc.shape[sc.ndim - 1];
    int64_t row_stride = one_d ? N : sc.strides[0];
    if (N > INT32_MAX || B > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "'scores' has shape too large for int32 indices (B=%lld, N=%lld)",
                     (long long)B, (long long)N);
        goto fail;
    }

    /* k */
    Py_ssize_t k;
    if (check_int_arg(o_k, "k", &k) < 0)
        goto fail;
    if (k > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "'k' must be at most %d, got %zd", INT32_MAX, k);
        goto fail;
    }

    /* prev_topk */
    int64_t Kp = 0, prev_stride = 0;
    if (o_prev != Py_None) {
        if (gvr_view_get(o_prev, "prev_topk", 0, ARG_STREAM(1), &pv) < 0)
            goto fail;
        if (check_dtype(&pv, GVR_DTYPE_I32) < 0)
            goto fail;
        if (pv.ndim == 1) {
            Kp = pv.shape[0];
            prev_stride = 0;
        } else if (pv.ndim == 2) {
            if (pv.shape[0] != B) {
                PyErr_Format(PyExc_ValueError, "'prev_topk' must have shape [%lld, Kp] or [Kp], got [%lld, %lld]",
                             (long long)B, (long long)pv.shape[0], (long long)pv.shape[1]);
                goto fail;
            }
            Kp = pv.shape[1];
            prev_stride = pv.strides[0];
        } else {
            PyErr_Format(PyExc_ValueError, "'prev_topk' must have shape [B, Kp] or [Kp], got %d dimensions",
                         pv.ndim);
            goto fail;
        }
        if (check_unit_inner(&pv) < 0)
            goto fail;
        if (Kp > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "'prev_topk' is too long");
            goto fail;
        }
    }

    /* lengths */
    if (o_len != Py_None) {
        if (gvr_view_get(o_len, "lengths", 0, ARG_STREAM(2), &ln) < 0)
            goto fail;
        if (check_dtype(&ln, GVR_DTYPE_I32) < 0)
            goto fail;
        if (ln.ndim != 1 || ln.shape[0] != B) {
            if (ln.ndim == 1)
                PyErr_Format(PyExc_ValueError, "'lengths' must have shape [%lld], got [%lld]", (long long)B,
                             (long long)ln.shape[0]);
            else
                PyErr_Format(PyExc_ValueError, "'lengths' must have shape [%lld], got %d dimensions", (long long)B,
                             ln.ndim);
            goto fail;
        }
    }

    /* out: NumPy for host inputs when not given (the Python layer allocates for torch and CuPy) */
    if (o_out == Py_None) {
        if (!is_host(sc.device)) {
            PyErr_SetString(PyExc_TypeError,
                            "'out' must be given for CUDA inputs other than torch tensors and CuPy arrays");
            goto fail;
        }
        npy_intp dims[2] = {one_d ? (npy_intp)k : (npy_intp)B, (npy_intp)k};
        o_out = own_out = PyArray_SimpleNew(one_d ? 1 : 2, dims, NPY_INT32);
        if (!own_out)
            goto fail;
    }
    if (gvr_view_get(o_out, "out", 1, ARG_STREAM(3), &ot) < 0)
        goto fail;
#undef ARG_STREAM
    if (check_dtype(&ot, GVR_DTYPE_I32) < 0)
        goto fail;
    if (one_d ? (ot.ndim != 1 || ot.shape[0] != k) : (ot.ndim != 2 || ot.shape[0] != B || ot.shape[1] != k)) {
        if (one_d)
            PyErr_Format(PyExc_ValueError, "'out' must have shape [%zd] for 1-D scores", k);
        else
            PyErr_Format(PyExc_ValueError, "'out' must have shape [%lld, %zd]", (long long)B, k);
        goto fail;
    }
    if (check_unit_inner(&ot) < 0)
        goto fail;
    int64_t out_stride = one_d ? k : ot.strides[0];

    /* devices, aliasing */
    if (check_same_device(&sc, &pv) < 0 || check_same_device(&sc, &ln) < 0 || check_same_device(&sc, &ot) < 0)
        goto fail;
    if (overlaps(&ot, &sc) || overlaps(&ot, &pv) || overlaps(&ot, &ln)) {
        const char *other = overlaps(&ot, &sc) ? "scores" : overlaps(&ot, &pv) ? "prev_topk" : "lengths";
        PyErr_Format(PyExc_ValueError, "'out' must not overlap '%s'", other);
        goto fail;
    }
    int sorted = PyObject_IsTrue(o_sorted);
    if (sorted < 0)
        goto fail;

    gvr_topk_params p = {0};
    p.scores = (const float *)sc.data;
    p.row_stride = row_stride;
    p.B = (int32_t)B;
    p.N = (int32_t)N;
    p.prev = pv.data ? (const int32_t *)pv.data : NULL;
    p.prev_stride = prev_stride;
    p.Kp = (int32_t)Kp;
    p.k = (int32_t)k;
    p.sorted = sorted;
    p.method = method;
    p.out = (int32_t *)ot.data;
    p.out_stride = out_stride;

    if (is_host(sc.device)) {
        if (ln.data) {
            /* validate, and make contiguous */
            len_copy = malloc((size_t)(B ? B : 1) * sizeof *len_copy);
            if (!len_copy) {
                PyErr_NoMemory();
                goto fail;
            }
            for (int64_t b = 0; b < B; b++) {
                int32_t L = ((const int32_t *)ln.data)[b * ln.strides[0]];
                if (L < 0 || L > N) {
                    PyErr_Format(PyExc_ValueError, "'lengths' must lie in [0, %lld], got lengths[%lld] = %d",
                                 (long long)N, (long long)b, L);
                    goto fail;
                }
                len_copy[b] = L;
            }
            p.lengths = len_copy;
        }
        int rc, nt = num_threads;
#ifdef _OPENMP
        if (nt <= 0)
            nt = omp_get_max_threads();
#endif
        Py_BEGIN_ALLOW_THREADS
        rc = topk_decode_cpu(&p, nt);
        Py_END_ALLOW_THREADS
        if (rc) {
            PyErr_NoMemory();
            goto fail;
        }
    } else {
        const gvr_cuda_api *cu = gvr_cuda();
        if (!cu)
            goto fail;
        if (ln.data) {
            if (ln.shape[0] > 1 && ln.strides[0] != 1) {
                PyErr_SetString(PyExc_ValueError, "'lengths' on a CUDA device must be contiguous");
                goto fail;
            }
            p.lengths = (const int32_t *)ln.data;
            const char *chk = getenv("GVR_CHECK");
            if (chk && chk[0] == '1') {
                /* opt-in: validate device-resident lengths at the cost of a sync */
                len_copy = malloc((size_t)(B ? B : 1) * sizeof *len_copy);
                if (!len_copy) {
                    PyErr_NoMemory();
                    goto fail;
                }
                int prev_dev = -1;
                int bad = cu->set_device(sc.device_id, &prev_dev) ||
                          cu->copy_to_host(len_copy, ln.data, (size_t)B * 4, (void *)stream);
                if (prev_dev >= 0)
                    cu->set_device(prev_dev, NULL);
                if (bad) {
                    gvr_cuda_raise("reading 'lengths'");
                    goto fail;
                }
                for (int64_t b = 0; b < B; b++)
                    if (len_copy[b] < 0 || len_copy[b] > N) {
                        PyErr_Format(PyExc_ValueError, "'lengths' must lie in [0, %lld], got lengths[%lld] = %d",
                                     (long long)N, (long long)b, len_copy[b]);
                        goto fail;
                    }
            }
        }
        if (sorted && k > 4096) {
            PyErr_Format(PyExc_ValueError, "'sorted=True' on CUDA supports k <= 4096, got k = %zd", k);
            goto fail;
        }
        /* rows in 16-byte aligned coordinates: a row starting s floats past a boundary covers N + s */
        if (method == GVR_TOPK_RADIX && gvr_topk_row_positions(&p) > GVR_RADIX_MAX_POSITIONS) {
            PyErr_Format(PyExc_ValueError,
                         "'scores' rows longer than 524288 exceed the radix path (method 'gvr' or 'auto' serves them; "
                         "rows not starting on a 16-byte boundary: 524285), got N = %lld",
                         (long long)N);
            goto fail;
        }
        if (N > (1LL << 30)) {
            PyErr_Format(PyExc_ValueError, "'scores' rows on CUDA hold at most 2^30 scores, got N = %lld", (long long)N);
            goto fail;
        }
        int rc, prev_dev = -1;
        if (cu->set_device(sc.device_id, &prev_dev)) {
            gvr_cuda_raise("selecting the CUDA device");
            goto fail;
        }
        Py_BEGIN_ALLOW_THREADS
        rc = cu->topk_decode(&p, NULL, 0, (void *)stream);
        Py_END_ALLOW_THREADS
        if (prev_dev >= 0 && prev_dev != sc.device_id)
            cu->set_device(prev_dev, NULL); /* leave the caller's current device as it was */
        if (rc) {
            gvr_cuda_raise("gvr_topk_decode");
            goto fail;
        }
    }
    Py_INCREF(o_out);
    result = o_out;
fail:
    Py_XDECREF(own_out);
    free(len_copy);
    gvr_view_release(&sc);
    gvr_view_release(&pv);
    gvr_view_release(&ln);
    gvr_view_release(&ot);
    return result;
}

static PyObject *py_cpu_stats(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    gvr_topk_cpu_stats s;
    topk_cpu_last_stats(&s);
    return Py_BuildValue("{sisL}", "count_passes", s.count_passes, "candidates", (long long)s.candidates);
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_ssize_t n;
    if (check_int_arg(arg, "n", &n) < 0)
        return NULL;
    num_threads = (int)n;
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    int n = num_threads;
#ifdef _OPENMP
    if (n <= 0)
        n = omp_get_max_threads();
#else
    n = 1;
#endif
    return PyLong_FromLong(n);
}

static PyObject *py_cuda_available(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    if (gvr_cuda())
        Py_RETURN_TRUE;
    PyErr_Clear();
    Py_RETURN_FALSE;
}

static PyObject *py_cuda_error(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    if (gvr_cuda())
        Py_RETURN_NONE;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *s = value ? PyObject_Str(value) : NULL;
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return s;
}

static PyObject *py_cuda_synchronize(PyObject *self, PyObject *arg)
{
    (void)self;
    intptr_t stream = parse_stream(arg);
    if (stream == -1 && PyErr_Occurred())
        return NULL;
    const gvr_cuda_api *cu = gvr_cuda();
    if (!cu)
        return NULL;
    if (cu->synchronize((void *)stream))
        return gvr_cuda_raise("synchronize");
    Py_RETURN_NONE;
}

static PyObject *py_build_info(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
#ifdef _OPENMP
    int omp = 1;
#else
    int omp = 0;
#endif
    return Py_BuildValue("{sisssi}", "openmp", omp, "cuda_library", gvr_cuda_path(), "abi_version", GVR_ABI_VERSION);
}

static PyMethodDef methods[] = {
    {"topk_decode", (PyCFunction)(void (*)(void))py_topk_decode, METH_VARARGS | METH_KEYWORDS, topk_doc},
    {"cpu_stats", py_cpu_stats, METH_NOARGS, "Search statistics of the calling thread's last CPU row."},
    {"set_num_threads", py_set_num_threads, METH_O, "Threads for CPU rows (0: OpenMP default)."},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "Threads used for CPU rows."},
    {"cuda_available", py_cuda_available, METH_NOARGS, "Whether libgvr_cuda.so loads."},
    {"cuda_error", py_cuda_error, METH_NOARGS, "Why libgvr_cuda.so does not load (None if it does)."},
    {"cuda_synchronize", py_cuda_synchronize, METH_O, "Wait for a CUDA stream (tests)."},
    {"build_info", py_build_info, METH_NOARGS, "What was built."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "gvr._C", "gvr's C core.", -1, methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void)
{
    import_array();
    return PyModule_Create(&moduledef);
}

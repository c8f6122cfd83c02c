/* See dispatch.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>

#include "dispatch.h"

int gvr_elem_of(gvr_dtype d)
{
    return d == GVR_DTYPE_F16 ? GVR_ELEM_F16 : d == GVR_DTYPE_BF16 ? GVR_ELEM_BF16 : d == GVR_DTYPE_F8E4M3 ? GVR_ELEM_E4M3
                                                                                                      : GVR_ELEM_F32;
}

int gvr_run_on_device(const gvr_intake *in, gvr_cuda_call fn, const void *params, void *ws, size_t ws_bytes,
                      intptr_t stream, const char *what)
{
    const gvr_cuda_api *cu = gvr_cuda();
    if (!cu)
        return -1;
    int prev_dev = -1, rc;
    if (cu->set_device(in->device_id, &prev_dev)) {
        gvr_cuda_raise("selecting the CUDA device");
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = fn(cu, params, ws, ws_bytes, (void *)stream);
    Py_END_ALLOW_THREADS
    if (rc)
        gvr_cuda_raise(what);
    if (prev_dev >= 0 && prev_dev != in->device_id)
        cu->set_device(prev_dev, NULL);
    return rc ? -1 : 0;
}

int gvr_run_on_host(int (*fn)(const void *), const void *params)
{
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fn(params);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

int gvr_read_host_counts(const gvr_view *v, const char *name, const char *what, int64_t B, int64_t cap,
                         int32_t *dst)
{
    for (int64_t b = 0; b < B; b++) {
        const int32_t x = ((const int32_t *)v->data)[b * v->strides[0]];
        if (x < 0 || x > cap) {
            PyErr_Format(PyExc_ValueError, "'%s' must lie in [0, %s] = [0, %lld], got %s[%lld] = %d", name, what,
                         (long long)cap, name, (long long)b, x);
            return -1;
        }
        dst[b] = x;
    }
    return 0;
}

int gvr_read_host_range(const gvr_view *end, const gvr_view *start, int update, int64_t B, int64_t cap,
                        int32_t **copy, const int32_t **end_out, const int32_t **start_out)
{
    if (!(*copy = malloc((size_t)(B ? 2 * B : 1) * sizeof **copy))) {
        PyErr_NoMemory();
        return -1;
    }
    if (end->data) {
        if (gvr_read_host_counts(end, update ? "end" : "lengths", "max_pages * P", B, cap, *copy) < 0)
            return -1;
        *end_out = *copy;
    }
    if (start->data) {
        if (gvr_read_host_counts(start, "start", "max_pages * P", B, cap, *copy + B) < 0)
            return -1;
        *start_out = *copy + B;
    }
    return 0;
}

/* gvr._C._intake_check(spec_name, **kwargs): runs the intake on a spec, for tests of the intake
 * beyond the operators that exist. Buffer keywords are the spec's arguments; int keywords bind
 * dimensions first (K=5). Returns {"device", "dims", "args": {name: {dtype, device, device_id,
 * shape, strides, form}}, "allocated": {name: array}}, or raises what the intake raises.
 *
 * Besides the operators' specs, two fixed specs shaped like the coming operators:
 *   "attention": sparse attention over a paged KV cache (FlashInfer's combined [num_pages, 2, P,
 *                Hkv, D] cache as a 5-D alternative to separate K and V);
 *   "prefetch":  SparDA's copy of selected blocks from a pinned host cache into device memory. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "intake.h"
#include "ops.h"

#define FLOATS (GVR_DT(GVR_DTYPE_F32) | GVR_DT(GVR_DTYPE_F16) | GVR_DT(GVR_DTYPE_BF16))
#define ON_CALL (GVR_HOST | GVR_DEVICE)

static const gvr_arg_spec attention_args[] = {
    {"q", FLOATS, "B,Hq,D", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    {"k_cache", FLOATS, "num_pages,P,Hkv,D", ON_CALL, GVR_OPTIONAL | GVR_UNIT_LAST, "q", NULL},
    {"v_cache", FLOATS, "num_pages,P,Hkv,D", ON_CALL, GVR_OPTIONAL | GVR_UNIT_LAST, "q", NULL},
    {"kv_cache", FLOATS, "num_pages,2,P,Hkv,D", ON_CALL, GVR_OPTIONAL | GVR_UNIT_LAST, "q", NULL},
    {"indices", GVR_DT(GVR_DTYPE_I32), "B,Hsel,n", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    {"block_table", GVR_DT(GVR_DTYPE_I32), "B,max_pages", ON_CALL, GVR_OPTIONAL | GVR_UNIT_LAST, NULL, NULL},
    {"lengths", GVR_DT(GVR_DTYPE_I32), "B", ON_CALL, GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    {"out", GVR_DT(GVR_DTYPE_F32), "B,Hq,D", ON_CALL, GVR_OUTPUT | GVR_OPTIONAL | GVR_UNIT_LAST, NULL, NULL},
    {"lse", GVR_DT(GVR_DTYPE_F32), "B,Hq", ON_CALL, GVR_OUTPUT | GVR_OPTIONAL | GVR_UNIT_LAST, NULL, NULL},
};

static const gvr_arg_spec prefetch_args[] = {
    {"host_cache", GVR_DT(GVR_DTYPE_U8) | GVR_DT(GVR_DTYPE_F16) | GVR_DT(GVR_DTYPE_BF16), "num_pages,P,Hkv,D",
     GVR_PINNED, GVR_UNIT_LAST, NULL, NULL},
    {"dst", GVR_DT(GVR_DTYPE_U8) | GVR_DT(GVR_DTYPE_F16) | GVR_DT(GVR_DTYPE_BF16), "slots,P,Hkv,D", GVR_DEVICE,
     GVR_OUTPUT | GVR_UNIT_LAST, "host_cache", NULL},
    {"ids", GVR_DT(GVR_DTYPE_I64), "B,Hkv,n", GVR_DEVICE | GVR_PINNED, GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    {"slots_out", GVR_DT(GVR_DTYPE_I32), "B,Hkv,n", GVR_DEVICE, GVR_OUTPUT | GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE,
     NULL, NULL},
};

static const gvr_spec test_specs[] = {
    {"attention", (int)(sizeof attention_args / sizeof attention_args[0]), attention_args},
    {"prefetch", (int)(sizeof prefetch_args / sizeof prefetch_args[0]), prefetch_args},
};

static PyObject *view_dict(const gvr_view *v)
{
    PyObject *d = NULL, *shape = NULL, *strides = NULL;
    if (!(shape = PyTuple_New(v->ndim)) || !(strides = PyTuple_New(v->ndim)))
        goto fail;
    for (int i = 0; i < v->ndim; i++) {
        PyObject *a = PyLong_FromLongLong(v->shape[i]), *b = PyLong_FromLongLong(v->strides[i]);
        if (!a || !b) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            goto fail;
        }
        PyTuple_SET_ITEM(shape, i, a);
        PyTuple_SET_ITEM(strides, i, b);
    }
    d = Py_BuildValue("{sssssisOsO}", "dtype", v->dtype_str, "device", gvr_device_str(v->device), "device_id",
                      v->device_id, "shape", shape, "strides", strides);
fail:
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    return d;
}

PyObject *gvr_intake_check_py(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    const char *name;
    PyObject *objs[GVR_INTAKE_MAX_ARGS] = {NULL};
    PyObject *result = NULL, *dims = NULL, *views = NULL, *allocated = NULL, *key, *value;
    gvr_intake in;
    gvr_intake_init(&in);
    if (!PyArg_ParseTuple(args, "s:_intake_check", &name))
        return NULL;
    const gvr_spec *spec = !strcmp(name, gvr_topk_spec.op) ? &gvr_topk_spec : NULL;
    for (size_t i = 0; i < sizeof test_specs / sizeof test_specs[0] && !spec; i++)
        if (!strcmp(name, test_specs[i].op))
            spec = &test_specs[i];
    if (!spec) {
        PyErr_Format(PyExc_ValueError, "no spec named '%s'", name);
        return NULL;
    }
    Py_ssize_t pos = 0;
    while (kwds && PyDict_Next(kwds, &pos, &key, &value)) {
        const char *kw = PyUnicode_AsUTF8(key);
        if (!kw)
            goto fail;
        int found = -1;
        for (int i = 0; i < spec->nargs; i++)
            if (!strcmp(kw, spec->args[i].name))
                found = i;
        if (found >= 0) {
            objs[found] = value;
        } else if (PyLong_Check(value)) {
            const long long n = PyLong_AsLongLong(value);
            if ((n == -1 && PyErr_Occurred()) || gvr_intake_bind(&in, kw, n, kw) < 0)
                goto fail;
        } else {
            PyErr_Format(PyExc_TypeError, "spec '%s' has no argument '%s'", name, kw);
            goto fail;
        }
    }
    if (gvr_intake_run(&in, spec, objs, 0, 0) < 0)
        goto fail;
    if (!(dims = PyDict_New()) || !(views = PyDict_New()) || !(allocated = PyDict_New()))
        goto fail;
    for (int i = 0; i < in.ndims; i++) {
        PyObject *n = PyLong_FromLongLong(in.dim[i].value);
        if (!n || PyDict_SetItemString(dims, in.dim[i].name, n) < 0) {
            Py_XDECREF(n);
            goto fail;
        }
        Py_DECREF(n);
    }
    for (int i = 0; i < spec->nargs; i++) {
        if (!in.given[i])
            continue;
        PyObject *d = view_dict(&in.view[i]);
        PyObject *form = d ? PyLong_FromLong(in.form[i]) : NULL;
        int bad = !form || PyDict_SetItemString(d, "form", form) < 0 ||
                  PyDict_SetItemString(views, spec->args[i].name, d) < 0 ||
                  (in.allocated[i] && PyDict_SetItemString(allocated, spec->args[i].name, in.allocated[i]) < 0);
        Py_XDECREF(form);
        Py_XDECREF(d);
        if (bad)
            goto fail;
    }
    char device[64];
    gvr_device_name(in.device, in.device_id, device, sizeof device);
    result = Py_BuildValue("{sssOsOsO}", "device", device, "dims", dims, "args", views, "allocated", allocated);
fail:
    Py_XDECREF(dims);
    Py_XDECREF(views);
    Py_XDECREF(allocated);
    gvr_intake_release(&in);
    return result;
}

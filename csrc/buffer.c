/* Buffer intake for gvr._C: NumPy arrays directly, anything else through the DLPack protocol
 * (versioned capsules first, legacy capsules as a fallback), or through NumPy when the object
 * exposes the buffer protocol / array interface (no copy). See buffer.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL gvr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#define NPY_TARGET_VERSION NPY_1_23_API_VERSION
#include <numpy/arrayobject.h>

#include <string.h>

#include "buffer.h"
#include "dlpack.h"

const char *gvr_device_str(gvr_device d)
{
    switch (d) {
    case GVR_DEV_CPU: return "cpu";
    case GVR_DEV_CUDA: return "cuda";
    case GVR_DEV_CUDA_HOST: return "cuda_host";
    }
    return "?";
}

const char *gvr_dtype_str(gvr_dtype d)
{
    static const char *names[GVR_DTYPE_COUNT] = {"?", "float32", "float16", "bfloat16", "int32", "int64", "uint8", "float8_e4m3fn"};
    return (unsigned)d < GVR_DTYPE_COUNT ? names[d] : "?";
}

int gvr_dtype_size(gvr_dtype d)
{
    static const int sizes[GVR_DTYPE_COUNT] = {0, 4, 2, 2, 4, 8, 1, 1};
    return (unsigned)d < GVR_DTYPE_COUNT ? sizes[d] : 0;
}

static const char *dl_device_name(int t)
{
    switch (t) {
    case 1: return "CPU";
    case 2: return "CUDA";
    case 3: return "CUDA host";
    case 4: return "OpenCL";
    case 7: return "Vulkan";
    case 8: return "Metal";
    case 9: return "VPI";
    case 10: return "ROCm";
    case 11: return "ROCm host";
    case 12: return "ext_dev";
    case 13: return "CUDA managed";
    case 14: return "oneAPI";
    case 15: return "WebGPU";
    case 16: return "Hexagon";
    case 17: return "MAIA";
    }
    return "unknown";
}

static int set_dims(gvr_view *v, int ndim, const int64_t *shape, const int64_t *strides_elems,
                    const npy_intp *strides_bytes, int itemsize)
{
    v->ndim = ndim;
    if (ndim > GVR_VIEW_MAX_NDIM)
        return 0; /* the caller reports the dimensionality */
    int64_t compact = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        v->shape[i] = shape[i];
        if (strides_bytes) {
            if (itemsize && strides_bytes[i] % itemsize != 0) {
                PyErr_Format(PyExc_ValueError,
                             "'%s' has a stride of %zd bytes, not a multiple of its item size %d",
                             v->name, (Py_ssize_t)strides_bytes[i], itemsize);
                return -1;
            }
            v->strides[i] = itemsize ? (int64_t)(strides_bytes[i] / itemsize) : 0;
        } else if (strides_elems) {
            v->strides[i] = strides_elems[i];
        } else {
            v->strides[i] = compact;
        }
        compact *= shape[i];
    }
    return 0;
}

/* whether the NumPy dtype d's scalar type is `name` (ml_dtypes names its types "ml_dtypes.<name>") */
static int scalar_named(PyArray_Descr *d, const char *name)
{
    if (!d->typeobj || !d->typeobj->tp_name)
        return 0;
    const char *t = d->typeobj->tp_name, *dot = strrchr(t, '.');
    return !strcmp(dot ? dot + 1 : t, name);
}

static int from_numpy(PyArrayObject *arr, int writable, gvr_view *v)
{
    /* takes ownership of arr */
    v->array = (PyObject *)arr;
    v->device = GVR_DEV_CPU;
    v->device_id = 0;
    PyArray_Descr *d = PyArray_DESCR(arr);
    v->dtype = GVR_DTYPE_OTHER;
    if (PyArray_ISNOTSWAPPED(arr) || PyArray_ITEMSIZE(arr) == 1) {
        const int size = (int)PyArray_ITEMSIZE(arr);
        if (d->kind == 'f' && size == 4)
            v->dtype = GVR_DTYPE_F32;
        else if (d->kind == 'f' && size == 2)
            v->dtype = GVR_DTYPE_F16;
        else if (d->kind == 'i' && size == 4)
            v->dtype = GVR_DTYPE_I32;
        else if (d->kind == 'i' && size == 8)
            v->dtype = GVR_DTYPE_I64;
        else if (d->kind == 'u' && size == 1)
            v->dtype = GVR_DTYPE_U8;
        else if (d->kind == 'V' && size == 2 && scalar_named(d, "bfloat16"))
            v->dtype = GVR_DTYPE_BF16; /* ml_dtypes.bfloat16 */
        else if (d->kind == 'V' && size == 1 && scalar_named(d, "float8_e4m3fn"))
            v->dtype = GVR_DTYPE_F8E4M3; /* ml_dtypes.float8_e4m3fn */
    }
    const int itemsize = gvr_dtype_size(v->dtype);
    v->itemsize = itemsize;
    if (v->dtype != GVR_DTYPE_OTHER) {
        strcpy(v->dtype_str, gvr_dtype_str(v->dtype));
    } else {
        PyObject *s = PyObject_Str((PyObject *)d);
        const char *c = s ? PyUnicode_AsUTF8(s) : NULL;
        snprintf(v->dtype_str, sizeof v->dtype_str, "%s", c ? c : "?");
        Py_XDECREF(s);
        PyErr_Clear();
    }
    v->data = PyArray_BYTES(arr);
    v->readonly = !PyArray_ISWRITEABLE(arr);
    int64_t shape[NPY_MAXDIMS];
    int nd = PyArray_NDIM(arr);
    for (int i = 0; i < nd; i++)
        shape[i] = PyArray_DIM(arr, i);
    if (set_dims(v, nd, shape, NULL, PyArray_STRIDES(arr), itemsize) < 0)
        return -1;
    if (itemsize && !PyArray_ISALIGNED(arr)) {
        PyErr_Format(PyExc_ValueError, "'%s' is not aligned to its item size", v->name);
        return -1;
    }
    if (writable && v->readonly) {
        PyErr_Format(PyExc_ValueError, "'%s' is read-only; an output must be writable", v->name);
        return -1;
    }
    return 0;
}

/* The producer's own error while exporting obj (a sparse or meta torch tensor, say: BufferError or a
 * ValueError that names no argument) as `type` naming the argument, the original as its __cause__. */
static void rename_export_error(PyObject *type, const char *name, const char *what)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError) ||
        PyErr_ExceptionMatches(PyExc_RecursionError))
        return;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    if (tb && ev)
        PyException_SetTraceback(ev, tb);
    PyObject *msg = ev ? PyObject_Str(ev) : NULL;
    if (!msg) {
        PyErr_Clear();
        msg = PyUnicode_FromString("");
    }
    if (!msg) { /* out of memory: the original error stands */
        PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        return;
    }
    PyErr_Format(type, "'%s' %s (gvr takes strided CPU, CUDA or pinned-host arrays): %s: %U", name, what,
                 et ? ((PyTypeObject *)et)->tp_name : "error", msg);
    Py_DECREF(msg);
    if (ev) {
        PyObject *nt, *nv, *ntb;
        PyErr_Fetch(&nt, &nv, &ntb);
        PyErr_NormalizeException(&nt, &nv, &ntb);
        if (nv)
            PyException_SetCause(nv, ev); /* steals ev */
        else
            Py_DECREF(ev);
        PyErr_Restore(nt, nv, ntb);
    }
    Py_XDECREF(et);
    Py_XDECREF(tb);
}

int gvr_object_device(PyObject *obj, const char *name, gvr_device *dev, int *dev_id)
{
    if (PyArray_Check(obj)) {
        *dev = GVR_DEV_CPU;
        *dev_id = 0;
        return 0;
    }
    PyObject *t = NULL;
    int type = 0, id = 0;
    if (!PyObject_HasAttrString(obj, "__dlpack__")) {
        *dev = GVR_DEV_CPU; /* buffer-protocol objects and anything NumPy will judge */
        *dev_id = 0;
        return 0;
    }
    t = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    if (!t) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "'%s' has __dlpack__ but no __dlpack_device__", name);
        } else {
            rename_export_error(PyExc_ValueError, name, "is on a device that DLPack cannot name");
        }
        return -1;
    }
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
        PyErr_Format(PyExc_TypeError, "'%s'.__dlpack_device__() must return a (device_type, device_id) tuple",
                     name);
        goto fail;
    }
    type = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
    id = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 1));
    if (PyErr_Occurred())
        goto fail;
    Py_DECREF(t);
    t = NULL;
    if (type == GVR_DL_CPU)
        *dev = GVR_DEV_CPU;
    else if (type == GVR_DL_CUDA)
        *dev = GVR_DEV_CUDA;
    else if (type == GVR_DL_CUDA_HOST)
        *dev = GVR_DEV_CUDA_HOST;
    else {
        PyErr_Format(PyExc_ValueError,
                     "'%s' is on an unsupported device (DLPack device type %d, %s); gvr takes CPU, "
                     "CUDA and CUDA pinned-host memory",
                     name, type, dl_device_name(type));
        return -1;
    }
    *dev_id = id;
    return 0;
fail:
    Py_XDECREF(t);
    return -1;
}

static void dl_dtype_str(gvr_DLDataType t, char *buf, size_t n)
{
    const char *base = "?";
    switch (t.code) {
    case GVR_DL_INT: base = "int"; break;
    case GVR_DL_UINT: base = "uint"; break;
    case GVR_DL_FLOAT: base = "float"; break;
    case GVR_DL_BFLOAT: base = "bfloat"; break;
    case 5: base = "complex"; break;
    case 6: base = "bool"; break;
    }
    /* DLPack 1.1's 8-bit float codes 7..14 carry their format in the name */
    static const char *f8[] = {"float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
                               "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"};
    if (t.code >= 7 && t.code <= 14 && t.bits == 8) {
        if (t.lanes == 1)
            snprintf(buf, n, "%s", f8[t.code - 7]);
        else
            snprintf(buf, n, "%sx%u", f8[t.code - 7], (unsigned)t.lanes);
        return;
    }
    if (t.lanes == 1)
        snprintf(buf, n, "%s%u", base, (unsigned)t.bits);
    else
        snprintf(buf, n, "%s%ux%u", base, (unsigned)t.bits, (unsigned)t.lanes);
}

/* Call obj.__dlpack__ asking for a versioned capsule, falling back for producers that predate
 * DLPack 1.0 (they reject the max_version keyword with TypeError). */
static PyObject *call_dlpack(PyObject *obj, PyObject *stream_obj)
{
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (!meth)
        return NULL;
    PyObject *args = PyTuple_New(0), *kw = NULL, *cap = NULL, *ver = NULL;
    if (!args)
        goto done;
    ver = Py_BuildValue("(ii)", 1, 0);
    kw = Py_BuildValue("{sOsO}", "stream", stream_obj, "max_version", ver);
    if (!ver || !kw)
        goto done;
    cap = PyObject_Call(meth, args, kw);
    if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        Py_DECREF(kw);
        kw = Py_BuildValue("{sO}", "stream", stream_obj);
        if (!kw)
            goto done;
        cap = PyObject_Call(meth, args, kw);
        if (!cap && stream_obj == Py_None && PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            cap = PyObject_Call(meth, args, NULL);
        }
    }
done:
    Py_XDECREF(meth);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_XDECREF(ver);
    return cap;
}

/* A producer's own export function, called in place of __dlpack_device__ + __dlpack__(stream=-1) for
 * objects of exactly one type when no stream synchronization is asked for: torch.Tensor and
 * torch._C._to_dlpack_versioned (registered by gvr._interop when torch is loaded). The two protocol
 * calls cost 3-11 us of host time per tensor in torch's Python code (measured on two H200 hosts and on
 * the development VM, 2026-11-25), the export itself ~0.6 us; what torch's __dlpack__ checks besides
 * the stream is either done by gvr's caller (requires_grad: detached) or by gvr's intake (dtype,
 * strided layout through the export's own error, device). */
static PyObject *g_export_fn = NULL;
static PyTypeObject *g_export_type = NULL;

PyObject *gvr_py_set_dlpack_export(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *fn, *type;
    if (!PyArg_ParseTuple(args, "OO:_set_dlpack_export", &fn, &type))
        return NULL;
    if (fn == Py_None && type == Py_None) {
        Py_CLEAR(g_export_fn);
        Py_CLEAR(g_export_type);
        Py_RETURN_NONE;
    }
    if (!PyCallable_Check(fn) || !PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "_set_dlpack_export(fn, type): a callable and a type, or None and None");
        return NULL;
    }
    Py_INCREF(fn);
    Py_INCREF(type);
    Py_XSETREF(g_export_fn, fn);
    Py_XSETREF(g_export_type, (PyTypeObject *)type);
    Py_RETURN_NONE;
}

static int from_dlpack(PyObject *obj, int writable, intptr_t stream, gvr_view *v)
{
    gvr_device dev;
    int dev_id;
    PyObject *stream_obj = NULL, *cap = NULL;
    if (stream == GVR_STREAM_PRODUCER_CURRENT && g_export_fn && Py_IS_TYPE(obj, g_export_type)) {
        PyObject *fn = Py_NewRef(g_export_fn); /* (the call may run code that registers another) */
        cap = PyObject_CallOneArg(fn, obj);
        Py_DECREF(fn);
        if (!cap) {
            rename_export_error(PyExc_TypeError, v->name, "cannot be exported through DLPack");
            return -1;
        }
        goto consume;
    }
    if (gvr_object_device(obj, v->name, &dev, &dev_id) < 0)
        return -1;
    /* Stream hand-shake (DLPack): for CUDA producers pass the stream we will use the data on, so
     * the producer orders its pending work before it; 0 is ambiguous in the spec, so the legacy
     * default stream is 1. When that stream is the producer's current stream, -1 (no
     * synchronization: torch spends ~13 us per tensor on an equal-stream check otherwise). CPU
     * producers get None. */
    if (dev == GVR_DEV_CUDA && stream == GVR_STREAM_PRODUCER_CURRENT)
        stream_obj = PyLong_FromLong(-1);
    else if (dev == GVR_DEV_CUDA)
        stream_obj = PyLong_FromSsize_t(stream == 0 ? 1 : (Py_ssize_t)stream);
    else {
        stream_obj = Py_None;
        Py_INCREF(stream_obj);
    }
    if (!stream_obj)
        return -1;
    cap = call_dlpack(obj, stream_obj);
    Py_DECREF(stream_obj);
    if (!cap) {
        rename_export_error(PyExc_TypeError, v->name, "cannot be exported through DLPack");
        return -1;
    }
consume:;
    gvr_DLTensor *t;
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        gvr_DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
        if (!m)
            goto fail;
        if (m->version.major != 1) {
            /* not ours to consume: the producer's capsule destructor frees it */
            PyErr_Format(PyExc_ValueError, "'%s' is a DLPack %u.%u tensor; gvr reads DLPack 1.x", v->name,
                         m->version.major, m->version.minor);
            goto fail;
        }
        if (PyCapsule_SetName(cap, "used_dltensor_versioned") < 0)
            goto fail;
        v->managed = m;
        v->versioned = 1;
        v->readonly = (m->flags & GVR_DLPACK_FLAG_READ_ONLY) != 0;
        t = &m->dl_tensor;
    } else if (PyCapsule_IsValid(cap, "dltensor")) {
        gvr_DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
        if (!m)
            goto fail;
        if (PyCapsule_SetName(cap, "used_dltensor") < 0)
            goto fail;
        v->managed = m;
        v->versioned = 0;
        v->readonly = 0;
        t = &m->dl_tensor;
    } else {
        PyErr_Format(PyExc_TypeError, "'%s'.__dlpack__() did not return an unused DLPack capsule", v->name);
        goto fail;
    }
    Py_CLEAR(cap); /* renamed: its destructor leaves the tensor to us */

    if (t->device.device_type == GVR_DL_CPU)
        v->device = GVR_DEV_CPU;
    else if (t->device.device_type == GVR_DL_CUDA)
        v->device = GVR_DEV_CUDA;
    else if (t->device.device_type == GVR_DL_CUDA_HOST)
        v->device = GVR_DEV_CUDA_HOST;
    else {
        PyErr_Format(PyExc_ValueError, "'%s' is on an unsupported device (DLPack device type %d, %s)", v->name,
                     (int)t->device.device_type, dl_device_name(t->device.device_type));
        return -1;
    }
    v->device_id = t->device.device_id;
    v->dtype = GVR_DTYPE_OTHER;
    if (t->dtype.lanes == 1) {
        const int code = t->dtype.code, bits = t->dtype.bits;
        if (code == GVR_DL_FLOAT && bits == 32)
            v->dtype = GVR_DTYPE_F32;
        else if (code == GVR_DL_FLOAT && bits == 16)
            v->dtype = GVR_DTYPE_F16;
        else if (code == GVR_DL_BFLOAT && bits == 16)
            v->dtype = GVR_DTYPE_BF16;
        else if (code == GVR_DL_INT && bits == 32)
            v->dtype = GVR_DTYPE_I32;
        else if (code == GVR_DL_INT && bits == 64)
            v->dtype = GVR_DTYPE_I64;
        else if (code == GVR_DL_UINT && bits == 8)
            v->dtype = GVR_DTYPE_U8;
        else if (code == GVR_DL_FLOAT8_E4M3FN && bits == 8)
            v->dtype = GVR_DTYPE_F8E4M3;
    }
    const int itemsize = gvr_dtype_size(v->dtype);
    v->itemsize = itemsize;
    dl_dtype_str(t->dtype, v->dtype_str, sizeof v->dtype_str);
    if (t->ndim < 0) {
        PyErr_Format(PyExc_ValueError, "'%s' has a negative ndim", v->name);
        return -1;
    }
    v->data = (char *)t->data + t->byte_offset;
    if (set_dims(v, t->ndim, t->shape, t->strides, NULL, 0) < 0)
        return -1;
    if (itemsize && ((uintptr_t)v->data % (uintptr_t)itemsize) != 0) {
        PyErr_Format(PyExc_ValueError, "'%s' is not aligned to its item size", v->name);
        return -1;
    }
    if (writable && v->readonly) {
        PyErr_Format(PyExc_ValueError, "'%s' is read-only (its DLPack capsule is flagged read-only); "
                     "an output must be writable", v->name);
        return -1;
    }
    return 0;
fail:
    Py_XDECREF(cap);
    return -1;
}

int gvr_view_get(PyObject *obj, const char *name, int writable, intptr_t stream, gvr_view *v)
{
    memset(v, 0, sizeof *v);
    v->name = name;
    if (PyArray_Check(obj)) {
        Py_INCREF(obj);
        return from_numpy((PyArrayObject *)obj, writable, v);
    }
    if (PyObject_HasAttrString(obj, "__dlpack__"))
        return from_dlpack(obj, writable, stream, v);
    if (PyObject_CheckBuffer(obj) || PyObject_HasAttrString(obj, "__array_interface__") ||
        PyObject_HasAttrString(obj, "__array_struct__")) {
        PyObject *arr = PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
        if (!arr) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "'%s' could not be read as an array (got %s)", name,
                         Py_TYPE(obj)->tp_name);
            return -1;
        }
        return from_numpy((PyArrayObject *)arr, writable, v);
    }
    PyErr_Format(PyExc_TypeError,
                 "'%s' must be an array (a NumPy array or an object with __dlpack__, e.g. a torch "
                 "tensor), got %s",
                 name, Py_TYPE(obj)->tp_name);
    return -1;
}

void gvr_view_release(gvr_view *v)
{
    Py_CLEAR(v->array);
    if (v->managed) {
        /* a deleter may run Python code (ctypes/cffi producers): keep a pending error intact */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (v->versioned) {
            gvr_DLManagedTensorVersioned *m = v->managed;
            if (m->deleter)
                m->deleter(m);
        } else {
            gvr_DLManagedTensor *m = v->managed;
            if (m->deleter)
                m->deleter(m);
        }
        v->managed = NULL;
        PyErr_Restore(et, ev, tb);
    }
}

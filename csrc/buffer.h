/* Buffer intake: turn a Python object (NumPy array, any __dlpack__ producer, or an object NumPy
 * wraps without copying) into a plain view: data pointer, dtype, shape, strides in elements, device.
 * A view holds what keeps its memory alive (a NumPy reference or an owned DLPack managed tensor)
 * until gvr_view_release(); callers release every view before returning to Python.
 * Views know nothing of operators: csrc/intake.c checks them against an operator's spec. */
#ifndef GVR_BUFFER_H
#define GVR_BUFFER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define GVR_VIEW_MAX_NDIM 5

/* The dtypes gvr reads; uint8 is raw bytes (e.g. a host cache's storage). GVR_DT(d) is d's bit in an accepted-dtypes mask. */
typedef enum {
    GVR_DTYPE_OTHER = 0,
    GVR_DTYPE_F32,
    GVR_DTYPE_F16,
    GVR_DTYPE_BF16,
    GVR_DTYPE_I32,
    GVR_DTYPE_I64,
    GVR_DTYPE_U8,
    GVR_DTYPE_F8E4M3, /* float8_e4m3fn (torch, DLPack code 10, ml_dtypes): fp8 KV caches */
    GVR_DTYPE_COUNT
} gvr_dtype;
#define GVR_DT(d) (1u << (d))

/* Where the memory lives: plain host memory, CUDA device memory, or pinned (page-locked,
 * device-mapped) host memory, DLPack's kDLCUDAHost: readable by the CPU and by the device. */
typedef enum { GVR_DEV_CPU = 1, GVR_DEV_CUDA = 2, GVR_DEV_CUDA_HOST = 3 } gvr_device;

typedef struct {
    const char *name;   /* argument name, for messages */
    char *data;         /* first element (byte_offset applied) */
    gvr_dtype dtype;
    int itemsize;       /* bytes per element (0 for GVR_DTYPE_OTHER) */
    char dtype_str[24]; /* e.g. "float64", for messages */
    int ndim;           /* the real ndim, may exceed GVR_VIEW_MAX_NDIM (then shape is unset) */
    int64_t shape[GVR_VIEW_MAX_NDIM];
    int64_t strides[GVR_VIEW_MAX_NDIM]; /* in elements */
    gvr_device device;
    int device_id;
    int readonly;
    /* ownership */
    PyObject *array;    /* NumPy array reference, or NULL */
    void *managed;      /* DLPack managed tensor we own, or NULL */
    int versioned;
} gvr_view;

/* stream: the consumer stream (>= 0) handed to CUDA producers, or GVR_STREAM_PRODUCER_CURRENT: the
 * consumer runs on the producer's current stream, so no synchronization is needed and the producer
 * gets -1, as DLPack defines. */
#define GVR_STREAM_PRODUCER_CURRENT ((intptr_t)-2)
int gvr_view_get(PyObject *obj, const char *name, int writable, intptr_t stream, gvr_view *v);
void gvr_view_release(gvr_view *v);

/* _C._set_dlpack_export(fn, type): objects of exactly `type` on the producer's current stream are
 * exported by fn(obj) (a DLPack capsule) instead of the protocol's two calls; (None, None) clears. */
PyObject *gvr_py_set_dlpack_export(PyObject *self, PyObject *args);

/* Device of obj without taking its buffer (for picking the stream). */
int gvr_object_device(PyObject *obj, const char *name, gvr_device *dev, int *dev_id);

const char *gvr_device_str(gvr_device d);
const char *gvr_dtype_str(gvr_dtype d);
int gvr_dtype_size(gvr_dtype d);

#endif

/* Declarative argument intake: an operator lists its buffer arguments once, as a spec, and one call
 * checks the Python arguments against it, producing plain views (csrc/buffer.h) and the values of
 * the named dimensions, or an exception that names the argument, the dimension, what was expected
 * and what was got. Nothing below the intake validates again.
 *
 * An argument spec:
 *   name     for messages, and for other specs' references (same_dtype, form_of)
 *   dtypes   accepted dtypes, a mask of GVR_DT(GVR_DTYPE_*)
 *   dims     named dimensions, comma separated, alternatives separated by '|', e.g. "B,N|N".
 *            An entry is a name (bound by the first argument that has it; later ones must match)
 *            or an integer literal. After ';' an alternative may bind names without a shape entry:
 *            "B,N|N;B=1" (a 1-D scores row is a batch of one). Up to GVR_VIEW_MAX_NDIM entries.
 *   roles    where its memory may be (GVR_HOST, GVR_DEVICE, GVR_PINNED), see below
 *   flags    GVR_OPTIONAL, GVR_OUTPUT, GVR_ALLOC, GVR_UNIT_LAST, GVR_CONTIGUOUS_ON_DEVICE
 *   same_dtype  NULL, or an earlier argument whose dtype this one must have
 *   form_of     NULL, or an earlier argument whose alternative this one must take (its index)
 *
 * Devices. The call runs on the first CUDA device buffer among the given arguments (spec order),
 * or on the host when there is none. In a host call an argument with GVR_HOST takes host memory,
 * plain or pinned (pinned host memory is CPU memory too). In a CUDA call an argument takes device
 * memory of the call's device with GVR_DEVICE, and pinned host memory only with GVR_PINNED (read
 * from the device); plain host memory never. An argument whose roles are GVR_PINNED alone must be
 * pinned host memory in any call.
 *
 * Outputs (GVR_OUTPUT) must be writable and must not overlap any other argument. GVR_ALLOC: when
 * not given in a host call, the intake allocates a NumPy array of the resolved shape (first dtype
 * of the mask); in a CUDA call it must be given (the Python layer allocates in the caller's
 * framework). */
#ifndef GVR_INTAKE_H
#define GVR_INTAKE_H

#include "buffer.h"

/* roles */
#define GVR_HOST 1u   /* host memory in a host call */
#define GVR_DEVICE 2u /* CUDA device memory on the call's device */
#define GVR_PINNED 4u /* pinned host memory (DLPack kDLCUDAHost), read from the call's device */

/* flags */
#define GVR_OPTIONAL 1u             /* None (or left out) is allowed: the view's data is NULL */
#define GVR_OUTPUT 2u               /* written: writable, no overlap with any other argument */
#define GVR_ALLOC 4u                /* output allocated (NumPy) in host calls when not given */
#define GVR_UNIT_LAST 8u            /* unit stride along the last dimension */
#define GVR_CONTIGUOUS_ON_DEVICE 16u /* C-contiguous when on a CUDA device */

#define GVR_INTAKE_MAX_ARGS 16
#define GVR_INTAKE_MAX_DIMS 24

typedef struct {
    const char *name;
    unsigned dtypes;
    const char *dims;
    unsigned roles;
    unsigned flags;
    const char *same_dtype;
    const char *form_of;
} gvr_arg_spec;

typedef struct {
    const char *op; /* the operator, for messages */
    int nargs;
    const gvr_arg_spec *args;
} gvr_spec;

typedef struct {
    char name[16];
    int64_t value;
    const char *source; /* the argument that bound it */
} gvr_dim;

typedef struct {
    gvr_view view[GVR_INTAKE_MAX_ARGS]; /* view[i].data == NULL: argument i not given */
    int given[GVR_INTAKE_MAX_ARGS];
    int form[GVR_INTAKE_MAX_ARGS];       /* index of the alternative argument i matched */
    PyObject *allocated[GVR_INTAKE_MAX_ARGS]; /* GVR_ALLOC outputs the intake made (owned) */
    gvr_dim dim[GVR_INTAKE_MAX_DIMS];
    int ndims;
    gvr_device device; /* the call's: GVR_DEV_CPU (host call) or GVR_DEV_CUDA */
    int device_id;
} gvr_intake;

/* Start an intake (zeroes it); bind dimensions known before the buffers, e.g. K from 'k'. */
void gvr_intake_init(gvr_intake *in);
int gvr_intake_bind(gvr_intake *in, const char *dim, int64_t value, const char *source);

/* Check objs[0..spec->nargs) (NULL or None: not given) against spec. Argument i's DLPack producer is
 * handed `stream`, or -1 when bit i of nosync is set (it runs on the consumer's stream). Returns 0,
 * or -1 with an exception set. Release the intake in either case. */
int gvr_intake_run(gvr_intake *in, const gvr_spec *spec, PyObject *const *objs, intptr_t stream,
                   unsigned nosync);
void gvr_intake_release(gvr_intake *in);

/* A resolved dimension's value (-1 when unbound). */
int64_t gvr_intake_dim(const gvr_intake *in, const char *dim);
/* The Python object of argument i to return (the given one, or the one the intake allocated). */
PyObject *gvr_intake_object(const gvr_intake *in, PyObject *const *objs, int i);

/* Helpers for operators' scalar arguments. */
int gvr_parse_int(PyObject *o, const char *name, Py_ssize_t *val); /* an int >= 0 */
int gvr_parse_bool(PyObject *o, const char *name, int *val);       /* bool or numpy.bool_ */
int gvr_parse_stream(PyObject *o, intptr_t *stream);               /* None, 0 or a handle */
int gvr_parse_nosync(PyObject *o, int nargs, unsigned *nosync);

/* [lo, hi): the bytes a view covers; 0 for an empty view (it covers nothing). */
int gvr_view_extent(const gvr_view *v, uintptr_t *lo, uintptr_t *hi);
/* Whether two given views share a byte (in one address space: host and pinned memory share one). */
int gvr_views_overlap(const gvr_view *a, const gvr_view *b);

/* "cpu", "cuda:1", "pinned host memory (cuda_host)" */
void gvr_device_name(gvr_device d, int id, char *buf, size_t n);

/* The private test hook gvr._C._intake_check(spec_name, **kwargs). */
PyObject *gvr_intake_check_py(PyObject *self, PyObject *args, PyObject *kwds);

#endif

/* SparDA's host KV cache: gvr._C.HostBuffer (pinned, device-mapped host memory, or plain host memory,
 * with a buffer interface and a close() that refuses while views are alive, as mmap's), and the specs,
 * CPU calls and CUDA calls of the prefetch and of the KV store. Semantics: kernels/gvr_kernels.h,
 * "SparDA host KV cache". */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "cpu/sparda_cpu.h"
#include "cuda_lib.h"
#include "dispatch.h"
#include "intake.h"
#include "ops.h"

#define CACHE_DT                                                                                                       \
    (GVR_DT(GVR_DTYPE_F32) | GVR_DT(GVR_DTYPE_F16) | GVR_DT(GVR_DTYPE_BF16) | GVR_DT(GVR_DTYPE_U8) |                   \
     GVR_DT(GVR_DTYPE_F8E4M3))
#define I32 GVR_DT(GVR_DTYPE_I32)
#define I64 GVR_DT(GVR_DTYPE_I64)
#define U8 GVR_DT(GVR_DTYPE_U8)
#define ON_CALL (GVR_HOST | GVR_DEVICE)

/* ---- HostBuffer ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    char *ptr;
    Py_ssize_t nbytes;
    int pinned;
    Py_ssize_t exports;
} HostBuffer;

static int hb_release(HostBuffer *self)
{
    if (!self->ptr)
        return 0;
    if (self->pinned) {
        const gvr_cuda_api *cu = gvr_cuda();
        if (!cu)
            return -1;
        if (cu->host_free(self->ptr)) {
            gvr_cuda_raise("freeing pinned host memory");
            return -1;
        }
    } else
        free(self->ptr);
    self->ptr = NULL;
    return 0;
}

static PyObject *hb_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"nbytes", "pinned", NULL};
    Py_ssize_t nbytes;
    int pinned = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|p:HostBuffer", kwlist, &nbytes, &pinned))
        return NULL;
    if (nbytes < 0) {
        PyErr_Format(PyExc_ValueError, "'nbytes' must be >= 0, got %zd", nbytes);
        return NULL;
    }
    HostBuffer *self = (HostBuffer *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->nbytes = nbytes;
    self->pinned = pinned;
    if (pinned) {
        const gvr_cuda_api *cu = gvr_cuda();
        void *p = NULL;
        int rc = 1;
        if (cu) {
            Py_BEGIN_ALLOW_THREADS
            rc = cu->host_alloc((size_t)nbytes, &p);
            Py_END_ALLOW_THREADS
            if (rc)
                gvr_cuda_raise("allocating pinned host memory");
        }
        if (rc) {
            Py_DECREF(self);
            return NULL;
        }
        self->ptr = p;
        memset(self->ptr, 0, (size_t)nbytes);
    } else if (!(self->ptr = calloc((size_t)(nbytes ? nbytes : 1), 1))) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void hb_dealloc(HostBuffer *self)
{
    if (hb_release(self) < 0)
        PyErr_WriteUnraisable((PyObject *)self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int hb_getbuffer(HostBuffer *self, Py_buffer *view, int flags)
{
    if (!self->ptr) {
        PyErr_SetString(PyExc_ValueError, "HostBuffer is closed");
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, self->nbytes, 0, flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void hb_releasebuffer(HostBuffer *self, Py_buffer *view)
{
    (void)view;
    self->exports--;
}

static PyBufferProcs hb_as_buffer = {(getbufferproc)hb_getbuffer, (releasebufferproc)hb_releasebuffer};

static PyObject *hb_close(HostBuffer *self, PyObject *unused)
{
    (void)unused;
    if (self->exports > 0) {
        PyErr_Format(PyExc_BufferError, "cannot close the host buffer: %zd exported view(s) of its memory are still "
                     "alive (NumPy arrays or tensors over it); drop them first", self->exports);
        return NULL;
    }
    if (hb_release(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *hb_get_address(HostBuffer *self, void *c)
{
    (void)c;
    return PyLong_FromVoidPtr(self->ptr);
}
static PyObject *hb_get_nbytes(HostBuffer *self, void *c)
{
    (void)c;
    return PyLong_FromSsize_t(self->nbytes);
}
static PyObject *hb_get_pinned(HostBuffer *self, void *c)
{
    (void)c;
    return PyBool_FromLong(self->pinned);
}
static PyObject *hb_get_closed(HostBuffer *self, void *c)
{
    (void)c;
    return PyBool_FromLong(self->ptr == NULL);
}
static PyObject *hb_get_exports(HostBuffer *self, void *c)
{
    (void)c;
    return PyLong_FromSsize_t(self->exports);
}

static PyMethodDef hb_methods[] = {
    {"close", (PyCFunction)hb_close, METH_NOARGS,
     "Free the memory now (BufferError while views of it are alive; a second close does nothing)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef hb_getset[] = {
    {"address", (getter)hb_get_address, NULL, "host address of the first byte (0 when closed)", NULL},
    {"nbytes", (getter)hb_get_nbytes, NULL, "size in bytes", NULL},
    {"pinned", (getter)hb_get_pinned, NULL, "pinned, device-mapped (cudaHostAlloc) or plain host memory", NULL},
    {"closed", (getter)hb_get_closed, NULL, "whether close() freed it", NULL},
    {"exports", (getter)hb_get_exports, NULL, "buffer views of it now alive", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject gvr_HostBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gvr._C.HostBuffer",
    .tp_basicsize = sizeof(HostBuffer),
    .tp_dealloc = (destructor)hb_dealloc,
    .tp_as_buffer = &hb_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "HostBuffer(nbytes, pinned=False): zero-filled host memory, pinned and device-mapped "
              "(cudaHostAlloc, portable) when pinned, with the buffer interface (numpy.frombuffer) and close().",
    .tp_methods = hb_methods,
    .tp_getset = hb_getset,
    .tp_new = hb_new,
};

/* ---- shared checks ---------------------------------------------------------------------------- */

/* The inner (P, Hkv, D) block of a 4-D view is dense in some dimension order: *elems = P*Hkv*D. */
static int page_dense(const gvr_view *v)
{
    int64_t sh[3], st[3];
    for (int i = 0; i < 3; i++) {
        sh[i] = v->shape[i + 1];
        st[i] = v->strides[i + 1];
    }
    for (int i = 0; i < 3; i++) /* sort by stride */
        for (int j = i + 1; j < 3; j++)
            if (st[j] < st[i] || (st[j] == st[i] && sh[j] < sh[i])) {
                int64_t a = st[i], b = sh[i];
                st[i] = st[j];
                sh[i] = sh[j];
                st[j] = a;
                sh[j] = b;
            }
    int64_t expect = 1;
    for (int i = 0; i < 3; i++) {
        if (sh[i] == 1)
            continue;
        if (st[i] != expect)
            return 0;
        expect *= sh[i];
    }
    return 1;
}

/* ---- prefetch --------------------------------------------------------------------------------- */

/* The CUDA library with device `dev` made current (*prev: the device end_on restores), or NULL with an
 * exception set. */
static const gvr_cuda_api *begin_on(int dev, int *prev)
{
    const gvr_cuda_api *cu = gvr_cuda();
    *prev = -1;
    if (cu && cu->set_device(dev, prev)) {
        gvr_cuda_raise("selecting the CUDA device");
        return NULL;
    }
    return cu;
}

static void end_on(const gvr_cuda_api *cu, int dev, int prev)
{
    if (prev >= 0 && prev != dev)
        cu->set_device(prev, NULL);
}


enum { HK, HV, H_NARGS };
static const gvr_arg_spec host_args[H_NARGS] = {
    [HK] = {"host_k", CACHE_DT, "num_pages,P,Hkv,D", GVR_HOST | GVR_PINNED, GVR_UNIT_LAST, NULL, NULL},
    [HV] = {"host_v", CACHE_DT, "num_pages,P,Hkv,D", GVR_HOST | GVR_PINNED, GVR_UNIT_LAST, "host_k", NULL},
};
static const gvr_spec host_spec = {"sparda.prefetch", H_NARGS, host_args};

enum { SIX, SBT, SRES, S_NARGS };
static const gvr_arg_spec sel_args[S_NARGS] = {
    [SIX] = {"indices", I32, "B,Hsel,n", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [SBT] = {"block_table", I32, "B,max_pages", ON_CALL, GVR_OPTIONAL | GVR_UNIT_LAST, NULL, NULL},
    [SRES] = {"resident", I32, "B,max_pages", ON_CALL, GVR_OPTIONAL | GVR_UNIT_LAST, NULL, NULL},
};
static const gvr_spec sel_spec = {"sparda.prefetch", S_NARGS, sel_args};

enum { DK, DV, DMAP, DCNT, DWS, D_NARGS };
static const gvr_arg_spec dst_args[D_NARGS] = {
    [DK] = {"dst_k", CACHE_DT, "S,P,Hkv,D", ON_CALL, GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
    [DV] = {"dst_v", CACHE_DT, "S,P,Hkv,D", ON_CALL, GVR_OUTPUT | GVR_UNIT_LAST, "dst_k", NULL},
    [DMAP] = {"slot_map_out", I32, "B,max_pages", ON_CALL, GVR_OUTPUT | GVR_ALLOC | GVR_OPTIONAL | GVR_UNIT_LAST, NULL,
              NULL},
    [DCNT] = {"counts", I64, "2", ON_CALL, GVR_OUTPUT | GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [DWS] = {"workspace", U8, "ws_bytes", GVR_DEVICE, GVR_OUTPUT | GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
};
static const gvr_spec dst_spec = {"sparda.prefetch", D_NARGS, dst_args};

const char gvr_sparda_prefetch_doc[] =
    "sparda_prefetch(host_k, host_v, indices, block_table, resident, dst_k, dst_v, slot_map_out, counts,\n"
    "                workspace, method, max_ctas, stream, nosync, prefetcher, ticket, cta_warps, lane_loads)\n--\n\n"
    "Gather the selected blocks of a paged host cache into a staging cache, moving only what is not\n"
    "resident; returns the slot map. See gvr.sparda.prefetch.";

static int cpu_prefetch(const void *p) { return sparda_prefetch_cpu((const gvr_prefetch_params *)p); }

static int cuda_prefetch(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    return cu->sparda_prefetch((const gvr_prefetch_params *)p, ws, ws_bytes, stream);
}

static int bind_from(gvr_intake *to, const gvr_intake *from, const char *dim)
{
    const int64_t v = gvr_intake_dim(from, dim);
    if (v < 0)
        return 0;
    for (int i = 0; i < from->ndims; i++)
        if (!strcmp(from->dim[i].name, dim))
            return gvr_intake_bind(to, dim, v, from->dim[i].source);
    return 0;
}

static int host_device_ptr(const gvr_cuda_api *cu, const gvr_view *v, const void **dptr)
{
    uintptr_t lo, hi;
    void *d = NULL;
    if (!gvr_view_extent(v, &lo, &hi)) {
        *dptr = v->data;
        return 0;
    }
    if (cu->host_device_pointer((const void *)lo, (size_t)(hi - lo), &d)) {
        PyErr_Format(PyExc_ValueError, "'%s' must be in pinned, device-mapped host memory to be read by the GPU "
                     "(gvr.sparda.HostKVCache, a torch tensor made with pin_memory=True, cudaHostAlloc), got %s", v->name,
                     cu->last_error());
        return -1;
    }
    *dptr = (const char *)d + ((uintptr_t)v->data - lo);
    return 0;
}

/* the gather CTAs' shape: warps 1..8 and 4, 8 or 16 loads in flight per lane (0: the library's choice) */
static int gather_shape_ok(int cta_warps, int lane_loads)
{
    if (cta_warps < 0 || cta_warps > 8) {
        PyErr_Format(PyExc_ValueError, "'cta_warps' must be 1..8, got %d", cta_warps);
        return -1;
    }
    if (lane_loads != 0 && lane_loads != 4 && lane_loads != 8 && lane_loads != 16) {
        PyErr_Format(PyExc_ValueError, "'lane_loads' must be 4, 8 or 16, got %d", lane_loads);
        return -1;
    }
    return 0;
}

PyObject *gvr_py_sparda_prefetch(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"host_k", "host_v", "indices", "block_table", "resident", "dst_k", "dst_v", "slot_map_out",
                             "counts", "workspace", "method", "max_ctas", "stream", "nosync", "prefetcher", "ticket",
                             "cta_warps", "lane_loads", NULL};
    PyObject *hobj[H_NARGS] = {Py_None, Py_None}, *sobj[S_NARGS] = {Py_None, Py_None, Py_None},
             *dobj[D_NARGS] = {Py_None, Py_None, Py_None, Py_None, Py_None};
    PyObject *o_stream = Py_None, *o_nosync = NULL, *result = NULL, *o_pf = Py_None;
    int method = 0, max_ctas = 0, cta_warps = 0, lane_loads = 0;
    unsigned long long ticket_addr = 0;
    int32_t *plan_map = NULL, *moves = NULL;
    gvr_intake hin, sin, din;
    gvr_intake_init(&hin);
    gvr_intake_init(&sin);
    gvr_intake_init(&din);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOOO|iiOOOKii:sparda_prefetch", kwlist, &hobj[HK], &hobj[HV],
                                     &sobj[SIX], &sobj[SBT], &sobj[SRES], &dobj[DK], &dobj[DV], &dobj[DMAP], &dobj[DCNT],
                                     &dobj[DWS], &method, &max_ctas, &o_stream, &o_nosync, &o_pf, &ticket_addr,
                                     &cta_warps, &lane_loads))
        return NULL;
    void *pf = NULL;
    if (o_pf != Py_None && !(pf = PyCapsule_GetPointer(o_pf, "gvr.prefetcher")))
        return NULL;
    unsigned nosync;
    intptr_t stream;
    if (gvr_parse_nosync(o_nosync, 14, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0)
        goto fail;
    if (method < GVR_PREFETCH_AUTO || method > GVR_PREFETCH_TMA || max_ctas < 0) {
        PyErr_Format(PyExc_ValueError, "'method' must be 0..3 and 'max_ctas' >= 0, got %d and %d", method, max_ctas);
        goto fail;
    }
    if (gather_shape_ok(cta_warps, lane_loads) < 0)
        goto fail;
    /* the host cache (always host memory), then the selection (binding B, max_pages), then the staging side */
    if (gvr_intake_run(&hin, &host_spec, hobj, stream, 0) < 0)
        goto fail;
    const gvr_view *hk = &hin.view[HK], *hv = &hin.view[HV];
    const int64_t num_pages = hk->shape[0];
    if (sobj[SBT] == Py_None && gvr_intake_bind(&sin, "max_pages", num_pages, "host_k (no block_table)") < 0)
        goto fail;
    if (gvr_intake_run(&sin, &sel_spec, sobj, stream, (nosync >> 2) & 7u) < 0)
        goto fail;
    static const char *dims[] = {"B", "max_pages"};
    for (int i = 0; i < 2; i++)
        if (bind_from(&din, &sin, dims[i]) < 0)
            goto fail;
    static const char *hdims[] = {"P", "Hkv", "D"};
    for (int i = 0; i < 3; i++)
        if (bind_from(&din, &hin, hdims[i]) < 0)
            goto fail;
    if (gvr_intake_run(&din, &dst_spec, dobj, stream, ((nosync >> 5) & 31u)) < 0)
        goto fail;
    const gvr_view *ix = &sin.view[SIX], *bt = &sin.view[SBT], *res = &sin.view[SRES], *dk = &din.view[DK],
                   *dv = &din.view[DV], *map = &din.view[DMAP], *cnt = &din.view[DCNT], *ws = &din.view[DWS];
    if (dk->dtype != hk->dtype) {
        PyErr_Format(PyExc_TypeError, "'dst_k' must be %s like 'host_k', got %s", hk->dtype_str, dk->dtype_str);
        goto fail;
    }
    const gvr_view *pair[4] = {hk, hv, dk, dv};
    for (int i = 0; i < 4; i++)
        if (!page_dense(pair[i])) {
            PyErr_Format(PyExc_ValueError, "'%s': every page [P, Hkv, D] must be one contiguous run of bytes (NHD, or HND "
                         "as a permuted view), got strides (%lld, %lld, %lld)", pair[i]->name,
                         (long long)pair[i]->strides[1], (long long)pair[i]->strides[2], (long long)pair[i]->strides[3]);
            goto fail;
        }
    for (int i = 0; i < 2; i++) {
        const gvr_view *h = pair[i], *d = pair[i + 2];
        if (h->strides[1] != d->strides[1] || h->strides[2] != d->strides[2] || h->strides[3] != d->strides[3]) {
            PyErr_Format(PyExc_ValueError, "'%s' must lay out its pages as '%s' does (token, head, dim strides (%lld, %lld, "
                         "%lld)), got (%lld, %lld, %lld)", d->name, h->name, (long long)h->strides[1],
                         (long long)h->strides[2], (long long)h->strides[3], (long long)d->strides[1],
                         (long long)d->strides[2], (long long)d->strides[3]);
            goto fail;
        }
    }
    const int64_t B = ix->shape[0], Hsel = ix->shape[1], n = ix->shape[2], S = dk->shape[0],
                  maxp = gvr_intake_dim(&sin, "max_pages");
    if (B * maxp > INT32_MAX || S > INT32_MAX || Hsel * n > INT32_MAX || num_pages > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "sparda.prefetch: B * max_pages, S, Hsel * n and num_pages must fit in int32");
        goto fail;
    }
    int64_t need = B * Hsel * n < B * maxp ? B * Hsel * n : B * maxp;
    if (S < need) {
        PyErr_Format(PyExc_ValueError, "'dst_k' must hold at least min(B*Hsel*n, B*max_pages) = %lld staging pages (the most "
                     "blocks one call can need), got S = %lld", (long long)need, (long long)S);
        goto fail;
    }
    if (gvr_views_overlap(map, res) || gvr_views_overlap(map, ix) || gvr_views_overlap(map, bt)) {
        PyErr_SetString(PyExc_ValueError, "'slot_map_out' must not overlap 'resident', 'indices' or 'block_table' (keep two "
                        "slot maps and alternate them)");
        goto fail;
    }
    { /* what the call writes against what it reads, across the three intakes (each checks its own) */
        const gvr_view *written[] = {dk, dv, map, cnt, ws}, *read[] = {hk, hv, ix, bt, res};
        for (int i = 0; i < 5; i++)
            for (int j = 0; j < 5; j++)
                if (gvr_views_overlap(written[i], read[j])) {
                    PyErr_Format(PyExc_ValueError, "'%s' must not overlap '%s'", written[i]->name, read[j]->name);
                    goto fail;
                }
    }
    gvr_prefetch_params p;
    memset(&p, 0, sizeof p);
    const int64_t isz = hk->itemsize;
    p.host_k = hk->data;
    p.host_v = hv->data;
    p.host_stride_k = hk->strides[0] * isz;
    p.host_stride_v = hv->strides[0] * isz;
    p.num_pages = num_pages;
    p.dst_k = dk->data;
    p.dst_v = dv->data;
    p.dst_stride_k = dk->strides[0] * isz;
    p.dst_stride_v = dv->strides[0] * isz;
    p.S = (int32_t)S;
    p.page_bytes = hk->shape[1] * hk->shape[2] * hk->shape[3] * isz;
    p.B = (int32_t)B;
    p.Hsel = (int32_t)Hsel;
    p.n = (int32_t)n;
    p.indices = (const int32_t *)ix->data;
    p.ix_stride_b = ix->strides[0];
    p.ix_stride_h = ix->strides[1];
    p.block_table = (const int32_t *)bt->data;
    p.bt_stride_b = bt->strides[0];
    p.max_pages = (int32_t)maxp;
    p.resident = (const int32_t *)res->data;
    p.res_stride_b = res->strides[0];
    p.slot_map = (int32_t *)map->data;
    p.map_stride_b = map->strides[0];
    p.counts = (int64_t *)cnt->data;
    p.max_ctas = max_ctas;
    p.cta_warps = cta_warps;
    p.lane_loads = lane_loads;
    if (din.device != GVR_DEV_CUDA) {
        if (sin.device == GVR_DEV_CUDA) {
            PyErr_Format(PyExc_ValueError, "mixed devices: 'dst_k' is in host memory but 'indices' is on cuda:%d; a host "
                         "staging cache takes host selections", sin.device_id);
            goto fail;
        }
        if (gvr_run_on_host(cpu_prefetch, &p) < 0)
            goto fail;
    } else {
        const gvr_cuda_api *cu = gvr_cuda();
        if (!cu)
            goto fail;
        const int host_sel = sin.device != GVR_DEV_CUDA;
        if (host_sel && (method == GVR_PREFETCH_KERNEL || method == GVR_PREFETCH_TMA)) {
            PyErr_Format(PyExc_ValueError, "method '%s' plans on the device: 'indices', 'block_table' and 'resident' "
                         "must be CUDA arrays (host selections go through method 'memcpy')",
                         method == GVR_PREFETCH_TMA ? "tma" : "kernel");
            goto fail;
        }
        if (!host_sel && method == GVR_PREFETCH_MEMCPY) {
            PyErr_SetString(PyExc_ValueError, "method 'memcpy' plans on the host: 'indices', 'block_table' and 'resident' "
                            "must be host arrays (device selections go through method 'kernel' or 'tma')");
            goto fail;
        }
        if (sin.device == GVR_DEV_CUDA && sin.device_id != din.device_id) {
            PyErr_Format(PyExc_ValueError, "mixed devices: 'dst_k' is on cuda:%d but 'indices' is on cuda:%d", din.device_id,
                         sin.device_id);
            goto fail;
        }
        /* device selections: auto is resolved by the CUDA library (bulk copies on sm_90 and later) */
        p.method = host_sel ? GVR_PREFETCH_MEMCPY : method;
        if (host_device_ptr(cu, hk, &p.host_k) < 0 || host_device_ptr(cu, hv, &p.host_v) < 0)
            goto fail;
        if (p.method != GVR_PREFETCH_MEMCPY &&
            (p.page_bytes % 16 || p.host_stride_k % 16 || p.host_stride_v % 16 || p.dst_stride_k % 16 ||
             p.dst_stride_v % 16 || (uintptr_t)p.host_k % 16 || (uintptr_t)p.host_v % 16 || (uintptr_t)p.dst_k % 16 ||
             (uintptr_t)p.dst_v % 16)) {
            PyErr_SetString(PyExc_ValueError, "sparda.prefetch on the GPU moves 16-byte pieces: pages of 'host_k', "
                            "'host_v', 'dst_k', 'dst_v' must start on 16-byte boundaries and hold a multiple of 16 bytes");
            goto fail;
        }
        if (pf) {
            if (p.method != GVR_PREFETCH_KERNEL || !ticket_addr) {
                PyErr_SetString(PyExc_ValueError, "a Prefetcher takes device selections ('indices', 'block_table', "
                                "'resident' CUDA arrays) and a ticket");
                goto fail;
            }
            int prev_dev, rc;
            if (!begin_on(din.device_id, &prev_dev))
                goto fail;
            Py_BEGIN_ALLOW_THREADS
            rc = cu->prefetcher_submit(pf, &p, (int64_t *)(uintptr_t)ticket_addr, (void *)stream);
            Py_END_ALLOW_THREADS
            end_on(cu, din.device_id, prev_dev);
            if (rc) {
                gvr_cuda_raise("gvr_prefetcher_submit");
                goto fail;
            }
        } else if (p.method != GVR_PREFETCH_MEMCPY) {
            const size_t wneed = cu->sparda_prefetch_workspace_size(&p);
            const size_t have = ws->data ? (size_t)ws->shape[0] : 0;
            if (have < wneed) {
                PyErr_Format(PyExc_ValueError, "'workspace' must hold %zu bytes for this call, got %zu (gvr.sparda.prefetch "
                             "allocates it)", wneed, have);
                goto fail;
            }
            if (gvr_run_on_device(&din, cuda_prefetch, &p, ws->data, have, stream, "gvr_sparda_prefetch") < 0)
                goto fail;
        } else {
            if (map->strides[0] != maxp) {
                PyErr_SetString(PyExc_ValueError, "'slot_map_out' must be contiguous for method 'memcpy'");
                goto fail;
            }
            int64_t cap = need < S ? need : S, plan_counts[2] = {0, 0};
            const int64_t cells = B * maxp > 0 ? B * maxp : 1;
            plan_map = malloc((size_t)cells * sizeof *plan_map);
            moves = malloc((size_t)(cap ? 2 * cap : 2) * sizeof *moves);
            if (!plan_map || !moves) {
                PyErr_NoMemory();
                goto fail;
            }
            gvr_prefetch_params hp = p;
            hp.slot_map = plan_map;
            hp.map_stride_b = maxp;
            hp.counts = plan_counts;
            int32_t nm = 0, rc;
            Py_BEGIN_ALLOW_THREADS
            rc = sparda_prefetch_plan_cpu(&hp, moves, &nm);
            Py_END_ALLOW_THREADS
            if (rc) {
                PyErr_NoMemory();
                goto fail;
            }
            p.moves = moves;
            p.n_moves = nm;
            p.plan_slot_map = plan_map;
            p.plan_counts = plan_counts;
            if (gvr_run_on_device(&din, cuda_prefetch, &p, NULL, 0, stream, "gvr_sparda_prefetch (memcpy)") < 0)
                goto fail;
        }
    }
    result = gvr_intake_object(&din, dobj, DMAP);
    Py_INCREF(result);
fail:
    free(plan_map);
    free(moves);
    gvr_intake_release(&hin);
    gvr_intake_release(&sin);
    gvr_intake_release(&din);
    return result;
}

/* prefetch_workspace_size(device, S, B, Hsel, n, max_pages) -> bytes */
PyObject *gvr_py_sparda_prefetch_workspace_size(PyObject *self, PyObject *args)
{
    (void)self;
    int dev;
    long long S, B, Hsel, n, maxp;
    if (!PyArg_ParseTuple(args, "iLLLLL:prefetch_workspace_size", &dev, &S, &B, &Hsel, &n, &maxp))
        return NULL;
    if (S < 0 || B < 0 || Hsel < 0 || n < 0 || maxp < 0 || S > INT32_MAX || B * maxp > INT32_MAX)
        return PyLong_FromLong(0);
    const gvr_cuda_api *cu = gvr_cuda();
    if (!cu)
        return NULL;
    gvr_prefetch_params p;
    memset(&p, 0, sizeof p);
    p.S = (int32_t)S;
    p.B = (int32_t)B;
    p.Hsel = (int32_t)(Hsel > INT32_MAX ? INT32_MAX : Hsel);
    p.n = (int32_t)(n > INT32_MAX ? INT32_MAX : n);
    p.max_pages = (int32_t)maxp;
    (void)dev;
    return PyLong_FromSize_t(cu->sparda_prefetch_workspace_size(&p));
}

/* ---- KV store --------------------------------------------------------------------------------- */

enum { KK, KV_, KSLOT, KDK, KDV, K_NARGS };
static const gvr_arg_spec store_args[K_NARGS] = {
    [KK] = {"k", CACHE_DT, "T,Hkv,D", ON_CALL, GVR_UNIT_LAST, NULL, NULL},
    [KV_] = {"v", CACHE_DT, "T,Hkv,D", ON_CALL, GVR_UNIT_LAST, "k", NULL},
    [KSLOT] = {"slots", I64, "T", ON_CALL, GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [KDK] = {"cache_k", CACHE_DT, "num_pages,P,Hkv,D", GVR_HOST | GVR_PINNED, GVR_OUTPUT | GVR_UNIT_LAST, NULL, NULL},
    [KDV] = {"cache_v", CACHE_DT, "num_pages,P,Hkv,D", GVR_HOST | GVR_PINNED, GVR_OUTPUT | GVR_UNIT_LAST, "cache_k",
             NULL},
};

const char gvr_sparda_kv_store_doc[] =
    "sparda_kv_store(k, v, slots, cache_k, cache_v, stream, nosync)\n--\n\n"
    "Write T new tokens (k, v [T, Hkv, D], int64 slots [T], < 0 skipped) into a paged host cache; on the GPU\n"
    "through its device mapping. See gvr.sparda.HostKVCache.append.";

static int cpu_store(const void *p) { return sparda_kv_store_cpu((const gvr_kv_store_params *)p); }

static int cuda_store(const gvr_cuda_api *cu, const void *p, void *ws, size_t ws_bytes, void *stream)
{
    (void)ws;
    (void)ws_bytes;
    return cu->sparda_kv_store((const gvr_kv_store_params *)p, stream);
}

PyObject *gvr_py_sparda_kv_store(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"k", "v", "slots", "cache_k", "cache_v", "stream", "nosync", NULL};
    PyObject *obj[K_NARGS] = {Py_None, Py_None, Py_None, Py_None, Py_None};
    PyObject *o_stream = Py_None, *o_nosync = NULL, *result = NULL;
    gvr_intake src, dst;
    gvr_intake_init(&src);
    gvr_intake_init(&dst);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO|OO:sparda_kv_store", kwlist, &obj[KK], &obj[KV_], &obj[KSLOT],
                                     &obj[KDK], &obj[KDV], &o_stream, &o_nosync))
        return NULL;
    unsigned nosync;
    intptr_t stream;
    if (gvr_parse_nosync(o_nosync, K_NARGS, &nosync) < 0 || gvr_parse_stream(o_stream, &stream) < 0)
        goto fail;
    /* the cache (host memory) and the new tokens (host, or one CUDA device) are taken apart */
    static const gvr_spec cache_spec = {"sparda.HostKVCache.append", 2, store_args + KDK};
    static const gvr_spec tok_spec = {"sparda.HostKVCache.append", 3, store_args};
    if (gvr_intake_run(&src, &tok_spec, obj, stream, nosync & 7u) < 0)
        goto fail;
    if (bind_from(&dst, &src, "Hkv") < 0 || bind_from(&dst, &src, "D") < 0)
        goto fail;
    if (gvr_intake_run(&dst, &cache_spec, obj + KDK, stream, 0) < 0)
        goto fail;
    const gvr_view *k = &src.view[KK], *v = &src.view[KV_], *sl = &src.view[KSLOT], *ck = &dst.view[0], *cv = &dst.view[1];
    if (ck->dtype != k->dtype || cv->dtype != k->dtype) {
        PyErr_Format(PyExc_TypeError, "'k' must be %s like the cache, got %s", ck->dtype_str, k->dtype_str);
        goto fail;
    }
    { /* new tokens read out of the cache itself would be overwritten while they are read */
        const gvr_view *read[] = {k, v, sl};
        for (int i = 0; i < 3; i++)
            if (gvr_views_overlap(read[i], ck) || gvr_views_overlap(read[i], cv)) {
                PyErr_Format(PyExc_ValueError, "'%s' must not overlap the layer's cache (copy the tokens first)",
                             read[i]->name);
                goto fail;
            }
    }
    gvr_kv_store_params p;
    memset(&p, 0, sizeof p);
    p.elem_bytes = k->itemsize;
    p.T = (int32_t)k->shape[0];
    p.Hkv = (int32_t)k->shape[1];
    p.D = (int32_t)k->shape[2];
    if (k->shape[0] > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "'k': at most 2^31 - 1 tokens per append");
        goto fail;
    }
    p.k = k->data;
    p.v = v->data;
    p.k_stride_t = k->strides[0];
    p.k_stride_h = k->strides[1];
    p.v_stride_t = v->strides[0];
    p.v_stride_h = v->strides[1];
    p.slots = (const int64_t *)sl->data;
    p.dst_k = ck->data;
    p.dst_v = cv->data;
    p.dk_stride_page = ck->strides[0];
    p.dk_stride_tok = ck->strides[1];
    p.dk_stride_head = ck->strides[2];
    p.dv_stride_page = cv->strides[0];
    p.dv_stride_tok = cv->strides[1];
    p.dv_stride_head = cv->strides[2];
    p.num_pages = ck->shape[0];
    p.P = (int32_t)ck->shape[1];
    if (src.device == GVR_DEV_CUDA) {
        if (sl->strides[0] != 1 && p.T > 1) {
            PyErr_SetString(PyExc_ValueError, "'slots' must be contiguous on the device");
            goto fail;
        }
        const gvr_cuda_api *cu = gvr_cuda();
        if (!cu || host_device_ptr(cu, ck, (const void **)&p.dst_k) < 0 ||
            host_device_ptr(cu, cv, (const void **)&p.dst_v) < 0)
            goto fail;
        if (p.T && gvr_run_on_device(&src, cuda_store, &p, NULL, 0, stream, "gvr_sparda_kv_store") < 0)
            goto fail;
    } else {
        const int64_t cap = p.num_pages * p.P;
        int64_t *copy = NULL;
        if (sl->strides[0] != 1) {
            if (!(copy = malloc((size_t)(p.T ? p.T : 1) * sizeof *copy))) {
                PyErr_NoMemory();
                goto fail;
            }
            for (int64_t t = 0; t < p.T; t++)
                copy[t] = ((const int64_t *)sl->data)[t * sl->strides[0]];
            p.slots = copy;
        }
        for (int64_t t = 0; t < p.T; t++)
            if (p.slots[t] >= cap) {
                PyErr_Format(PyExc_ValueError, "'slots' must be < num_pages * P = %lld (or < 0 to skip), got slots[%lld] = "
                             "%lld", (long long)cap, (long long)t, (long long)p.slots[t]);
                free(copy);
                goto fail;
            }
        const int rc = gvr_run_on_host(cpu_store, &p);
        free(copy);
        if (rc < 0)
            goto fail;
    }
    result = Py_None;
    Py_INCREF(result);
fail:
    gvr_intake_release(&src);
    gvr_intake_release(&dst);
    return result;
}

/* ---- the persistent prefetcher: create / wait / status / close (gvr.sparda.Prefetcher) --------------- */

static void *pf_of(PyObject *cap) { return PyCapsule_GetPointer(cap, "gvr.prefetcher"); }

/* prefetcher_create(device, ctas, depth, timeout_ns, slot_workspace_ptr, slot_ws_bytes, cta_warps, lane_loads,
 * start) -> capsule */
PyObject *gvr_py_prefetcher_create(PyObject *self, PyObject *args)
{
    (void)self;
    int dev, ctas, depth, cta_warps = 0, lane_loads = 0, start = 1;
    long long timeout_ns;
    unsigned long long ws;
    Py_ssize_t ws_bytes;
    if (!PyArg_ParseTuple(args, "iiiLKn|iip:prefetcher_create", &dev, &ctas, &depth, &timeout_ns, &ws, &ws_bytes,
                          &cta_warps, &lane_loads, &start))
        return NULL;
    if (ctas < 1 || depth < 1 || timeout_ns < 1 || ws_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "prefetcher: ctas, depth and timeout must be >= 1, got %d, %d, %lld", ctas, depth,
                     timeout_ns);
        return NULL;
    }
    if (gather_shape_ok(cta_warps, lane_loads) < 0)
        return NULL;
    int prev;
    const gvr_cuda_api *cu = begin_on(dev, &prev);
    if (!cu)
        return NULL;
    gvr_prefetcher_config c = {ctas, depth, timeout_ns, (void *)(uintptr_t)ws, (size_t)ws_bytes, cta_warps, lane_loads,
                               start};
    void *h = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cu->prefetcher_create(&c, &h);
    Py_END_ALLOW_THREADS
    end_on(cu, dev, prev);
    if (rc)
        return gvr_cuda_raise("gvr_prefetcher_create");
    return PyCapsule_New(h, "gvr.prefetcher", NULL);
}

/* prefetcher_start(capsule, device): the persistent kernel, once */
PyObject *gvr_py_prefetcher_start(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap;
    int dev;
    if (!PyArg_ParseTuple(args, "Oi:prefetcher_start", &cap, &dev))
        return NULL;
    void *h = pf_of(cap);
    if (!h)
        return NULL;
    int prev;
    const gvr_cuda_api *cu = begin_on(dev, &prev);
    if (!cu)
        return NULL;
    const int rc = cu->prefetcher_start(h);
    end_on(cu, dev, prev);
    if (rc)
        return gvr_cuda_raise("gvr_prefetcher_start");
    Py_RETURN_NONE;
}

/* prefetcher_wait(capsule, device, ticket_ptr, stream) */
PyObject *gvr_py_prefetcher_wait(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *o_stream;
    int dev;
    unsigned long long ticket;
    intptr_t stream;
    if (!PyArg_ParseTuple(args, "OiKO:prefetcher_wait", &cap, &dev, &ticket, &o_stream))
        return NULL;
    void *h = pf_of(cap);
    if (!h || gvr_parse_stream(o_stream, &stream) < 0)
        return NULL;
    int prev;
    const gvr_cuda_api *cu = begin_on(dev, &prev);
    if (!cu)
        return NULL;
    const int rc = cu->prefetcher_wait(h, (const int64_t *)(uintptr_t)ticket, (void *)stream);
    end_on(cu, dev, prev);
    if (rc)
        return gvr_cuda_raise("gvr_prefetcher_wait");
    Py_RETURN_NONE;
}

/* prefetcher_status(capsule) -> (error, running) */
PyObject *gvr_py_prefetcher_status(PyObject *self, PyObject *cap)
{
    (void)self;
    void *h = pf_of(cap);
    if (!h)
        return NULL;
    const gvr_cuda_api *cu = gvr_cuda();
    if (!cu)
        return NULL;
    int32_t err = 0, running = 0;
    int64_t done = 0;
    cu->prefetcher_status(h, &err, &done, &running);
    return Py_BuildValue("(ii)", (int)err, (int)running);
}

/* prefetcher_close(capsule, device, timeout_ms) */
PyObject *gvr_py_prefetcher_close(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap;
    int dev;
    long long timeout_ms;
    if (!PyArg_ParseTuple(args, "OiL:prefetcher_close", &cap, &dev, &timeout_ms))
        return NULL;
    void *h = pf_of(cap);
    if (!h)
        return NULL;
    int prev, rc;
    const gvr_cuda_api *cu = begin_on(dev, &prev);
    if (!cu)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = cu->prefetcher_close(h, timeout_ms);
    Py_END_ALLOW_THREADS
    end_on(cu, dev, prev);
    if (rc)
        return gvr_cuda_raise("gvr_prefetcher_close");
    Py_RETURN_NONE;
}

/* gvr._C: the method table and the module. Operators live in csrc/<op>.c, their argument checks in
 * their specs (csrc/intake.h). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define PY_ARRAY_UNIQUE_SYMBOL gvr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#define NPY_TARGET_VERSION NPY_1_23_API_VERSION
#include <numpy/arrayobject.h>

#include "cpu/attention_cpu.h"
#include "cpu/threads.h"
#include "cpu/topk_cpu.h"
#include "cuda_lib.h"
#include "intake.h"
#include "ops.h"

static PyObject *py_cpu_stats(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    gvr_topk_cpu_stats s;
    topk_cpu_last_stats(&s);
    return Py_BuildValue("{sisL}", "count_passes", s.count_passes, "candidates", (long long)s.candidates);
}

static PyObject *py_cpu_isa(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(attention_cpu_isa());
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_ssize_t n;
    if (gvr_parse_int(arg, "n", &n) < 0)
        return NULL;
    gvr_set_num_threads(n > 1 << 20 ? 1 << 20 : (int)n);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromLong(gvr_get_num_threads());
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
    intptr_t stream;
    if (gvr_parse_stream(arg, &stream) < 0)
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
    return Py_BuildValue("{sssssis{sLsisi}}", "threads", "pthreads", "cuda_library", gvr_cuda_path(), "abi_version",
                         GVR_ABI_VERSION, "limits", "topk_max_n", (long long)GVR_TOPK_MAX_N, "topk_sorted_max_k",
                         GVR_TOPK_SORTED_MAX_K, "radix_max_positions", GVR_RADIX_MAX_POSITIONS);
}

static PyMethodDef methods[] = {
    {"topk_decode", (PyCFunction)(void (*)(void))gvr_py_topk_decode, METH_VARARGS | METH_KEYWORDS, gvr_topk_doc},
    {"sparse_attention", (PyCFunction)(void (*)(void))gvr_py_sparse_attention, METH_VARARGS | METH_KEYWORDS,
     gvr_attention_doc},
    {"attention_workspace_size", gvr_py_attention_workspace_size, METH_VARARGS,
     "Bytes of CUDA workspace sparse_attention needs for these shapes on this device."},
    {"merge_states", (PyCFunction)(void (*)(void))gvr_py_merge_states, METH_VARARGS | METH_KEYWORDS, gvr_merge_doc},
    {"prr_missed", (PyCFunction)(void (*)(void))gvr_py_prr_missed, METH_VARARGS | METH_KEYWORDS, gvr_missed_doc},
    {"prr_finalize", (PyCFunction)(void (*)(void))gvr_py_prr_finalize, METH_VARARGS | METH_KEYWORDS,
     gvr_finalize_doc},
    {"block_metadata", (PyCFunction)(void (*)(void))gvr_py_block_metadata, METH_VARARGS | METH_KEYWORDS,
     gvr_block_metadata_doc},
    {"block_scores", (PyCFunction)(void (*)(void))gvr_py_block_scores, METH_VARARGS | METH_KEYWORDS,
     gvr_block_scores_doc},
    /* @@prr-select-methods@@ */
    {"sparda_compressed_keys", (PyCFunction)(void (*)(void))gvr_py_sparda_compressed_keys,
     METH_VARARGS | METH_KEYWORDS, gvr_sparda_ckeys_doc},
    {"sparda_prefetch", (PyCFunction)(void (*)(void))gvr_py_sparda_prefetch, METH_VARARGS | METH_KEYWORDS,
     gvr_sparda_prefetch_doc},
    {"prefetch_workspace_size", gvr_py_sparda_prefetch_workspace_size, METH_VARARGS,
     "prefetch_workspace_size(device, S, B, Hsel, n, max_pages) -> bytes of gvr.sparda.prefetch's CUDA workspace"},
    {"sparda_kv_store", (PyCFunction)(void (*)(void))gvr_py_sparda_kv_store, METH_VARARGS | METH_KEYWORDS,
     gvr_sparda_kv_store_doc},
    {"prefetcher_create", gvr_py_prefetcher_create, METH_VARARGS,
     "prefetcher_create(device, ctas, depth, timeout_ns, slot_workspace_ptr, slot_ws_bytes, cta_warps=0, lane_loads=0, "
     "start=True) -> handle (gvr.sparda.Prefetcher)"},
    {"prefetcher_start", gvr_py_prefetcher_start, METH_VARARGS, "prefetcher_start(handle, device): the persistent kernel"},
    {"prefetcher_wait", gvr_py_prefetcher_wait, METH_VARARGS, "prefetcher_wait(handle, device, ticket_ptr, stream)"},
    {"prefetcher_status", gvr_py_prefetcher_status, METH_O, "prefetcher_status(handle) -> (error, running)"},
    {"prefetcher_close", gvr_py_prefetcher_close, METH_VARARGS, "prefetcher_close(handle, device, timeout_ms)"},
    {"prr_ema_predict", (PyCFunction)(void (*)(void))gvr_py_prr_ema_predict, METH_VARARGS | METH_KEYWORDS,
     gvr_ema_predict_doc},
    {"prr_ema_update", (PyCFunction)(void (*)(void))gvr_py_prr_ema_update, METH_VARARGS | METH_KEYWORDS,
     gvr_ema_update_doc},
    {"prr_ema_calibrate", (PyCFunction)(void (*)(void))gvr_py_prr_ema_calibrate, METH_VARARGS | METH_KEYWORDS,
     gvr_ema_calibrate_doc},
    {"prr_ema_calibrate_workspace_size", gvr_py_prr_ema_calibrate_workspace_size, METH_VARARGS,
     "Bytes of CUDA workspace prr_ema_calibrate needs for these shapes (device, T, N, k, G)."},
    /* @@prr-ema-methods@@ */
    {"cpu_stats", py_cpu_stats, METH_NOARGS, "Search statistics of the calling thread's last CPU row."},
    {"cpu_isa", py_cpu_isa, METH_NOARGS,
     "Instruction set of the CPU attention loops in this process: 'avx2' or 'generic' (GVR_CPU_ISA=generic "
     "forces the generic loops)."},
    {"set_num_threads", py_set_num_threads, METH_O,
     "Threads for CPU rows: n, or 0 for the default (up to the online CPUs, helpers only for idle ones)."},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "Threads used for CPU rows (at most; capped by the rows)."},
    {"_set_dlpack_export", gvr_py_set_dlpack_export, METH_VARARGS,
     "_set_dlpack_export(fn, type): objects of exactly this type, on the stream they are used on, are exported "
     "by fn(obj) -> DLPack capsule (torch: torch._C._to_dlpack_versioned); (None, None) clears."},
    {"cuda_available", py_cuda_available, METH_NOARGS, "Whether libgvr_cuda.so loads."},
    {"cuda_error", py_cuda_error, METH_NOARGS, "Why libgvr_cuda.so does not load (None if it does)."},
    {"cuda_synchronize", py_cuda_synchronize, METH_O, "Wait for a CUDA stream (tests)."},
    {"build_info", py_build_info, METH_NOARGS, "What was built."},
    {"_intake_check", (PyCFunction)(void (*)(void))gvr_intake_check_py, METH_VARARGS | METH_KEYWORDS,
     "_intake_check(spec_name, **buffers): run a test spec of the argument intake (tests only)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "gvr._C", "gvr's C core.", -1, methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void)
{
    import_array();
    if (PyType_Ready(&gvr_HostBufferType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    Py_INCREF(&gvr_HostBufferType);
    if (PyModule_AddObject(m, "HostBuffer", (PyObject *)&gvr_HostBufferType) < 0) {
        Py_DECREF(&gvr_HostBufferType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

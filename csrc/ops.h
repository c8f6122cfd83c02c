/* The operators' Python entry points (one csrc/<op>.c each), for the method table in module.c. */
#ifndef GVR_OPS_H
#define GVR_OPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "intake.h"

PyObject *gvr_py_topk_decode(PyObject *self, PyObject *args, PyObject *kwds);
extern const char gvr_topk_doc[];
extern const gvr_spec gvr_topk_spec;

PyObject *gvr_py_sparse_attention(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *gvr_py_attention_workspace_size(PyObject *self, PyObject *args);
PyObject *gvr_py_merge_states(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *gvr_py_prr_missed(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *gvr_py_prr_finalize(PyObject *self, PyObject *args, PyObject *kwds);
extern const char gvr_attention_doc[], gvr_merge_doc[], gvr_missed_doc[], gvr_finalize_doc[];
extern const gvr_spec gvr_attention_spec;

PyObject *gvr_py_block_metadata(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *gvr_py_block_scores(PyObject *self, PyObject *args, PyObject *kwds);
extern const char gvr_block_metadata_doc[], gvr_block_scores_doc[];
/* @@prr-select-decls@@ */
PyObject *gvr_py_sparda_compressed_keys(PyObject *self, PyObject *args, PyObject *kwds);
extern const char gvr_sparda_ckeys_doc[];
PyObject *gvr_py_sparda_prefetch(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *gvr_py_sparda_prefetch_workspace_size(PyObject *self, PyObject *args);
PyObject *gvr_py_sparda_kv_store(PyObject *self, PyObject *args, PyObject *kwds);
extern const char gvr_sparda_prefetch_doc[], gvr_sparda_kv_store_doc[];
extern PyTypeObject gvr_HostBufferType;
PyObject *gvr_py_prefetcher_create(PyObject *self, PyObject *args);
PyObject *gvr_py_prefetcher_wait(PyObject *self, PyObject *args);
PyObject *gvr_py_prefetcher_start(PyObject *self, PyObject *args);
PyObject *gvr_py_prefetcher_status(PyObject *self, PyObject *cap);
PyObject *gvr_py_prefetcher_close(PyObject *self, PyObject *args);
PyObject *gvr_py_prr_ema_predict(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *gvr_py_prr_ema_update(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *gvr_py_prr_ema_calibrate(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *gvr_py_prr_ema_calibrate_workspace_size(PyObject *self, PyObject *args);
extern const char gvr_ema_predict_doc[], gvr_ema_update_doc[], gvr_ema_calibrate_doc[];
/* @@prr-ema-decls@@ */

#endif

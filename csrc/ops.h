/* The operators' Python entry points (one csrc/<op>.c each), for the method table in module.c. */
#ifndef GVR_OPS_H
#define GVR_OPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "intake.h"

PyObject *gvr_py_topk_decode(PyObject *self, PyObject *args, PyObject *kwds);
extern const char gvr_topk_doc[];
extern const gvr_spec gvr_topk_spec;

#endif

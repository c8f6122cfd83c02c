/* dlopen of libgvr_cuda.so on first use; the dlsym loop runs over GVR_CUDA_SYMBOLS. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <string.h>

#include "cuda_lib.h"

static gvr_cuda_api api;
static int loaded = 0; /* 0: not tried, 1: ok, -1: failed */
static char lib_path[4096];
static char load_error[1024];

const char *gvr_cuda_path(void)
{
    if (!lib_path[0]) {
        Dl_info info;
        if (dladdr((void *)&gvr_cuda_path, &info) && info.dli_fname) {
            const char *slash = strrchr(info.dli_fname, '/');
            size_t dir = slash ? (size_t)(slash - info.dli_fname) : 0;
            snprintf(lib_path, sizeof lib_path, "%.*s%s_lib/libgvr_cuda.so", (int)dir, info.dli_fname,
                     dir ? "/" : "");
        } else {
            snprintf(lib_path, sizeof lib_path, "libgvr_cuda.so");
        }
    }
    return lib_path;
}

/* Every entry point of GVR_CUDA_SYMBOLS: its name and where its address goes. */
static const struct {
    const char *symbol;
    void **slot;
} symbols[] = {
#define GVR_CUDA_ENTRY(ret, field, symbol, params) {#symbol, (void **)&api.field},
    GVR_CUDA_SYMBOLS(GVR_CUDA_ENTRY)
#undef GVR_CUDA_ENTRY
};

const gvr_cuda_api *gvr_cuda(void)
{
    if (loaded == 0) {
        const char *path = gvr_cuda_path();
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char *e = dlerror();
            snprintf(load_error, sizeof load_error,
                     "gvr's CUDA library could not be loaded (%s). gvr was built without CUDA kernels, "
                     "or they do not load here: reinstall with nvcc on PATH (or CUDA_HOME set) to build "
                     "them, or pass CPU buffers",
                     e ? e : path);
            loaded = -1;
        } else {
            for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
                *symbols[i].slot = dlsym(h, symbols[i].symbol);
                if (!*symbols[i].slot) {
                    snprintf(load_error, sizeof load_error, "%s lacks the symbol %s (a stale build?)", path,
                             symbols[i].symbol);
                    goto fail;
                }
            }
            if (api.abi_version() != GVR_ABI_VERSION) {
                snprintf(load_error, sizeof load_error, "%s has ABI version %d, gvr._C expects %d (a stale build?)",
                         path, api.abi_version(), GVR_ABI_VERSION);
                goto fail;
            }
            loaded = 1;
        }
        goto done;
    fail:
        dlclose(h);
        loaded = -1;
    }
done:
    if (loaded == 1)
        return &api;
    PyErr_SetString(PyExc_RuntimeError, load_error);
    return NULL;
}

void *gvr_cuda_raise(const char *what)
{
    const char *msg = (loaded == 1 && api.last_error) ? api.last_error() : "unknown error";
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s", what, msg);
    return NULL;
}

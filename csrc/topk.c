/* topk_decode: its argument spec, its CPU call and its CUDA call. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "cpu/topk_cpu.h"
#include "cuda_lib.h"
#include "intake.h"
#include "ops.h"

enum { SCORES, PREV, LENGTHS, OUT, BT, OPOS, STARTS, NARGS };

/* argument i's nosync bit is bit i (gvr/_interop.py sets them in this order) */
static const gvr_arg_spec topk_args[NARGS] = {
    [SCORES] = {"scores", GVR_DT(GVR_DTYPE_F32) | GVR_DT(GVR_DTYPE_F16) | GVR_DT(GVR_DTYPE_BF16), "B,N|N;B=1",
                GVR_HOST | GVR_DEVICE, GVR_UNIT_LAST, NULL, NULL},
    [PREV] = {"prev_topk", GVR_DT(GVR_DTYPE_I32), "Bp,Kp|Kp", GVR_HOST | GVR_DEVICE, GVR_OPTIONAL | GVR_UNIT_LAST,
              NULL, NULL},
    [LENGTHS] = {"lengths", GVR_DT(GVR_DTYPE_I32), "Bl", GVR_HOST | GVR_DEVICE,
                 GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE, NULL, NULL},
    [OUT] = {"out", GVR_DT(GVR_DTYPE_I32), "B,K|K", GVR_HOST | GVR_DEVICE, GVR_OUTPUT | GVR_ALLOC | GVR_UNIT_LAST,
             NULL, "scores"},
    [BT] = {"block_table", GVR_DT(GVR_DTYPE_I32), "Bt,max_pages|max_pages", GVR_HOST | GVR_DEVICE,
            GVR_OPTIONAL | GVR_UNIT_LAST, NULL, "scores"},
    [OPOS] = {"out_positions", GVR_DT(GVR_DTYPE_I32), "B,K|K", GVR_HOST | GVR_DEVICE,
              GVR_OPTIONAL | GVR_OUTPUT | GVR_UNIT_LAST, NULL, "scores"},
    [STARTS] = {"row_starts", GVR_DT(GVR_DTYPE_I32), "B", GVR_HOST | GVR_DEVICE,
                GVR_OPTIONAL | GVR_CONTIGUOUS_ON_DEVICE, NULL, "scores"},
};
const gvr_spec gvr_topk_spec = {"topk_decode", NARGS, topk_args};

const char gvr_topk_doc[] =
    "topk_decode(scores, k, prev_topk, lengths, out, sorted, stream, method, nosync, block_table, page_size,\n"
    "            out_positions, row_starts, next_n, max_length)\n--\n\n"
    "Exact Top-K of each row of scores into out (int32). See gvr.topk_decode.\n"
    "block_table (int32 [B, max_pages]) with page_size: out holds physical slots, out_positions the positions.\n"
    "sorted: a bool. method: 'auto', 'gvr' or 'radix' (CUDA paths; the CPU has one implementation).\n"
    "stream: the CUDA stream of a call on CUDA buffers; host buffers ignore it.\n"
    "row_starts (int32 [B]): ragged rows; next_n: rows per request (lengths, prev_topk, block_table may\n"
    "have one row per request).\n"
    "nosync: bit i set (i = 0 scores, 1 prev_topk, 2 lengths, 3 out, 4 block_table, 5 out_positions,\n"
    "6 row_starts) when\n"
    "that argument's\n"
    "producer runs on `stream` as its current stream: its DLPack export gets stream=-1.";

static int parse_method(PyObject *o, int *method)
{
    const char *s = "auto";
    if (o && o != Py_None) {
        if (!PyUnicode_Check(o)) {
            PyErr_Format(PyExc_TypeError, "'method' must be a str ('auto', 'gvr' or 'radix'), got %s",
                         Py_TYPE(o)->tp_name);
            return -1;
        }
        if (!(s = PyUnicode_AsUTF8(o)))
            return -1;
    }
    if (!strcmp(s, "auto"))
        *method = GVR_TOPK_AUTO;
    else if (!strcmp(s, "gvr"))
        *method = GVR_TOPK_GVR;
    else if (!strcmp(s, "radix"))
        *method = GVR_TOPK_RADIX;
    else {
        PyErr_Format(PyExc_ValueError, "'method' must be 'auto', 'gvr' or 'radix', got '%s'", s);
        return -1;
    }
    return 0;
}

/* lengths must lie in [0, N]: checked (and made contiguous) on the host */
static int read_lengths(const int32_t *src, int64_t stride, int64_t B, int64_t N, int32_t *dst)
{
    for (int64_t b = 0; b < B; b++) {
        const int32_t L = src[b * stride];
        if (L < 0 || L > N) {
            PyErr_Format(PyExc_ValueError, "'lengths' must lie in [0, %lld], got lengths[%lld] = %d", (long long)N,
                         (long long)b, L);
            return -1;
        }
        dst[b] = L;
    }
    return 0;
}

/* The CPU path's rows: per-row lengths (the per-request rule applied, clamped to [0, N - start]) in
 * len_copy, checked starts in start_copy. Host row_starts must lie in [0, N] and, with per-row lengths,
 * start + length <= N (ValueError otherwise). */
static int host_rows(gvr_topk_params *p, const gvr_view *ln, const gvr_view *st, int32_t *len_copy,
                     int32_t *start_copy)
{
    const int64_t B = p->B, N = p->N;
    if (st->data) {
        for (int64_t b = 0; b < B; b++) {
            const int32_t s0 = ((const int32_t *)st->data)[b * st->strides[0]];
            if (s0 < 0 || s0 > N) {
                PyErr_Format(PyExc_ValueError, "'row_starts' must lie in [0, %lld], got row_starts[%lld] = %d",
                             (long long)N, (long long)b, s0);
                return -1;
            }
            start_copy[b] = s0;
        }
        p->row_starts = start_copy;
    }
    if (!ln->data)
        return 0;
    const int per_req = (p->per_request & GVR_TOPK_LENGTHS_PER_REQUEST) != 0;
    const int64_t nl = per_req ? B / p->next_n : B;
    if (read_lengths((const int32_t *)ln->data, ln->strides[0], nl, N, len_copy) < 0)
        return -1;
    if (per_req) { /* expand, last request first (in place) */
        for (int64_t b = B - 1; b >= 0; b--) {
            const int64_t L = (int64_t)len_copy[b / p->next_n] - (p->next_n - 1 - b % p->next_n);
            const int64_t room = N - (p->row_starts ? p->row_starts[b] : 0);
            len_copy[b] = (int32_t)(L < 0 ? 0 : L > room ? room : L);
        }
        p->per_request &= ~GVR_TOPK_LENGTHS_PER_REQUEST;
    } else if (p->row_starts) {
        for (int64_t b = 0; b < B; b++)
            if ((int64_t)len_copy[b] + p->row_starts[b] > N) {
                PyErr_Format(PyExc_ValueError, "row %lld: row_starts + lengths = %d + %d exceeds the row of %lld scores",
                             (long long)b, p->row_starts[b], len_copy[b], (long long)N);
                return -1;
            }
    }
    p->lengths = len_copy;
    return 0;
}

static int run_cpu(gvr_topk_params *p, const gvr_intake *in, int32_t *len_copy, int32_t *start_copy)
{
    if (host_rows(p, &in->view[LENGTHS], &in->view[STARTS], len_copy, start_copy) < 0)
        return -1;
    /* method auto leaves the hint out, as on CUDA: measured, it never made the C path faster and cost
     * 1-6% on a warm row (benchmarks/RESULTS.md, issue 15's sweep); method "gvr" still uses it */
    if (p->method == GVR_TOPK_AUTO) {
        p->prev = NULL;
        p->Kp = 0;
    }
    int64_t q;
    int32_t page;
    const int64_t bad = topk_map_overflow_cpu(p, &q, &page);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "'block_table' maps row %lld's page %lld to page %d: its slots (page * "
                     "page_size + offset, page_size = %d) exceed int32",
                     (long long)bad, (long long)q, page, p->page_size);
        return -1;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = topk_decode_cpu(p);
    if (rc == 0 && (p->block_table || p->out_pos))
        topk_map_cpu(p);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int run_cuda(gvr_topk_params *p, const gvr_intake *in, intptr_t stream, int32_t *len_copy)
{
    const gvr_view *ln = &in->view[LENGTHS];
    /* the CUDA path's limits (gvr_kernels.h), before the library loads */
    if (p->sorted && p->k > GVR_TOPK_SORTED_MAX_K) {
        PyErr_Format(PyExc_ValueError, "'sorted=True' on CUDA supports k <= %d, got k = %d", GVR_TOPK_SORTED_MAX_K,
                     p->k);
        return -1;
    }
    /* rows in 16-byte aligned coordinates: a row starting s floats past a boundary covers N + s */
    if (p->method == GVR_TOPK_RADIX && gvr_topk_row_positions(p) > GVR_RADIX_MAX_POSITIONS) {
        PyErr_Format(PyExc_ValueError,
                     "'scores' rows longer than %d exceed the radix path (method 'gvr' or 'auto' serves them; "
                     "rows not starting on a 16-byte boundary: %d), got N = %d",
                     GVR_RADIX_MAX_POSITIONS, GVR_RADIX_MAX_POSITIONS - 3, p->N);
        return -1;
    }
    if ((int64_t)p->N > (int64_t)GVR_TOPK_MAX_N) {
        PyErr_Format(PyExc_ValueError, "'scores' rows on CUDA hold at most %lld scores, got N = %d",
                     (long long)GVR_TOPK_MAX_N, p->N);
        return -1;
    }
    const gvr_cuda_api *cu = gvr_cuda();
    if (!cu)
        return -1;
    int rc, prev_dev = -1;
    if (cu->set_device(in->device_id, &prev_dev)) {
        gvr_cuda_raise("selecting the CUDA device");
        return -1;
    }
    rc = 0;
    if (in->view[STARTS].data)
        p->row_starts = (const int32_t *)in->view[STARTS].data;
    if (ln->data) {
        p->lengths = (const int32_t *)ln->data;
        const char *chk = getenv("GVR_CHECK");
        if (chk && chk[0] == '1') {
            /* opt-in: validate device-resident lengths at the cost of a sync */
            const int64_t nl = p->per_request & GVR_TOPK_LENGTHS_PER_REQUEST ? p->B / p->next_n : p->B;
            if (cu->copy_to_host(len_copy, ln->data, (size_t)nl * sizeof *len_copy, (void *)stream)) {
                gvr_cuda_raise("reading 'lengths'");
                rc = -1;
            } else if (read_lengths(len_copy, 1, nl, p->N, len_copy) < 0) {
                rc = -1;
            }
        }
    }
    if (rc == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = cu->topk_decode(p, NULL, 0, (void *)stream);
        Py_END_ALLOW_THREADS
        if (rc)
            gvr_cuda_raise("gvr_topk_decode");
    }
    if (prev_dev >= 0 && prev_dev != in->device_id)
        cu->set_device(prev_dev, NULL); /* leave the caller's current device as it was */
    return rc ? -1 : 0;
}

PyObject *gvr_py_topk_decode(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"scores", "k", "prev_topk", "lengths", "out", "sorted", "stream", "method", "nosync",
                             "block_table", "page_size", "out_positions", "row_starts", "next_n", "max_length", NULL};
    PyObject *obj[NARGS] = {NULL, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None};
    PyObject *o_k, *o_sorted = Py_False, *o_stream = Py_None, *o_method = NULL, *o_nosync = NULL, *o_page = Py_None;
    PyObject *o_next = Py_None, *o_maxlen = Py_None;
    PyObject *result = NULL;
    int32_t *len_copy = NULL, *start_copy = NULL;
    gvr_intake in;
    gvr_intake_init(&in);
    obj[OUT] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OOOOOOOOOOOOO:topk_decode", kwlist, &obj[SCORES], &o_k, &obj[PREV],
                                     &obj[LENGTHS], &obj[OUT], &o_sorted, &o_stream, &o_method, &o_nosync, &obj[BT],
                                     &o_page, &obj[OPOS], &obj[STARTS], &o_next, &o_maxlen))
        return NULL;
    unsigned nosync;
    int method, sorted;
    intptr_t stream;
    Py_ssize_t k;
    /* scalars first: a bad one is rejected before any buffer is taken */
    if (gvr_parse_nosync(o_nosync, NARGS, &nosync) < 0 || parse_method(o_method, &method) < 0 ||
        gvr_parse_stream(o_stream, &stream) < 0 || gvr_parse_int(o_k, "k", &k) < 0 ||
        gvr_parse_bool(o_sorted, "sorted", &sorted) < 0)
        goto fail;
    if (k > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "'k' must be at most %d, got %zd", INT32_MAX, k);
        goto fail;
    }
    Py_ssize_t next_n = 1;
    if (o_next != Py_None) {
        if (gvr_parse_int(o_next, "next_n", &next_n) < 0)
            goto fail;
        if (next_n < 1 || next_n > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "'next_n' must be an int >= 1 (rows per request), got %zd", next_n);
            goto fail;
        }
    }
    Py_ssize_t max_len = 0;
    if (o_maxlen != Py_None) {
        if (gvr_parse_int(o_maxlen, "max_length", &max_len) < 0)
            goto fail;
        if (max_len < 1 || max_len > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "'max_length' must be an int >= 1 (an upper bound of the row lengths), "
                         "got %zd", max_len);
            goto fail;
        }
    }
    Py_ssize_t page = 0;
    if (obj[BT] != Py_None) {
        if (o_page == Py_None) {
            PyErr_SetString(PyExc_ValueError, "'page_size' is required with 'block_table' (tokens per page, >= 1)");
            goto fail;
        }
        if (gvr_parse_int(o_page, "page_size", &page) < 0)
            goto fail;
        if (page < 1 || page > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "'page_size' must be an int in [1, %d], got %zd", INT32_MAX, page);
            goto fail;
        }
    } else if (o_page != Py_None) {
        PyErr_SetString(PyExc_ValueError, "'page_size' applies only with 'block_table': pass block_table or leave "
                        "page_size None");
        goto fail;
    } else if (obj[OPOS] != Py_None) {
        PyErr_SetString(PyExc_ValueError, "'out_positions' applies only with 'block_table' (without it, 'out' holds "
                        "the positions)");
        goto fail;
    }
    if (gvr_intake_bind(&in, "K", k, "k") < 0 || gvr_intake_run(&in, &gvr_topk_spec, obj, stream, nosync) < 0)
        goto fail;

    const gvr_view *sc = &in.view[SCORES], *pv = &in.view[PREV], *ot = &in.view[OUT];
    const int one_d = sc->ndim == 1;
    const int64_t B = gvr_intake_dim(&in, "B"), N = gvr_intake_dim(&in, "N");
    if (N > INT32_MAX || B > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "'scores' has shape too large for int32 indices (B=%lld, N=%lld)",
                     (long long)B, (long long)N);
        goto fail;
    }
    if (B % next_n) {
        PyErr_Format(PyExc_ValueError, "'next_n' = %zd must divide the number of rows B = %lld", next_n, (long long)B);
        goto fail;
    }
    /* lengths, prev_topk, block_table: one row per row, or (next_n > 1) one per request */
    int per_request = 0;
    {
        static const struct {
            int arg;
            const char *dim;
            int flag;
        } rows[] = {{LENGTHS, "Bl", GVR_TOPK_LENGTHS_PER_REQUEST},
                    {PREV, "Bp", GVR_TOPK_PREV_PER_REQUEST},
                    {BT, "Bt", GVR_TOPK_BT_PER_REQUEST}};
        for (int i = 0; i < 3; i++) {
            const gvr_view *v = &in.view[rows[i].arg];
            if (!v->data || (rows[i].arg != LENGTHS && v->ndim < 2))
                continue;
            const int64_t r = gvr_intake_dim(&in, rows[i].dim);
            if (r == B)
                continue;
            if (next_n > 1 && r * next_n == B) {
                per_request |= rows[i].flag;
                continue;
            }
            PyErr_Format(PyExc_ValueError, "'%s' must have %lld rows (one per row)%s, got %lld",
                         gvr_topk_spec.args[rows[i].arg].name, (long long)B,
                         next_n > 1 ? " or B / next_n (one per request)" : "", (long long)r);
            goto fail;
        }
    }
    const int64_t Kp = pv->data ? gvr_intake_dim(&in, "Kp") : 0;
    if (Kp > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "'prev_topk' is too long");
        goto fail;
    }
    gvr_topk_params p = {0};
    p.scores = sc->data;
    p.score_dtype = sc->dtype == GVR_DTYPE_F16 ? GVR_TOPK_F16 : sc->dtype == GVR_DTYPE_BF16 ? GVR_TOPK_BF16 : GVR_TOPK_F32;
    p.row_stride = one_d ? N : sc->strides[0];
    p.B = (int32_t)B;
    p.N = (int32_t)N;
    p.prev = (const int32_t *)pv->data;
    p.prev_stride = pv->data && pv->ndim == 2 ? pv->strides[0] : 0; /* [Kp]: one row for every row */
    p.Kp = (int32_t)Kp;
    p.k = (int32_t)k;
    p.sorted = sorted;
    p.method = method;
    p.out = (int32_t *)ot->data;
    p.out_stride = one_d ? k : ot->strides[0];
    p.next_n = (int32_t)next_n;
    p.per_request = per_request;
    p.max_len = max_len > 0 && max_len < N ? (int32_t)max_len : 0; /* 0: no cut */
    const gvr_view *bt = &in.view[BT], *op = &in.view[OPOS];
    if (bt->data) {
        const int64_t max_pages = gvr_intake_dim(&in, "max_pages");
        if (N > max_pages * (int64_t)page) {
            PyErr_Format(PyExc_ValueError, "'block_table' must cover every score position: N = %lld > max_pages * "
                         "page_size = %lld * %zd", (long long)N, (long long)max_pages, page);
            goto fail;
        }
        p.block_table = (const int32_t *)bt->data;
        p.bt_stride = bt->ndim == 2 ? bt->strides[0] : 0; /* [max_pages]: one table for every row */
        p.page_size = (int32_t)page;
        p.out_pos = (int32_t *)op->data;
        p.out_pos_stride = op->data ? (one_d ? k : op->strides[0]) : 0;
    }
    if ((in.view[LENGTHS].data && !(len_copy = malloc((size_t)(B ? B : 1) * sizeof *len_copy))) ||
        (in.view[STARTS].data && !(start_copy = malloc((size_t)(B ? B : 1) * sizeof *start_copy)))) {
        PyErr_NoMemory();
        goto fail;
    }
    if ((in.device == GVR_DEV_CUDA ? run_cuda(&p, &in, stream, len_copy) : run_cpu(&p, &in, len_copy, start_copy)) < 0)
        goto fail;
    result = gvr_intake_object(&in, obj, OUT);
    Py_INCREF(result);
fail:
    free(len_copy);
    free(start_copy);
    gvr_intake_release(&in);
    return result;
}

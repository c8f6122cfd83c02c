/* Declarative argument intake (intake.h): one spec per operator, one function that checks it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL gvr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#define NPY_TARGET_VERSION NPY_1_23_API_VERSION
#include <numpy/arrayobject.h>

#include <ctype.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "intake.h"

/* ---- the dims language: "B,N|N;B=1" -------------------------------------------------------- */

#define MAX_FORMS 4
#define MAX_IMPLICIT 4
#define NAME_LEN 16

typedef struct {
    int n;                              /* shape entries */
    char name[GVR_VIEW_MAX_NDIM][NAME_LEN]; /* "" for a literal */
    int64_t lit[GVR_VIEW_MAX_NDIM];
    int nimp;                           /* names bound without a shape entry (after ';') */
    char imp_name[MAX_IMPLICIT][NAME_LEN];
    int64_t imp_val[MAX_IMPLICIT];
} form_t;

typedef struct {
    int nforms;
    form_t f[MAX_FORMS];
} forms_t;

static const char *skip_ws(const char *s)
{
    while (*s == ' ')
        s++;
    return s;
}

/* One token up to one of the stop characters; returns the rest. */
static const char *token(const char *s, char *out, size_t n)
{
    size_t len = 0;
    s = skip_ws(s);
    while (*s && !strchr(",|;= ", *s)) {
        if (len + 1 < n)
            out[len++] = *s;
        s++;
    }
    out[len] = 0;
    return skip_ws(s);
}

/* Specs are compiled in: a malformed one is a bug, reported as SystemError naming the spec. */
static int parse_dims(const char *dims, forms_t *fs)
{
    memset(fs, 0, sizeof *fs);
    const char *s = dims ? dims : "";
    form_t *f = &fs->f[0];
    fs->nforms = 1;
    for (;;) {
        char tok[NAME_LEN];
        s = token(s, tok, sizeof tok);
        if (tok[0]) {
            if (f->n == GVR_VIEW_MAX_NDIM)
                goto bad;
            if (isdigit((unsigned char)tok[0]))
                f->lit[f->n] = strtoll(tok, NULL, 10);
            else
                strcpy(f->name[f->n], tok);
            f->n++;
        }
        if (*s == ',') {
            s++;
        } else if (*s == '|') {
            if (fs->nforms == MAX_FORMS)
                goto bad;
            f = &fs->f[fs->nforms++];
            s++;
        } else if (*s == ';') {
            s++;
            /* implicit bindings up to the next '|' */
            for (;;) {
                char nm[NAME_LEN], val[24];
                s = token(s, nm, sizeof nm);
                if (*s != '=' || !nm[0] || f->nimp == MAX_IMPLICIT)
                    goto bad;
                s = token(s + 1, val, sizeof val);
                if (!isdigit((unsigned char)val[0]))
                    goto bad;
                strcpy(f->imp_name[f->nimp], nm);
                f->imp_val[f->nimp++] = strtoll(val, NULL, 10);
                if (*s == ',')
                    s++;
                else
                    break;
            }
            if (*s == '|') {
                if (fs->nforms == MAX_FORMS)
                    goto bad;
                f = &fs->f[fs->nforms++];
                s++;
            } else if (*s) {
                goto bad;
            } else {
                return 0;
            }
        } else if (!*s) {
            return 0;
        } else {
            goto bad;
        }
    }
bad:
    PyErr_Format(PyExc_SystemError, "gvr: malformed dims spec \"%s\"", dims);
    return -1;
}

/* ---- dimensions ------------------------------------------------------------------------------ */

void gvr_intake_init(gvr_intake *in) { memset(in, 0, sizeof *in); }

static gvr_dim *find_dim(gvr_intake *in, const char *name)
{
    for (int i = 0; i < in->ndims; i++)
        if (!strcmp(in->dim[i].name, name))
            return &in->dim[i];
    return NULL;
}

int64_t gvr_intake_dim(const gvr_intake *in, const char *dim)
{
    gvr_dim *d = find_dim((gvr_intake *)in, dim);
    return d ? d->value : -1;
}

int gvr_intake_bind(gvr_intake *in, const char *dim, int64_t value, const char *source)
{
    gvr_dim *d = find_dim(in, dim);
    if (!d) {
        if (in->ndims == GVR_INTAKE_MAX_DIMS || strlen(dim) >= NAME_LEN) {
            PyErr_Format(PyExc_SystemError, "gvr: too many dimensions in a spec (%s)", dim);
            return -1;
        }
        d = &in->dim[in->ndims++];
        strcpy(d->name, dim);
    }
    d->value = value;
    d->source = source;
    return 0;
}

/* ---- messages -------------------------------------------------------------------------------- */

typedef struct {
    char s[512];
    size_t n;
} sbuf;

static void put(sbuf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (b->n < sizeof b->s) {
        int w = vsnprintf(b->s + b->n, sizeof b->s - b->n, fmt, ap);
        if (w > 0)
            b->n += (size_t)w;
        if (b->n >= sizeof b->s)
            b->n = sizeof b->s - 1;
    }
    va_end(ap);
}

static void put_shape(sbuf *b, const gvr_view *v)
{
    put(b, "[");
    for (int i = 0; i < v->ndim && i < GVR_VIEW_MAX_NDIM; i++)
        put(b, "%s%lld", i ? ", " : "", (long long)v->shape[i]);
    put(b, "]");
}

/* the form with names ("[B, N]"), or with values where every entry is known ("[4, 10]") */
static void put_form(sbuf *b, const form_t *f, gvr_intake *in, int values)
{
    put(b, "[");
    for (int i = 0; i < f->n; i++) {
        const gvr_dim *d = f->name[i][0] ? find_dim(in, f->name[i]) : NULL;
        if (!f->name[i][0])
            put(b, "%s%lld", i ? ", " : "", (long long)f->lit[i]);
        else if (values && d)
            put(b, "%s%lld", i ? ", " : "", (long long)d->value);
        else
            put(b, "%s%s", i ? ", " : "", f->name[i]);
    }
    put(b, "]");
}

static int form_known(const form_t *f, gvr_intake *in)
{
    for (int i = 0; i < f->n; i++)
        if (f->name[i][0] && !find_dim(in, f->name[i]))
            return 0;
    return 1;
}

void gvr_device_name(gvr_device d, int id, char *buf, size_t n)
{
    if (d == GVR_DEV_CUDA)
        snprintf(buf, n, "cuda:%d", id);
    else if (d == GVR_DEV_CUDA_HOST)
        snprintf(buf, n, "pinned host memory (cuda_host)");
    else
        snprintf(buf, n, "cpu");
}

/* ---- one argument: dtype, shape, strides ------------------------------------------------------ */

static int spec_index(const gvr_spec *spec, const char *name)
{
    for (int i = 0; i < spec->nargs; i++)
        if (!strcmp(spec->args[i].name, name))
            return i;
    return -1;
}

static int check_dtype(const gvr_spec *spec, const gvr_arg_spec *a, gvr_intake *in, const gvr_view *v)
{
    if (a->same_dtype) {
        int j = spec_index(spec, a->same_dtype);
        if (j >= 0 && in->given[j] && v->dtype != in->view[j].dtype) {
            PyErr_Format(PyExc_TypeError, "'%s' must be %s like '%s', got %s", a->name,
                         in->view[j].dtype_str, a->same_dtype, v->dtype_str);
            return -1;
        }
    }
    if (v->dtype != GVR_DTYPE_OTHER && (a->dtypes & GVR_DT(v->dtype)))
        return 0;
    sbuf b = {{0}, 0};
    int count = 0, total = 0;
    for (int d = 1; d < GVR_DTYPE_COUNT; d++)
        total += (a->dtypes & GVR_DT(d)) != 0;
    for (int d = 1; d < GVR_DTYPE_COUNT; d++)
        if (a->dtypes & GVR_DT(d)) {
            count++;
            put(&b, "%s%s", count == 1 ? "" : count == total ? " or " : ", ", gvr_dtype_str((gvr_dtype)d));
        }
    PyErr_Format(PyExc_TypeError, "'%s' must be %s, got %s", a->name, b.s, v->dtype_str);
    return -1;
}

/* A named dimension of value `value` met in argument `source`: bound if new, else compared; a
 * mismatch sets *bad and appends "D = 128 (from 'q')" to *why. -1 only when binding fails. */
static int tie_dim(gvr_intake *in, const char *name, int64_t value, const char *source, sbuf *why, int *bad)
{
    gvr_dim *d = find_dim(in, name);
    if (!d)
        return gvr_intake_bind(in, name, value, source) < 0 ? -1 : 0;
    if (d->value != value) {
        if (why)
            put(why, "%s%s = %lld (from '%s')", *bad ? ", " : "", d->name, (long long)d->value, d->source);
        *bad = 1;
    }
    return 0;
}

/* Values a form requires of v, binding its unbound names; 0 = fits. On a mismatch *why lists the
 * entries that did not match ("D = 128 (from 'q')"). */
static int fit_form(const gvr_arg_spec *a, const form_t *f, gvr_intake *in, const gvr_view *v, sbuf *why,
                    int bind)
{
    int bad = 0;
    int first_new = in->ndims;
    for (int i = 0; i < f->n; i++) {
        if (!f->name[i][0]) {
            if (v->shape[i] != f->lit[i])
                bad = 1;
            continue;
        }
        if (tie_dim(in, f->name[i], v->shape[i], a->name, why, &bad) < 0)
            return -1;
    }
    for (int i = 0; i < f->nimp; i++) {
        if (tie_dim(in, f->imp_name[i], f->imp_val[i], a->name, why, &bad) < 0)
            return -1;
    }
    if (bad || !bind)
        in->ndims = first_new; /* forget what this form bound */
    return bad;
}

static int check_shape(const gvr_spec *spec, const gvr_arg_spec *a, int ai, gvr_intake *in, const gvr_view *v)
{
    forms_t fs;
    if (parse_dims(a->dims, &fs) < 0)
        return -1;
    int forced = -1;
    if (a->form_of) {
        int j = spec_index(spec, a->form_of);
        if (j >= 0 && in->given[j])
            forced = in->form[j];
    }
    int first = -1; /* the first form of the right ndim */
    for (int k = 0; k < fs.nforms; k++) {
        if (forced >= 0 && k != forced)
            continue;
        if (fs.f[k].n != v->ndim)
            continue;
        if (first < 0)
            first = k;
        int r = fit_form(a, &fs.f[k], in, v, NULL, 0);
        if (r < 0)
            return -1;
        if (r == 0) {
            if (fit_form(a, &fs.f[k], in, v, NULL, 1) < 0)
                return -1;
            in->form[ai] = k;
            return 0;
        }
    }
    sbuf b = {{0}, 0}, why = {{0}, 0};
    put(&b, "'%s' must have shape ", a->name);
    if (first >= 0) {
        const form_t *f = &fs.f[first];
        if (fit_form(a, f, in, v, &why, 0) < 0)
            return -1;
        if (form_known(f, in)) {
            put_form(&b, f, in, 1);
            put(&b, ", got ");
            put_shape(&b, v);
            if (why.n)
                put(&b, ": %s", why.s);
        } else {
            put_form(&b, f, in, 0);
            if (why.n)
                put(&b, " with %s", why.s);
            put(&b, ", got ");
            put_shape(&b, v);
        }
    } else {
        /* no form of this ndim: list the forms (values where all are known), and the known dimensions */
        int listed = 0, named = 0;
        for (int k = 0; k < fs.nforms; k++) {
            if (forced >= 0 && k != forced)
                continue;
            if (listed++)
                put(&b, " or ");
            const int known = form_known(&fs.f[k], in);
            named |= !known;
            put_form(&b, &fs.f[k], in, known);
        }
        if (forced >= 0) {
            forms_t ref;
            const int j = spec_index(spec, a->form_of);
            if (parse_dims(spec->args[j].dims, &ref) < 0)
                return -1;
            put(&b, " (as '%s' has shape ", a->form_of);
            put_form(&b, &ref.f[forced], in, 0);
            put(&b, ")");
        }
        sbuf with = {{0}, 0};
        const gvr_dim *seen[MAX_FORMS * GVR_VIEW_MAX_NDIM];
        int nseen = 0;
        for (int k = 0; k < fs.nforms; k++)
            for (int i = 0; i < fs.f[k].n; i++) {
                if (forced >= 0 && k != forced)
                    continue;
                const gvr_dim *d = fs.f[k].name[i][0] ? find_dim(in, fs.f[k].name[i]) : NULL;
                int dup = 0;
                for (int m = 0; m < nseen; m++)
                    dup |= seen[m] == d;
                if (d && !dup) {
                    seen[nseen++] = d;
                    put(&with, "%s%s = %lld (from '%s')", with.n ? ", " : "", d->name, (long long)d->value,
                        d->source);
                }
            }
        if (named && with.n)
            put(&b, " with %s", with.s);
        if (v->ndim > GVR_VIEW_MAX_NDIM)
            put(&b, ", got %d dimensions", v->ndim);
        else {
            put(&b, ", got ");
            put_shape(&b, v);
        }
        if (!named && with.n)
            put(&b, ": %s", with.s);
    }
    PyErr_SetString(PyExc_ValueError, b.s);
    return -1;
}

static int has_no_elements(const gvr_view *v)
{
    for (int i = 0; i < v->ndim; i++)
        if (v->shape[i] == 0)
            return 1;
    return 0;
}

static int check_unit_last(const gvr_arg_spec *a, const gvr_view *v)
{
    if (has_no_elements(v))
        return 0; /* no elements: strides are meaningless */
    if (v->ndim >= 1 && v->shape[v->ndim - 1] > 1 && v->strides[v->ndim - 1] != 1) {
        PyErr_Format(PyExc_ValueError, "'%s' must have unit stride along its last dimension, got stride %lld",
                     a->name, (long long)v->strides[v->ndim - 1]);
        return -1;
    }
    return 0;
}

static int check_contiguous(const gvr_arg_spec *a, const gvr_view *v)
{
    if (has_no_elements(v))
        return 0;
    int64_t want = 1;
    for (int i = v->ndim - 1; i >= 0; i--) {
        if (v->shape[i] > 1 && v->strides[i] != want) {
            PyErr_Format(PyExc_ValueError, "'%s' on a CUDA device must be contiguous, got strides %lld along "
                         "dimension %d of %d", a->name, (long long)v->strides[i], i, v->ndim);
            return -1;
        }
        want *= v->shape[i];
    }
    return 0;
}

/* ---- devices ---------------------------------------------------------------------------------- */

static int check_role(const gvr_spec *spec, const gvr_arg_spec *a, const gvr_intake *in, const gvr_view *v,
                      int anchor)
{
    char got[64], call[64];
    gvr_device_name(v->device, v->device_id, got, sizeof got);
    gvr_device_name(in->device, in->device_id, call, sizeof call);
    const int pinned_only = a->roles == GVR_PINNED;
    if (pinned_only && v->device != GVR_DEV_CUDA_HOST) {
        PyErr_Format(PyExc_ValueError, "'%s' must be in pinned host memory (DLPack kDLCUDAHost, read by the "
                     "device), got %s", a->name, got);
        return -1;
    }
    if (in->device == GVR_DEV_CUDA) {
        if (v->device == GVR_DEV_CUDA && v->device_id == in->device_id && (a->roles & GVR_DEVICE))
            return 0;
        if (v->device == GVR_DEV_CUDA_HOST && (a->roles & GVR_PINNED))
            return 0;
        if (!(a->roles & (GVR_DEVICE | GVR_PINNED))) {
            PyErr_Format(PyExc_ValueError, "'%s' must be in host memory, got %s", a->name, got);
            return -1;
        }
        sbuf takes = {{0}, 0};
        if (a->roles & GVR_DEVICE)
            put(&takes, "%s memory", call);
        if (a->roles & GVR_PINNED)
            put(&takes, "%spinned host memory", takes.n ? " or " : "");
        PyErr_Format(PyExc_ValueError, "mixed devices: '%s' is on %s but '%s' is %s%s; '%s' takes %s",
                     spec->args[anchor].name, call, a->name, v->device == GVR_DEV_CUDA_HOST ? "in " : "on ", got,
                     a->name, takes.s);
        return -1;
    }
    /* host call */
    if (v->device == GVR_DEV_CPU && (a->roles & GVR_HOST))
        return 0;
    if (v->device == GVR_DEV_CUDA_HOST && (a->roles & (GVR_HOST | GVR_PINNED)))
        return 0;
    if (a->roles & GVR_DEVICE)
        PyErr_Format(PyExc_ValueError, "'%s' must be on a CUDA device, got %s", a->name, got);
    else
        PyErr_Format(PyExc_ValueError, "'%s' must be in host memory, got %s", a->name, got);
    return -1;
}

int gvr_view_extent(const gvr_view *v, uintptr_t *lo, uintptr_t *hi)
{
    uintptr_t a = (uintptr_t)v->data, b = (uintptr_t)v->data;
    const int64_t size = v->itemsize ? v->itemsize : 1;
    for (int i = 0; i < v->ndim && i < GVR_VIEW_MAX_NDIM; i++) {
        if (v->shape[i] == 0)
            return 0;
        int64_t span = (v->shape[i] - 1) * v->strides[i] * size;
        if (span < 0)
            a += (uintptr_t)span;
        else
            b += (uintptr_t)span;
    }
    *lo = a;
    *hi = b + (uintptr_t)size;
    return 1;
}

/* whether two elements of v may share bytes (a stride 0 over a dimension of 2 or more, say): each
 * dimension's stride, in increasing order, must step past everything the smaller ones span --
 * sufficient, and what every dense or sliced layout satisfies */
static int view_self_overlaps(const gvr_view *v)
{
    int64_t st[GVR_VIEW_MAX_NDIM], sh[GVR_VIEW_MAX_NDIM];
    int n = 0;
    const int64_t size = v->itemsize ? v->itemsize : 1;
    for (int i = 0; i < v->ndim && i < GVR_VIEW_MAX_NDIM; i++) {
        if (v->shape[i] == 0)
            return 0;
        if (v->shape[i] == 1)
            continue;
        const int64_t s = v->strides[i] < 0 ? -v->strides[i] : v->strides[i];
        int j = n++;
        for (; j > 0 && st[j - 1] > s; j--) {
            st[j] = st[j - 1];
            sh[j] = sh[j - 1];
        }
        st[j] = s;
        sh[j] = v->shape[i];
    }
    int64_t span = size; /* bytes covered by the dimensions so far */
    for (int i = 0; i < n; i++) {
        if (st[i] * size < span)
            return 1;
        span = st[i] * size * (sh[i] - 1) + span;
    }
    return 0;
}

int gvr_views_overlap(const gvr_view *a, const gvr_view *b)
{
    /* cpu and pinned host memory share one address space; each CUDA device has its own */
    const int ha = a->device != GVR_DEV_CUDA, hb = b->device != GVR_DEV_CUDA;
    if (!a->data || !b->data || ha != hb || (!ha && a->device_id != b->device_id))
        return 0;
    uintptr_t alo, ahi, blo, bhi;
    if (!gvr_view_extent(a, &alo, &ahi) || !gvr_view_extent(b, &blo, &bhi))
        return 0;
    return alo < bhi && blo < ahi;
}

/* ---- the whole spec ---------------------------------------------------------------------------- */

static int allocate(const gvr_spec *spec, const gvr_arg_spec *a, int ai, gvr_intake *in)
{
    forms_t fs;
    if (parse_dims(a->dims, &fs) < 0)
        return -1;
    int k = 0;
    if (a->form_of) {
        int j = spec_index(spec, a->form_of);
        k = j >= 0 && in->given[j] ? in->form[j] : 0;
    }
    const form_t *f = &fs.f[k];
    npy_intp shape[GVR_VIEW_MAX_NDIM];
    for (int i = 0; i < f->n; i++) {
        const gvr_dim *d = f->name[i][0] ? find_dim(in, f->name[i]) : NULL;
        if (f->name[i][0] && !d) {
            PyErr_Format(PyExc_SystemError, "gvr: '%s' cannot be allocated: %s is unknown", a->name, f->name[i]);
            return -1;
        }
        const int64_t n = d ? d->value : f->lit[i];
        if (n > INT32_MAX) { /* every operator indexes with int32: refused before any allocation */
            PyErr_Format(PyExc_ValueError, "'%s' would have %s = %lld along one dimension, more than int32 indices "
                         "address (%d)", a->name, f->name[i][0] ? f->name[i] : "a size", (long long)n, INT32_MAX);
            return -1;
        }
        shape[i] = (npy_intp)n;
    }
    int type = NPY_FLOAT32;
    for (int d = 1; d < GVR_DTYPE_COUNT; d++)
        if (a->dtypes & GVR_DT(d)) {
            const int types[GVR_DTYPE_COUNT] = {0, NPY_FLOAT32, NPY_FLOAT16, -1, NPY_INT32, NPY_INT64, NPY_UINT8, -1};
            type = types[d];
            break;
        }
    if (type < 0) {
        PyErr_Format(PyExc_SystemError, "gvr: '%s' cannot be allocated in NumPy", a->name);
        return -1;
    }
    in->allocated[ai] = PyArray_SimpleNew(f->n, shape, type);
    if (!in->allocated[ai])
        return -1;
    in->form[ai] = k;
    if (gvr_view_get(in->allocated[ai], a->name, 1, 0, &in->view[ai]) < 0)
        return -1;
    in->given[ai] = 1;
    return 0;
}

int gvr_intake_run(gvr_intake *in, const gvr_spec *spec, PyObject *const *objs, intptr_t stream,
                   unsigned nosync)
{
    if (spec->nargs > GVR_INTAKE_MAX_ARGS) {
        PyErr_SetString(PyExc_SystemError, "gvr: a spec with too many arguments");
        return -1;
    }
    /* 1. each argument on its own: its buffer, dtype, shape, unit stride */
    for (int i = 0; i < spec->nargs; i++) {
        const gvr_arg_spec *a = &spec->args[i];
        PyObject *o = objs[i];
        if (!o || o == Py_None) {
            if (!(a->flags & (GVR_OPTIONAL | GVR_ALLOC))) {
                PyErr_Format(PyExc_TypeError, "'%s' is required", a->name);
                return -1;
            }
            continue;
        }
        gvr_view *v = &in->view[i];
        const intptr_t s = (nosync >> i) & 1 ? GVR_STREAM_PRODUCER_CURRENT : stream;
        if (gvr_view_get(o, a->name, (a->flags & GVR_OUTPUT) != 0, s, v) < 0)
            return -1;
        in->given[i] = 1;
        if (check_dtype(spec, a, in, v) < 0 || check_shape(spec, a, i, in, v) < 0)
            return -1;
        if ((a->flags & GVR_UNIT_LAST) && check_unit_last(a, v) < 0)
            return -1;
    }
    /* 2. the call's device: that of the first CUDA buffer, else the host; each argument's role */
    int anchor = -1;
    in->device = GVR_DEV_CPU;
    in->device_id = 0;
    for (int i = 0; i < spec->nargs && anchor < 0; i++)
        if (in->given[i] && in->view[i].device == GVR_DEV_CUDA && (spec->args[i].roles & GVR_DEVICE)) {
            anchor = i;
            in->device = GVR_DEV_CUDA;
            in->device_id = in->view[i].device_id;
        }
    for (int i = 0; i < spec->nargs; i++) {
        if (!in->given[i])
            continue;
        const gvr_arg_spec *a = &spec->args[i];
        if (check_role(spec, a, in, &in->view[i], anchor) < 0)
            return -1;
        if ((a->flags & GVR_CONTIGUOUS_ON_DEVICE) && in->view[i].device == GVR_DEV_CUDA &&
            check_contiguous(a, &in->view[i]) < 0)
            return -1;
    }
    /* 3. outputs: allocated when not given (host calls), then no overlap with anything else */
    for (int i = 0; i < spec->nargs; i++) {
        const gvr_arg_spec *a = &spec->args[i];
        if (in->given[i] || !(a->flags & GVR_ALLOC))
            continue;
        if (in->device == GVR_DEV_CUDA) {
            PyErr_Format(PyExc_TypeError, "'%s' must be given for CUDA inputs other than torch tensors and CuPy "
                         "arrays", a->name);
            return -1;
        }
        if (allocate(spec, a, i, in) < 0)
            return -1;
    }
    for (int i = 0; i < spec->nargs; i++) {
        if (!in->given[i] || !(spec->args[i].flags & GVR_OUTPUT) || in->allocated[i])
            continue;
        if (view_self_overlaps(&in->view[i])) {
            char buf[24 * GVR_VIEW_MAX_NDIM + 4];
            int at = 0;
            for (int d = 0; d < in->view[i].ndim && d < GVR_VIEW_MAX_NDIM; d++)
                at += snprintf(buf + at, sizeof buf - (size_t)at, "%s%lld", d ? ", " : "",
                               (long long)in->view[i].strides[d]);
            PyErr_Format(PyExc_ValueError, "'%s' is an output whose elements may overlap each other (strides (%s) "
                         "in elements: a stride 0, or strides that interleave); pass a dense or sliced array",
                         spec->args[i].name, buf);
            return -1;
        }
        for (int j = 0; j < spec->nargs; j++)
            if (j != i && in->given[j] && gvr_views_overlap(&in->view[i], &in->view[j])) {
                PyErr_Format(PyExc_ValueError, "'%s' must not overlap '%s'", spec->args[i].name,
                             spec->args[j].name);
                return -1;
            }
    }
    return 0;
}

void gvr_intake_release(gvr_intake *in)
{
    for (int i = 0; i < GVR_INTAKE_MAX_ARGS; i++) {
        gvr_view_release(&in->view[i]);
        Py_CLEAR(in->allocated[i]);
    }
}

PyObject *gvr_intake_object(const gvr_intake *in, PyObject *const *objs, int i)
{
    return in->allocated[i] ? in->allocated[i] : objs[i];
}

/* ---- scalar arguments ------------------------------------------------------------------------- */

int gvr_parse_int(PyObject *o, const char *name, Py_ssize_t *val)
{
    if (PyBool_Check(o) || !PyIndex_Check(o)) {
        PyErr_Format(PyExc_TypeError, "'%s' must be an int, got %s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    *val = PyNumber_AsSsize_t(o, PyExc_OverflowError);
    if (*val == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "'%s' is out of range", name);
        return -1;
    }
    if (*val < 0) {
        PyErr_Format(PyExc_ValueError, "'%s' must not be negative, got %zd", name, *val);
        return -1;
    }
    return 0;
}

int gvr_parse_bool(PyObject *o, const char *name, int *val)
{
    /* Python bool or numpy.bool_ (which is not a bool subclass): a string or an int is a mistake */
    if (!PyBool_Check(o) && !PyObject_TypeCheck(o, &PyBoolArrType_Type)) {
        PyErr_Format(PyExc_TypeError, "'%s' must be a bool, got %s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    *val = PyObject_IsTrue(o);
    return *val < 0 ? -1 : 0;
}

int gvr_parse_stream(PyObject *o, intptr_t *stream)
{
    *stream = 0;
    if (!o || o == Py_None)
        return 0;
    Py_ssize_t s = PyNumber_AsSsize_t(o, NULL);
    if (s == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        void *p = PyLong_Check(o) ? PyLong_AsVoidPtr(o) : NULL;
        if (!p || PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "'stream' must be an int (a cudaStream_t handle) or None, got %s",
                         Py_TYPE(o)->tp_name);
            return -1;
        }
        *stream = (intptr_t)p;
    } else {
        *stream = (intptr_t)s;
    }
    if (*stream < 0) {
        PyErr_Format(PyExc_ValueError, "'stream' must be a CUDA stream handle (an int >= 0) or None, got %lld",
                     (long long)*stream);
        return -1;
    }
    return 0;
}

int gvr_parse_nosync(PyObject *o, int nargs, unsigned *nosync)
{
    *nosync = 0;
    if (!o || o == Py_None)
        return 0;
    const long max = (1L << nargs) - 1;
    long v = PyLong_Check(o) && !PyBool_Check(o) ? PyLong_AsLong(o) : -1;
    if (v == -1 && PyErr_Occurred())
        PyErr_Clear();
    if (v < 0 || v > max) {
        PyErr_Format(PyExc_ValueError, "'nosync' must be an int bitmask in [0, %ld] (bit i: argument i is on its "
                     "producer's current stream)", max);
        return -1;
    }
    *nosync = (unsigned)v;
    return 0;
}

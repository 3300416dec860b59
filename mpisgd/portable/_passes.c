/* The portable level's memory-bound passes, each in one trip through memory (mpisgd.portable.passes).

   Every value is the one NumPy's ufuncs give for the same operations: IEEE float32 or float64 additions
   and multiplications, each rounded to nearest, in the order of mpisgd.portable.reduce's fixed tree. The
   file must be compiled without contraction into fused multiply-adds and without reassociation
   (setup.py: -ffp-contract=off, no -ffast-math); tests/test_portable_passes.py compares every function
   with its NumPy form bit for bit.

   Arrays arrive through the buffer protocol (_arrays.h): up to 4 dimensions, any strides (a multiple of
   the item size), 0 for a broadcast axis. */
#include "_arrays.h"
#include "_ieee.h"
#include <stdlib.h>
#include <math.h>
#include <string.h>

/* out = (x + c) - c in float64: with c = 1.5 2^52 / s, x rounded to the nearest multiple of 1/s
   (mpisgd.portable.gemm.on_grid). */
#define ON_GRID_ROWS(T)                                                                             \
    FOR_ROWS(n) {                                                                                   \
        const T *xr = ROW(const T, x);                                                              \
        const double *cr = ROW(const double, c);                                                    \
        double *orow = ROW(double, o);                                                              \
        Py_ssize_t len = n[3], sx = x.step[3], sc = c.step[3], so = o.step[3];                      \
        if (sx == 1 && so == 1 && sc == 0) {                                                        \
            const double k = cr[0];                                                                 \
            for (Py_ssize_t j = 0; j < len; j++) {                                                  \
                double v = (double)xr[j] + k;                                                       \
                orow[j] = v - k;                                                                    \
            }                                                                                       \
        } else if (sx == 1 && so == 1 && sc == 1) {                                                 \
            for (Py_ssize_t j = 0; j < len; j++) {                                                  \
                double v = (double)xr[j] + cr[j];                                                   \
                orow[j] = v - cr[j];                                                                \
            }                                                                                       \
        } else {                                                                                    \
            for (Py_ssize_t j = 0; j < len; j++) {                                                  \
                double k = cr[j * sc];                                                              \
                double v = (double)xr[j * sx] + k;                                                  \
                orow[j * so] = v - k;                                                               \
            }                                                                                       \
        }                                                                                           \
    }

static PyObject *on_grid(PyObject *self, PyObject *args) {
    PyObject *ox, *oc, *oo;
    Arr x, c, o;
    if (!PyArg_ParseTuple(args, "OOO", &ox, &oc, &oo)) return NULL;
    if (take(ox, &x, 0, "on_grid x") < 0) return NULL;
    if (take(oc, &c, 0, "on_grid c") < 0) { release(&x); return NULL; }
    if (take(oo, &o, 1, "on_grid out") < 0) { release(&x); release(&c); return NULL; }
    if (c.kind != 'd' || o.kind != 'd' || !same_shape(&x, &o) || !same_shape(&c, &o)) {
        PyErr_SetString(PyExc_ValueError, "on_grid: x, c (float64, broadcast) and out (float64) of one shape");
        release(&x); release(&c); release(&o);
        return NULL;
    }
    const Py_ssize_t *n = o.shape;
    BY_FLOAT(x, ON_GRID_ROWS)
    release(&x); release(&c); release(&o);
    Py_RETURN_NONE;
}

/* q = rint(x s) and, where rest is given, rest = x s - q (exact): the integers of a split's float64 slice
   (mpisgd.portable.passes.UfuncPasses.integers), x s rounded once as NumPy's multiply rounds it. */
#define INTEGERS_ROWS(T)                                                                            \
    FOR_ROWS(n) {                                                                                   \
        const T *xr = ROW(const T, x);                                                              \
        const double *sr = ROW(const double, s);                                                    \
        double *qr = ROW(double, q);                                                                \
        double *rr = has_rest ? ROW(double, r) : NULL;                                              \
        Py_ssize_t len = n[3], sx = x.step[3], ss = s.step[3], sq = q.step[3];                      \
        if (!has_rest && sx == 1 && sq == 1 && ss == 0) {                                           \
            const double k = sr[0];                                                                 \
            for (Py_ssize_t j = 0; j < len; j++) qr[j] = round_even((double)xr[j] * k);             \
        } else if (!has_rest && sx == 1 && sq == 1 && ss == 1) {                                    \
            for (Py_ssize_t j = 0; j < len; j++) qr[j] = round_even((double)xr[j] * sr[j]);         \
        } else {                                                                                    \
            Py_ssize_t sr_ = has_rest ? r.step[3] : 0;                                              \
            for (Py_ssize_t j = 0; j < len; j++) {                                                  \
                double v = (double)xr[j * sx] * sr[j * ss];                                         \
                double i = round_even(v);                                                           \
                qr[j * sq] = i;                                                                     \
                if (has_rest) rr[j * sr_] = v - i;                                                  \
            }                                                                                       \
        }                                                                                           \
    }

static PyObject *integers(PyObject *self, PyObject *args) {
    PyObject *ox, *os, *oq, *orest;
    Arr x, s, q, r;
    if (!PyArg_ParseTuple(args, "OOOO", &ox, &os, &oq, &orest)) return NULL;
    int has_rest = orest != Py_None;
    r.held = 0;
    if (take(ox, &x, 0, "integers x") < 0) return NULL;
    if (take(os, &s, 0, "integers s") < 0) { release(&x); return NULL; }
    if (take(oq, &q, 1, "integers q") < 0) { release(&x); release(&s); return NULL; }
    if (has_rest && take(orest, &r, 1, "integers rest") < 0) { release(&x); release(&s); release(&q); return NULL; }
    if (s.kind != 'd' || q.kind != 'd' || !same_shape(&x, &q) || !same_shape(&s, &q) ||
        (has_rest && (r.kind != 'd' || !same_shape(&r, &q)))) {
        PyErr_SetString(PyExc_ValueError,
                        "integers: x, s (float64, broadcast), q and rest (float64, or None) of one shape");
        release(&x); release(&s); release(&q); release(&r);
        return NULL;
    }
    const Py_ssize_t *n = q.shape;
    BY_FLOAT(x, INTEGERS_ROWS)
    release(&x); release(&s); release(&q); release(&r);
    Py_RETURN_NONE;
}

/* The fixed tree of mpisgd.portable.reduce.fold_ over buf[0..n): the last n/2 terms onto the first, until one.
   SQUARES(T, S) defines fold_S, squares_last_S and squares_rows_S for items of type T (float32 or float64:
   squares and sums in x's own type, as UfuncPasses.squares makes them in its work array's). */
#define SQUARES(T, S)                                                                                       \
static T fold_##S(T *buf, Py_ssize_t n) {                                                                   \
    while (n > 1) {                                                                                         \
        Py_ssize_t half = n / 2, from = n - half;                                                           \
        for (Py_ssize_t i = 0; i < half; i++) buf[i] += buf[from + i];                                      \
        n = from;                                                                                           \
    }                                                                                                       \
    return buf[0];                                                                                          \
}                                                                                                           \
                                                                                                            \
/* Sums of squares of x along its last axis, each the fold of `terms` squares (the rest of them, past x's   \
   length, zero): out[..] has x's shape without the last axis. */                                           \
static void squares_last_##S(const Arr *x, const Arr *o, Py_ssize_t terms, T *buf) {                        \
    FOR_ROWS(x->shape) {                                                                                    \
        const T *xr = ROW(const T, *x);                                                                     \
        Py_ssize_t len = x->shape[3], sx = x->step[3];                                                      \
        if (sx == 1)                                                                                        \
            for (Py_ssize_t j = 0; j < len; j++) buf[j] = xr[j] * xr[j];                                    \
        else                                                                                                \
            for (Py_ssize_t j = 0; j < len; j++) buf[j] = xr[j * sx] * xr[j * sx];                          \
        for (Py_ssize_t j = len; j < terms; j++) buf[j] = 0;                                                \
        /* out has one axis fewer: its steps are o->step[1..3] for x's axes 0..2 */                         \
        T *dst = (T *)o->view.buf + i0 * o->step[1] + i1 * o->step[2] + i2 * o->step[3];                    \
        *dst = fold_##S(buf, terms);                                                                        \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
/* Sums of squares of x along its second-last axis (a column's terms), the fold of `terms` rows (the rest   \
   zero) made a row at a time, every column at once: the same additions as fold_ along that axis. buf holds \
   ceil(terms / 2) rows of x's last axis. */                                                                \
static void squares_rows_##S(const Arr *x, const Arr *o, Py_ssize_t terms, T *buf) {                        \
    Py_ssize_t rows = x->shape[2], cols = x->shape[3], sx = x->step[3];                                     \
    Py_ssize_t half = terms / 2, from = terms - half;                                                       \
    for (Py_ssize_t i0 = 0; i0 < x->shape[0]; i0++)                                                         \
        for (Py_ssize_t i1 = 0; i1 < x->shape[1]; i1++) {                                                   \
            const T *xm = (const T *)x->view.buf + i0 * x->step[0] + i1 * x->step[1];                       \
            for (Py_ssize_t i = 0; i < from; i++) {  /* the tree's first level, straight from x */          \
        T *b = buf + i * cols;                                                                              \
        const T *lo = xm + i * x->step[2];                                                                  \
        if (i >= rows) {                                                                                    \
            memset(b, 0, (size_t)cols * sizeof(T));                                                         \
            continue;                                                                                       \
        }                                                                                                   \
        if (i < half && from + i < rows) {  /* two rows: the squares added */                               \
            const T *hi = xm + (from + i) * x->step[2];                                                     \
            if (sx == 1)                                                                                    \
                for (Py_ssize_t j = 0; j < cols; j++) {                                                     \
                    T a = lo[j] * lo[j], c = hi[j] * hi[j];                                                 \
                    b[j] = a + c;                                                                           \
                }                                                                                           \
            else                                                                                            \
                for (Py_ssize_t j = 0; j < cols; j++) {                                                     \
                    T a = lo[j * sx] * lo[j * sx], c = hi[j * sx] * hi[j * sx];                             \
                    b[j] = a + c;                                                                           \
                }                                                                                           \
        } else if (sx == 1) {  /* one row (its partner is padding, or the middle term waits) */             \
            for (Py_ssize_t j = 0; j < cols; j++) b[j] = lo[j] * lo[j];                                     \
        } else {                                                                                            \
            for (Py_ssize_t j = 0; j < cols; j++) b[j] = lo[j * sx] * lo[j * sx];                           \
        }                                                                                                   \
            }                                                                                               \
            Py_ssize_t n = from;                                                                            \
            while (n > 1) {                                                                                 \
        Py_ssize_t h = n / 2, f = n - h;                                                                    \
        for (Py_ssize_t i = 0; i < h; i++) {                                                                \
            T *d = buf + i * cols;                                                                          \
            const T *s = buf + (f + i) * cols;                                                              \
            for (Py_ssize_t j = 0; j < cols; j++) d[j] += s[j];                                             \
        }                                                                                                   \
        n = f;                                                                                              \
            }                                                                                               \
            T *dst = (T *)o->view.buf + i0 * o->step[1] + i1 * o->step[2];                                  \
            for (Py_ssize_t j = 0; j < cols; j++) dst[j * o->step[3]] = buf[j];                             \
        }                                                                                                   \
    }

SQUARES(float, f)
SQUARES(double, d)

static PyObject *sum_squares(PyObject *self, PyObject *args) {
    PyObject *ox, *oo;
    Py_ssize_t terms;
    int axis;
    Arr x, o;
    if (!PyArg_ParseTuple(args, "OOni", &ox, &oo, &terms, &axis)) return NULL;
    if (take(ox, &x, 0, "sum_squares x") < 0) return NULL;
    if (take(oo, &o, 1, "sum_squares out") < 0) { release(&x); return NULL; }
    int nd = x.view.ndim, ok = x.kind == o.kind && nd >= 1 && o.view.ndim == nd - 1 &&
                               (axis == -1 || (axis == -2 && nd >= 2));
    int red = MAXDIM + axis;  /* the summed axis, in the padded shape */
    for (int i = 0, k = 1; ok && i < MAXDIM; i++) {  /* out: x's padded shape without that axis */
        if (i == red) continue;
        ok = o.shape[k++] == x.shape[i];
    }
    Py_ssize_t len = x.shape[red];
    if (!ok || terms < len || terms < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "sum_squares: x and out of one dtype, out of x's shape without the axis (-1 or -2), "
                        "terms >= its length");
        release(&x); release(&o);
        return NULL;
    }
    Py_ssize_t width = axis == -1 ? terms : (terms - terms / 2) * x.shape[3];
    void *buf = malloc((size_t)(width > 0 ? width : 1) * (size_t)x.view.itemsize);
    if (!buf) { release(&x); release(&o); return PyErr_NoMemory(); }
    Py_BEGIN_ALLOW_THREADS
    if (x.kind == 'f') {
        if (axis == -1) squares_last_f(&x, &o, terms, buf);
        else squares_rows_f(&x, &o, terms, buf);
    } else {
        if (axis == -1) squares_last_d(&x, &o, terms, buf);
        else squares_rows_d(&x, &o, terms, buf);
    }
    Py_END_ALLOW_THREADS
    free(buf);
    release(&x); release(&o);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"on_grid", on_grid, METH_VARARGS,
     "on_grid(x, c, out): out = (x + c) - c in float64 (x float32 or float64; c float64, broadcast to out)"},
    {"sum_squares", sum_squares, METH_VARARGS,
     "sum_squares(x, out, terms, axis): the fixed-tree sums of terms squares of x (float32 or float64, out's dtype "
     "too) along axis -1 or -2"},
    {"integers", integers, METH_VARARGS,
     "integers(x, s, q, rest): q = rint(x s) in float64 (x float32 or float64; s float64, broadcast to q); "
     "rest (float64, or None) = x s - q"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_passes", NULL, -1, methods};

PyMODINIT_FUNC PyInit__passes(void) { return PyModule_Create(&module); }

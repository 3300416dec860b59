/* Arrays through the buffer protocol, for mpisgd's C passes and functions (_passes.c, _functions.c): float32
   or float64, native byte order, up to MAXDIM dimensions (padded in front with 1), any strides that are
   whole items (0 for a broadcast axis). */
#ifndef MPISGD_ARRAYS_H
#define MPISGD_ARRAYS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAXDIM 4

typedef struct {
    Py_buffer view;
    Py_ssize_t shape[MAXDIM];  /* padded in front with 1 */
    Py_ssize_t step[MAXDIM];   /* strides in items, padded in front with 0 */
    char kind;                 /* 'f' or 'd' */
    int held;
} Arr;

static void release(Arr *a) {
    if (a->held) PyBuffer_Release(&a->view);
    a->held = 0;
}

/* A float32 or float64 array of at most MAXDIM dimensions, native byte order, whose strides are whole items. */
static int take(PyObject *obj, Arr *a, int writable, const char *name) {
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    a->held = 0;
    if (PyObject_GetBuffer(obj, &a->view, flags) < 0) return -1;
    a->held = 1;
    const char *f = a->view.format ? a->view.format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    if ((*f != 'f' && *f != 'd') || f[1] != '\0' || a->view.ndim > MAXDIM) {
        PyErr_Format(PyExc_TypeError, "%s: a float32 or float64 array of at most %d dimensions", name, MAXDIM);
        release(a);
        return -1;
    }
    a->kind = *f;
    int pad = MAXDIM - a->view.ndim;
    for (int i = 0; i < MAXDIM; i++) {
        if (i < pad) {
            a->shape[i] = 1;
            a->step[i] = 0;
            continue;
        }
        Py_ssize_t s = a->view.strides[i - pad];
        if (s % a->view.itemsize != 0) {
            PyErr_Format(PyExc_ValueError, "%s: strides must be whole items", name);
            release(a);
            return -1;
        }
        a->shape[i] = a->view.shape[i - pad];
        a->step[i] = s / a->view.itemsize;
    }
    return 0;
}

static int same_shape(const Arr *a, const Arr *b) {
    for (int i = 0; i < MAXDIM; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

/* Every row of a padded 4-D shape n (its last axis is the row): i0, i1, i2 over the first three axes. */
#define FOR_ROWS(n)                                      \
    for (Py_ssize_t i0 = 0; i0 < (n)[0]; i0++)           \
        for (Py_ssize_t i1 = 0; i1 < (n)[1]; i1++)       \
            for (Py_ssize_t i2 = 0; i2 < (n)[2]; i2++)

/* Row (i0, i1, i2) of the Arr a, as a pointer to T: in FOR_ROWS. */
#define ROW(T, a) ((T *)(a).view.buf + i0 * (a).step[0] + i1 * (a).step[1] + i2 * (a).step[2])

/* ROWS(float) or ROWS(double), by the element type of arr (take's kind 'f' or 'd'), the GIL released. */
#define BY_FLOAT(arr, ROWS)                                              \
    Py_BEGIN_ALLOW_THREADS                                               \
    if ((arr).kind == 'f') { ROWS(float) } else { ROWS(double) }         \
    Py_END_ALLOW_THREADS

#endif

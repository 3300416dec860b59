/* The portable level's elementwise functions (mpisgd.portable.elementwise), each in one trip through memory.

   elementwise.py computes exp, expm1, log, tanh and erf in float64 with one NumPy (or CuPy) ufunc per IEEE
   operation. Here each element goes through the same operations in the same order (ldexp is the C
   library's or two multiplications by powers of two, frexp the C library's, both exact as NumPy's; rint
   is _ieee.h's round_even), then is rounded once to the output's
   dtype: the same bits, without a pass through memory per operation. Where NumPy computes both sides of a
   `where` and keeps one, this computes the one it keeps. The constants and series come from elementwise.py
   (`constants`), so the two cannot drift apart. Compiled without contraction into fused multiply-adds and
   without reassociation (setup.py); tests/test_portable_functions.py compares every function with its
   NumPy form bit for bit. */
#include "_arrays.h"
#include "_ieee.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TERMS 64

typedef struct {
    int ready;
    double ln2_hi, ln2_lo, inv_ln2, exp_max, exp_min, clip_lo, clip_hi, expm1_small, log_low;
    double erf_split, erf_one, two_over_sqrt_pi, inv_sqrt_pi;
    int erf_cf;
    int n_exp, n_expm1, n_log, n_erf;
    double exp_t[TERMS], expm1_t[TERMS], log_t[TERMS], erf_t[TERMS];
} Constants;

static Constants K;  /* elementwise.py's, set by constants() */

/* sum(c[i] t^i), Horner's rule from the highest: elementwise.py's _horner. */
static inline double horner(double t, const double *c, int n) {
    double p = c[n - 1];
    for (int i = n - 2; i >= 0; i--) {
        p = p * t;
        p = p + c[i];
    }
    return p;
}

static inline double exp64(double x) {
    double xc = x != x ? x : (x < K.clip_lo ? K.clip_lo : (x > K.clip_hi ? K.clip_hi : x));  /* np.clip */
    double n = round_even(xc * K.inv_ln2);
    double r = xc - n * K.ln2_hi;
    r = r - n * K.ln2_lo;
    double y = ldexp(horner(r, K.exp_t, K.n_exp), n != n ? 0 : (int)n);  /* nan_to_num, int32 */
    if (x > K.exp_max) y = INFINITY;
    if (x < K.exp_min) y = 0.0;
    return y;
}

/* The same operations a block of elements at a time, each operation a simple loop over the block (in L1, and
   vectorized by the compiler): exp, expm1 and tanh, the functions of softmax and GELU. ldexp(p, n) becomes
   (p 2^(n>>1)) 2^(n - (n>>1)): p lies in [0.7, 1.42], so the first product is exact and the second rounds
   once, as ldexp does (subnormal results included); n lies in [-1077, 1025] (x clipped), so both powers of
   two are normal floats, made from their bits. Where elementwise.py computes both sides of a `where`, a
   block computes a side only where one of its elements keeps it. */
#define BLOCK 256

typedef struct { double x[BLOCK], y[BLOCK], a[BLOCK], r[BLOCK], k[BLOCK], s[BLOCK]; } Work;

#define INLINE static inline __attribute__((always_inline))

/* p[j] = sum(c[i] t[j]^i) for a block: horner's operations, one coefficient at a time over the block. */
INLINE void horner_block(const double *t, double *p, Py_ssize_t n, const double *c, int terms) {
    for (Py_ssize_t j = 0; j < n; j++) p[j] = c[terms - 1];
    for (int i = terms - 2; i >= 0; i--) {
        const double ci = c[i];
        for (Py_ssize_t j = 0; j < n; j++) {
            double q = p[j] * t[j];
            p[j] = q + ci;
        }
    }
}

INLINE void exp_block(const double *x, double *y, Py_ssize_t n, double *r, double *k) {
    for (Py_ssize_t j = 0; j < n; j++) {
        double v = x[j];
        double xc = v != v ? v : (v < K.clip_lo ? K.clip_lo : (v > K.clip_hi ? K.clip_hi : v));
        double m = round_even(xc * K.inv_ln2);
        double t = xc - m * K.ln2_hi;
        r[j] = t - m * K.ln2_lo;
        k[j] = m == m ? m : 0.0;  /* nan_to_num */
    }
    horner_block(r, y, n, K.exp_t, K.n_exp);
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t e = (int64_t)k[j], e1 = e >> 1, e2 = e - e1;
        uint64_t b1 = (uint64_t)(e1 + 1023) << 52, b2 = (uint64_t)(e2 + 1023) << 52;
        double p1, p2;
        memcpy(&p1, &b1, sizeof p1);
        memcpy(&p2, &b2, sizeof p2);
        double v = (y[j] * p1) * p2;
        v = x[j] > K.exp_max ? INFINITY : v;
        y[j] = x[j] < K.exp_min ? 0.0 : v;
    }
}

INLINE void expm1_block(const double *x, double *y, Py_ssize_t n, Work *w) {
    int small = 0, large = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        int is = fabs(x[j]) <= K.expm1_small;
        small |= is;
        large |= !is;
    }
    if (large) {
        exp_block(x, y, n, w->r, w->k);
        for (Py_ssize_t j = 0; j < n; j++) y[j] = y[j] - 1.0;
    }
    if (small) {  /* t + t t P(t), t = x where small (0 elsewhere, as elementwise.py makes it) */
        double *t = w->r, *p = w->s;
        for (Py_ssize_t j = 0; j < n; j++) t[j] = fabs(x[j]) <= K.expm1_small ? x[j] : 0.0;
        horner_block(t, p, n, K.expm1_t, K.n_expm1);
        for (Py_ssize_t j = 0; j < n; j++) {
            double v = t[j] + t[j] * t[j] * p[j];
            y[j] = fabs(x[j]) <= K.expm1_small ? v : y[j];
        }
    }
}

INLINE void tanh_block(const double *x, double *y, Py_ssize_t n, Work *w) {
    for (Py_ssize_t j = 0; j < n; j++) w->a[j] = -2.0 * fabs(x[j]);
    expm1_block(w->a, y, n, w);
    for (Py_ssize_t j = 0; j < n; j++) {
        double t = y[j];
        y[j] = copysign(-t / (t + 2.0), x[j]);
    }
}

static inline double log64(double x) {
    int e;
    double m = frexp(x, &e);
    int low = m < K.log_low;
    if (low) m = m * 2.0;
    double ef = (double)(e - low);
    double f = m - 1.0;
    double s = f / (2.0 + f);
    double z = s * s;
    double r = z * horner(z, K.log_t, K.n_log);
    double hfsq = 0.5 * f * f;
    double y = ef * K.ln2_hi - ((hfsq - (s * (hfsq + r) + ef * K.ln2_lo)) - f);
    if (x == 0) y = -INFINITY;
    if (x < 0) y = NAN;
    if (isinf(x) && x > 0) y = INFINITY;
    return y;
}

static inline double erf64(double x) {
    double a = fabs(x), y;
    if (a < K.erf_split) {
        y = K.two_over_sqrt_pi * (a * horner(a * a, K.erf_t, K.n_erf));
    } else if (a >= K.erf_one) {
        y = 1.0;
    } else {  /* Laplace's continued fraction, from the bottom; NaN comes here too */
        double d = a;
        for (int level = K.erf_cf; level > 0; level--) d = a + (0.5 * level) / d;
        y = 1.0 - exp64(-(a * a)) * K.inv_sqrt_pi / d;
    }
    if (x != x) y = NAN;
    return copysign(y, x);
}

/* Each function's block kernel for each instruction set: the same IEEE operations in vectors of 2, 4 or 8
   (no FMA: contraction is off), so the same bits; log and erf, which branch, element by element. The
   widest the CPU has is chosen at import; `isa` chooses another (tests/test_portable_functions.py runs
   each against NumPy). */
enum { EXP, EXPM1, TANH, LOG, ERF, KINDS };
typedef void (*Kernel)(const double *, double *, Py_ssize_t, Work *);

#define VARIANTS(ISA, TARGET)                                                                       \
    TARGET static void exp_##ISA(const double *x, double *y, Py_ssize_t n, Work *w) {               \
        exp_block(x, y, n, w->r, w->k);                                                             \
    }                                                                                               \
    TARGET static void expm1_##ISA(const double *x, double *y, Py_ssize_t n, Work *w) {             \
        expm1_block(x, y, n, w);                                                                    \
    }                                                                                               \
    TARGET static void tanh_##ISA(const double *x, double *y, Py_ssize_t n, Work *w) {              \
        tanh_block(x, y, n, w);                                                                     \
    }                                                                                               \
    TARGET static void log_##ISA(const double *x, double *y, Py_ssize_t n, Work *w) {               \
        for (Py_ssize_t j = 0; j < n; j++) y[j] = log64(x[j]);                                      \
    }                                                                                               \
    TARGET static void erf_##ISA(const double *x, double *y, Py_ssize_t n, Work *w) {               \
        for (Py_ssize_t j = 0; j < n; j++) y[j] = erf64(x[j]);                                      \
    }

VARIANTS(baseline, )
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define X86 1
VARIANTS(avx2, __attribute__((target("avx2"))))
VARIANTS(avx512f, __attribute__((target("avx512f"))))
static const char *ISAS[] = {"baseline", "avx2", "avx512f"};
static const Kernel TABLE[][KINDS] = {{exp_baseline, expm1_baseline, tanh_baseline, log_baseline, erf_baseline},
                                      {exp_avx2, expm1_avx2, tanh_avx2, log_avx2, erf_avx2},
                                      {exp_avx512f, expm1_avx512f, tanh_avx512f, log_avx512f, erf_avx512f}};
static int runs(int isa) {
    __builtin_cpu_init();
    return isa == 0 || (isa == 1 && __builtin_cpu_supports("avx2")) || (isa == 2 && __builtin_cpu_supports("avx512f"));
}
#else
#define X86 0
static const char *ISAS[] = {"baseline"};
static const Kernel TABLE[][KINDS] = {{exp_baseline, expm1_baseline, tanh_baseline, log_baseline, erf_baseline}};
static int runs(int isa) { return isa == 0; }
#endif
#define N_ISAS ((int)(sizeof ISAS / sizeof ISAS[0]))
static int chosen = 0;

static PyObject *isa(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|s", &name)) return NULL;
    if (name) {
        int i = 0;
        while (i < N_ISAS && strcmp(ISAS[i], name) != 0) i++;
        if (i == N_ISAS || !runs(i)) {
            PyErr_Format(PyExc_ValueError, "isa: %s is not an instruction set this CPU runs", name);
            return NULL;
        }
        chosen = i;
    }
    return PyUnicode_FromString(ISAS[chosen]);
}

static PyObject *isas(PyObject *self, PyObject *args) {
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < N_ISAS; i++) {
        if (!runs(i)) continue;
        PyObject *s = PyUnicode_FromString(ISAS[i]);
        if (!s || PyList_Append(out, s) < 0) { Py_XDECREF(s); Py_DECREF(out); return NULL; }
        Py_DECREF(s);
    }
    return out;
}

/* out = F(x), a block of a row at a time: x's elements into a float64 block (exact), the chosen
   instruction set's block kernel, the results rounded once into out. */
#define APPLY_BLOCKS(TI, TO)                                                                        \
    FOR_ROWS(n) {                                                                                   \
        const TI *xr = ROW(const TI, x);                                                            \
        TO *orow = ROW(TO, o);                                                                      \
        Py_ssize_t len = n[3], sx = x.step[3], so = o.step[3];                                      \
        for (Py_ssize_t j0 = 0; j0 < len; j0 += BLOCK) {                                            \
            Py_ssize_t m = len - j0 < BLOCK ? len - j0 : BLOCK;                                     \
            for (Py_ssize_t j = 0; j < m; j++) w->x[j] = (double)xr[(j0 + j) * sx];                 \
            kernel(w->x, w->y, m, w);                                                               \
            for (Py_ssize_t j = 0; j < m; j++) orow[(j0 + j) * so] = (TO)w->y[j];                   \
        }                                                                                           \
    }

static PyObject *blocked(PyObject *args, int kind, const char *name) {
    PyObject *ox, *oo;
    Arr x, o;
    if (!K.ready) {
        PyErr_Format(PyExc_RuntimeError, "%s: call constants() first", name);
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OO", &ox, &oo)) return NULL;
    if (take(ox, &x, 0, name) < 0) return NULL;
    if (take(oo, &o, 1, name) < 0) { release(&x); return NULL; }
    if (!same_shape(&x, &o)) {
        PyErr_Format(PyExc_ValueError, "%s: x and out of one shape", name);
        release(&x); release(&o);
        return NULL;
    }
    Work *w = PyMem_Malloc(sizeof(Work));
    if (!w) { release(&x); release(&o); return PyErr_NoMemory(); }
    const Py_ssize_t *n = o.shape;
    Kernel kernel = TABLE[chosen][kind];
    Py_BEGIN_ALLOW_THREADS
    if (x.kind == 'f' && o.kind == 'f') { APPLY_BLOCKS(float, float) }
    else if (x.kind == 'f') { APPLY_BLOCKS(float, double) }
    else if (o.kind == 'f') { APPLY_BLOCKS(double, float) }
    else { APPLY_BLOCKS(double, double) }
    Py_END_ALLOW_THREADS
    PyMem_Free(w);
    release(&x); release(&o);
    Py_RETURN_NONE;
}

static PyObject *py_exp(PyObject *self, PyObject *args) { return blocked(args, EXP, "exp"); }
static PyObject *py_expm1(PyObject *self, PyObject *args) { return blocked(args, EXPM1, "expm1"); }
static PyObject *py_tanh(PyObject *self, PyObject *args) { return blocked(args, TANH, "tanh"); }
static PyObject *py_log(PyObject *self, PyObject *args) { return blocked(args, LOG, "log"); }
static PyObject *py_erf(PyObject *self, PyObject *args) { return blocked(args, ERF, "erf"); }


/* A sequence of at most TERMS floats into c; its length into n. */
static int series(PyObject *seq, double *c, int *n, const char *name) {
    PyObject *fast = PySequence_Fast(seq, name);
    if (!fast) return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    if (len < 1 || len > TERMS) {
        PyErr_Format(PyExc_ValueError, "%s: 1 to %d terms", name, TERMS);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        c[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
        if (PyErr_Occurred()) { Py_DECREF(fast); return -1; }
    }
    *n = (int)len;
    Py_DECREF(fast);
    return 0;
}

static PyObject *constants(PyObject *self, PyObject *args) {
    PyObject *exp_t, *expm1_t, *log_t, *erf_t;
    Constants k = {0};  /* parsed whole first: K changes only once all of it is valid */
    if (!PyArg_ParseTuple(args, "dddddddddddddiOOOO", &k.ln2_hi, &k.ln2_lo, &k.inv_ln2, &k.exp_max, &k.exp_min,
                          &k.clip_lo, &k.clip_hi, &k.expm1_small, &k.log_low, &k.erf_split, &k.erf_one,
                          &k.two_over_sqrt_pi, &k.inv_sqrt_pi, &k.erf_cf, &exp_t, &expm1_t, &log_t, &erf_t))
        return NULL;
    if (series(exp_t, k.exp_t, &k.n_exp, "exp terms") < 0 || series(expm1_t, k.expm1_t, &k.n_expm1, "expm1 terms") < 0 ||
        series(log_t, k.log_t, &k.n_log, "log terms") < 0 || series(erf_t, k.erf_t, &k.n_erf, "erf terms") < 0)
        return NULL;
    k.ready = 1;
    K = k;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"constants", constants, METH_VARARGS,
     "constants(ln2_hi, ln2_lo, inv_ln2, exp_max, exp_min, clip_lo, clip_hi, expm1_small, log_low, erf_split, "
     "erf_one, two_over_sqrt_pi, inv_sqrt_pi, erf_cf, exp_terms, expm1_terms, log_terms, erf_terms): "
     "elementwise.py's, set once before any function"},
    {"exp", py_exp, METH_VARARGS, "exp(x, out): out = e^x, elementwise.exp64's operations"},
    {"expm1", py_expm1, METH_VARARGS, "expm1(x, out): out = e^x - 1, elementwise.expm1_64's operations"},
    {"tanh", py_tanh, METH_VARARGS, "tanh(x, out): elementwise.tanh64's operations"},
    {"log", py_log, METH_VARARGS, "log(x, out): out = ln x, elementwise.log64's operations"},
    {"erf", py_erf, METH_VARARGS, "erf(x, out): elementwise.erf64's operations"},
    {"isa", isa, METH_VARARGS,
     "isa([name]): the instruction set the functions' kernels are compiled for (the widest the CPU runs, at "
     "import); with a name (baseline, avx2, avx512f), that one"},
    {"isas", isas, METH_NOARGS, "isas(): the instruction sets this CPU runs the kernels in, narrowest first"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_functions", NULL, -1, methods};

PyMODINIT_FUNC PyInit__functions(void) {
    for (int i = N_ISAS - 1; i > 0; i--)
        if (runs(i)) { chosen = i; break; }
    return PyModule_Create(&module);
}

"""Arithmetic whose result is a function of its inputs alone: the same bits on any BLAS, any CPU (any
kernel NumPy or the BLAS dispatches to), any thread count and CuPy on a GPU. What ``--reproducible
portable`` computes with (mpisgd.kernels chooses it; docs/reproducible.md says what it guarantees).

- ``gemm``: matrix products from exact slice products (the Ozaki scheme): each operand is scaled per
  row or column to integers whose products, and every partial sum of them, are exact in float64, so
  that any dgemm — any blocking, FMA use, order or threads — returns the same float64 values; one
  rounding to the output's dtype at the end.
- ``weight``: a layer's weight matrix split once per forward for both of its products (x @ W, dy @ W.T).
- ``passes``: the splits' memory-bound passes (sums of squares in the fixed tree, rounding onto a grid, a
  float64 slice's integers), as NumPy's ufuncs or compiled (``_passes.c``, built where a C compiler is):
  the same bits either way.
- ``samples``: a convolution's input as integers with one power of two per sample, so that its im2col
  columns need no splitting.
- ``reduce``: sums along an axis in one fixed pairwise order, done with elementwise adds (no library
  reduction decides the order).
- ``elementwise``: exp, log, expm1, tanh, erf from IEEE +, -, *, / and sqrt only (range reduction and
  polynomials in float64), rounded once; as one ufunc per operation or compiled (``_functions.c``, the
  same operations per element): the same bits either way.
- ``native``: which of the two C extensions serve (``MPISGD_PORTABLE_PASSES``).
- ``scalar``: the same idea for Python floats (the schedule's cosine, Adam's powers), stdlib only.

The array modules import NumPy; ``scalar`` does not, so the configuration layer may use it.
"""

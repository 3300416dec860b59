/* IEEE operations that C spells differently from NumPy, made from + and - alone (_passes.c, _functions.c). */
#ifndef MPISGD_IEEE_H
#define MPISGD_IEEE_H
#include <math.h>

/* rint(y) as IEEE roundToIntegralTiesToEven makes it (NumPy's rint, in the default rounding mode), from
   additions only: below 2^52, |y| + 2^52 - 2^52 rounds |y| to the nearest integer, ties to even (float64's
   spacing there is 1), and the sign is y's (rint(-0.3) is -0.0); from 2^52 on, and for inf and NaN, y is
   its own rint. */
static inline double round_even(double y) {
    const double big = 4503599627370496.0;  /* 2^52 */
    double a = fabs(y);
    double t = (a + big) - big;
    return a < big ? copysign(t, y) : y;
}

#endif

"""The few Python-float functions a run's bits depend on, two ways: the C library's, or portable.

The learning-rate schedule takes a cosine and a power, and Adam's bias corrections powers, of Python
floats. Python's ``math.cos`` and ``**`` call the C library, and glibc picks FMA or non-FMA variants of
cos, exp and pow by CPU: on this project's machine, with FMA turned off
(``GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX2,-FMA``), 5 of a 4680-step cosine schedule's rates and 2 of
5000 powers 0.999**t differ in the last bit. ``PORTABLE`` computes them from IEEE +, -, *, / alone
(Python floats are IEEE doubles, each operation rounded alone): the same bits on every machine. The
cosine lies within 4e-16 of the C library's; base ** n by repeated squaring within about n ulps
(1e-10 relative after a million steps: far below float32's rounding). ``LIBM`` is what runs outside
the reproducible mode: the C library's, bit for bit what the code computed before this choice
existed. Standard library only (the configuration layer uses it).
"""

from __future__ import annotations

import math

# sin and cos of x, |x| <= pi/4: Taylor terms (-1)^k x^(2k+1)/(2k+1)! and (-1)^k x^(2k)/(2k)!, to k = 10
_SIN = [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(11)]
_COS = [(-1.0) ** k / math.factorial(2 * k) for k in range(11)]
_PI = 3.141592653589793


def _poly(t: float, coeffs: list[float]) -> float:
    p = coeffs[-1]
    for c in reversed(coeffs[:-1]):
        p = p * t + c
    return p


def cos_pi(p: float) -> float:
    """cos(pi * p) from IEEE operations only: p reduced to [0, 1/4] by exact steps (p mod 2, 2 - p, 1 - p,
    1/2 - p), then the sine or cosine series of pi * p."""
    if not math.isfinite(p):
        return math.nan
    p = abs(p)
    p -= 2.0 * math.floor(p / 2.0)  # [0, 2): floor and the halving are exact
    if p > 1.0:
        p = 2.0 - p  # exact (Sterbenz)
    sign = 1.0
    if p > 0.5:
        p, sign = 1.0 - p, -1.0  # exact
    if p <= 0.25:
        x = _PI * p
        return sign * _poly(x * x, _COS)
    x = _PI * (0.5 - p)  # cos(pi p) = sin(pi (1/2 - p)); 1/2 - p exact
    return sign * x * _poly(x * x, _SIN)


def power(base: float, n: int) -> float:
    """base ** n for an integer n >= 0, by repeated squaring: IEEE products in a fixed order."""
    if n < 0:
        raise ValueError(f"power: n must be >= 0, got {n}")
    result, b = 1.0, float(base)
    while n:
        if n & 1:
            result *= b
        b *= b
        n >>= 1
    return result


class LibmMath:
    """The C library's cos and pow (what Python's math and ** call)."""

    name = "libm"

    @staticmethod
    def cos_pi(p: float) -> float:
        return math.cos(math.pi * p)

    @staticmethod
    def power(base: float, n: int) -> float:
        return base ** n


class PortableMath:
    """cos and integer powers from IEEE operations: the same bits on every machine."""

    name = "portable"
    cos_pi = staticmethod(cos_pi)
    power = staticmethod(power)


ScalarMath = LibmMath | PortableMath
LIBM = LibmMath()
PORTABLE = PortableMath()

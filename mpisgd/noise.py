"""The gradient noise scale: the batch size beyond which a larger batch stops buying fewer steps.

McCandlish, Kaplan, Amodei et al. 2018 ("An Empirical Model of Large-Batch Training") model a step's
gradient estimate from a batch of B samples as the true gradient G plus noise of covariance Σ/B, and
find that B_simple = tr(Σ) / |G|² predicts the critical batch size. Both come from the squared norms of
gradient estimates at two batch sizes (their Appendix A): with the expected |G_B|² = |G|² + tr(Σ)/B,

    |G|²  ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

Synchronous data parallelism has both for the price of one scalar per rank: each rank's gradient
before the all-reduce is a small batch, the average after it the big one (DataParallel measures them
every few steps; mpisgd.parallel.stats.StepStats sums both in true units, the gradient of the mean
loss). The two estimates are unbiased but noisy; they are averaged over the steps of an epoch before
the ratio is taken, as McCandlish et al. smooth them over steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class NoiseScale:
    grad_sqr: float  # |G|², the squared norm of the true gradient
    grad_var: float  # tr(Σ), the per-sample gradient variance summed over parameters
    b_small: int
    b_big: int

    @property
    def noise_scale(self) -> float:
        """B_simple = tr(Σ)/|G|², in samples (inf where |G|² is estimated <= 0: noise dominates)."""
        return self.grad_var / self.grad_sqr if self.grad_sqr > 0 else math.inf


def estimate(b_small: int, small_sq: float, b_big: int, big_sq: float) -> NoiseScale | None:
    """From the mean squared norms of small-batch (b_small samples) and big-batch (b_big) gradients;
    None when the two batch sizes are the same (nothing to compare) or the norms are not finite."""
    if not (0 < b_small < b_big) or not (math.isfinite(small_sq) and math.isfinite(big_sq)):
        return None
    grad_sqr = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    grad_var = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return NoiseScale(grad_sqr, grad_var, b_small, b_big)


def why_none(k: int, accum_steps: int, every: int) -> str:
    """Why a run records no noise scale, in one phrase ('' when it records one)."""
    if every <= 0:
        return "off (--noise-scale-every 0)"
    if k == 1 and accum_steps == 1:
        return ("none: it compares each rank's gradient with the averaged one, and k=1 with m=1 has only one "
                "(use k >= 2 or --accum-steps >= 2)")
    return ""

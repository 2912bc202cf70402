"""Statistics the benches share: Student's t quantile (exact, through mpmath, which sympy brings)."""

from __future__ import annotations


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``df`` > 0 degrees of freedom (not necessarily whole:
    Welch's), from its CDF ``1 - I_{df/(df+t^2)}(df/2, 1/2) / 2`` (mpmath's regularized incomplete beta), by
    bisection. Raises ValueError outside those ranges."""
    import mpmath

    if not (0.5 < p < 1 and df > 0):
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df > 0, got p={p}, df={df}")

    def cdf(t: float) -> float:
        return 1 - 0.5 * float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


__all__ = ["t_quantile"]

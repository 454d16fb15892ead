"""Paired statistics for comparing training arms: the mean paired gap, its 95% t-interval, a verdict.

Arms of a study share each seed (initial weights, data order, the recipe's random bits), so the
quantity of interest is the per-seed difference d_s = loss(arm, s) - loss(base, s); most of the
seed-to-seed variation cancels in d_s. Over n seeds:

    mean  = sum(d_s) / n
    sd    = sqrt(sum((d_s - mean)^2) / (n - 1))
    half  = t_{0.975, n-1} * sd / sqrt(n)          (the 95% two-sided Student-t half-width)
    interval = [mean - half, mean + half]

A contrast generalises this: d_s = sum_a c_a * loss(a, s) (e.g. the Wgrad increment minus the
Fprop increment). With one seed there is no interval (half-width = inf): nothing can be resolved.

The Student-t quantile is computed here (no SciPy in fp4lab's dependencies): the t CDF through
the regularized incomplete beta function (a continued fraction, evaluated by the modified Lentz
method), inverted by bisection. Checked against the textbook table in the tests.

A **verdict** reads the interval against the direction a claim predicts:
    "reproduced"    the interval lies wholly on the claimed side of 0
    "contradicted"  the interval lies wholly on the other side
    "not resolved"  the interval covers 0 (or there are too few seeds)

Public: ``t_quantile``, ``Interval``, ``interval``, ``verdict``, ``combine``, ``VERDICTS``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

REPRODUCED, NOT_RESOLVED, CONTRADICTED = "reproduced", "not resolved", "contradicted"
VERDICTS = (REPRODUCED, NOT_RESOLVED, CONTRADICTED)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b), x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom (p in (0, 1), df > 0)."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):  # bisection to float precision
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Interval:
    """A mean paired difference over seeds with its 95% t-interval (nats), and the same in % of
    the baseline's mean loss when one is given."""

    mean: float
    half: float
    """95% half-width; inf with fewer than two seeds."""
    n: int
    values: tuple[float, ...]
    """The per-seed differences, in seed order."""
    seeds: tuple[int, ...]
    base_mean: float | None = None
    """The baseline arm's mean loss over the same seeds (for %)."""

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half

    def pct(self, value: float) -> float | None:
        return None if not self.base_mean else 100.0 * value / self.base_mean

    def text(self, digits: int = 4) -> str:
        """'+0.0123 [+0.0050, +0.0196] (+0.41%)' or '+0.0123 (1 seed: no interval)'."""
        mean = f"{self.mean:+.{digits}f}"
        if self.n < 2:
            return f"{mean} ({self.n} seed: no interval)"
        pct = f" ({self.pct(self.mean):+.2f}% [{self.pct(self.lo):+.2f}, {self.pct(self.hi):+.2f}])" \
            if self.base_mean else ""
        return f"{mean} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]{pct}"

    def to_dict(self) -> dict:
        return {"mean": self.mean, "lo": self.lo if self.n > 1 else None, "hi": self.hi if self.n > 1 else None,
                "half": self.half if self.n > 1 else None, "n": self.n, "seeds": list(self.seeds),
                "values": list(self.values), "mean_pct": self.pct(self.mean),
                "lo_pct": self.pct(self.lo) if self.n > 1 else None,
                "hi_pct": self.pct(self.hi) if self.n > 1 else None}


def interval(values_by_seed: dict[int, float], *, base_mean: float | None = None,
             confidence: float = 0.95) -> Interval:
    """{seed: paired difference} -> the mean and its two-sided t-interval over the seeds."""
    seeds = tuple(sorted(values_by_seed))
    values = tuple(float(values_by_seed[s]) for s in seeds)
    if not values:
        raise ValueError("no paired values: the arms share no seed")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"non-finite paired values {values}: drop diverged runs before pairing")
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return Interval(mean, math.inf, n, values, seeds, base_mean)
    half = t_quantile(0.5 + confidence / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, half, n, values, seeds, base_mean)


def seeds_to_resolve(iv: Interval, effect: float | None = None, *, confidence: float = 0.95,
                     most: int = 100) -> int | None:
    """The fewest seeds whose t-interval half-width would fall below |effect| (default: the
    measured mean gap) if the per-seed differences kept the spread measured in ``iv``; None when
    that takes more than ``most`` seeds or the spread is unknown (fewer than two seeds)."""
    size = abs(iv.mean if effect is None else effect)
    if iv.n < 2 or size == 0:
        return None
    sd = statistics.stdev(iv.values)
    for n in range(2, most + 1):
        if t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n) < size:
            return n
    return None


def verdict(iv: Interval | None, direction: int) -> str:
    """The claim predicts the difference is > 0 (direction +1) or < 0 (-1) -> one of VERDICTS."""
    if direction not in (1, -1):
        raise ValueError(f"direction is +1 or -1, got {direction}")
    if iv is None or iv.n < 2:
        return NOT_RESOLVED
    lo, hi = (iv.lo, iv.hi) if direction > 0 else (-iv.hi, -iv.lo)
    return REPRODUCED if lo > 0 else CONTRADICTED if hi < 0 else NOT_RESOLVED


def combine(parts: list[str]) -> str:
    """A claim made of several parts: reproduced only if every part is; contradicted if any is."""
    if not parts:
        return NOT_RESOLVED
    if CONTRADICTED in parts:
        return CONTRADICTED
    return REPRODUCED if all(p == REPRODUCED for p in parts) else NOT_RESOLVED

"""A ratio between two sets of timings, with its 95% interval: the one definition that
minigpt.analysis.compare and the benchmarks use, so that a speed-up is a finding only when the noise allows.

    from minigpt.analysis.stats import ratio_interval, verdict
    iv = ratio_interval(base_tokens_per_s, variant_tokens_per_s)   # samples of A and of B
    verdict(iv)   # "1.23x (1.10-1.38)", or "no difference within noise" when the interval holds 1.0

The method is Welch's t on the logarithms of the samples: the ratio is B's geometric mean over A's,
and the interval is exp(mean log B - mean log A +- t * standard error), with Welch-Satterthwaite
degrees of freedom. Why this and not a bootstrap:
- timings are positive and their noise is multiplicative (a busy core slows a step by a fraction,
  not by a fixed number of ms), so on the log scale it is additive and close to symmetric, and the
  interval of a ratio is the exponential of an interval of a difference;
- the samples are few (three repeats, or a dozen logged intervals): a bootstrap resamples three
  values into only ten distinct sets per side, so its interval is coarse and cannot reach beyond
  the extremes it saw, while the t interval widens with few samples by a known amount; Welch's form
  does not assume the two sides are equally noisy (a variant under load is not);
- it is deterministic and needs nothing beyond the standard library.
tests/test_stats.py checks the coverage on simulated pairs of known ratio.

The samples must be independent for the interval to mean what it says: repeats in fresh processes
are; logged intervals of one run are nearly so, but share the process, so an interval from one run
each says "beyond this run's step-to-step noise", not "beyond the noise between processes". The
caller says which it has (RatioInterval.method).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

LEVEL = 0.95
# Fewest samples per side for an interval: two give a variance, but a t interval on one degree of
# freedom is ~6x as wide as on many (t 12.7 against 1.96), so it would call almost anything noise;
# three is what the benchmarks repeat by default.
MIN_SAMPLES = 3


class StatsError(ValueError):
    """Samples that cannot give an interval (too few, not positive). The message is one line for a
    user, naming what is missing."""


@dataclass(frozen=True)
class RatioInterval:
    """B / A with its interval. `ratio` is the ratio of geometric means; `low`..`high` holds the
    true ratio with probability `level` (under the method's assumptions)."""

    ratio: float
    low: float
    high: float
    n_a: int
    n_b: int
    level: float
    method: str

    @property
    def holds_one(self) -> bool:
        """True when 1.0 is inside the interval: no difference can be claimed."""
        return self.low <= 1.0 <= self.high

    def to_json(self) -> dict:
        return {
            "ratio": self.ratio,
            "low": self.low,
            "high": self.high,
            "n_a": self.n_a,
            "n_b": self.n_b,
            "level": self.level,
            "method": self.method,
            "verdict": verdict(self),
        }


def needed_samples(
    n_a: int,
    n_b: int,
    minimum: int = MIN_SAMPLES,
    unit: tuple[str, str] = ("sample", "samples"),
    per: str = "side",
) -> str | None:
    """None when both sides have `minimum` samples; otherwise the line that says what there was and
    what an interval needs: "A has 1 sample, B 1; an interval needs at least 3 per side". `unit` is
    the sample's name, singular and plural; `per` what a side is (a run, a variant)."""
    if n_a >= minimum and n_b >= minimum:
        return None
    had = f"A has {n_a} {unit[0] if n_a == 1 else unit[1]}, B {n_b}"
    return f"{had}; an interval needs at least {minimum} per {per}"


def ratio_interval(
    a: list[float],
    b: list[float],
    level: float = LEVEL,
    minimum: int = MIN_SAMPLES,
    method: str = "Welch t on log samples",
) -> RatioInterval:
    """B / A of two sets of positive samples (tokens/s, step times) and its `level` interval:
    Welch's t on the logarithms (module docstring). Raises StatsError with needed_samples()'s line
    when a side has fewer than `minimum` samples (never fewer than 2: one has no spread), or when a
    sample is not a positive number. `method` is recorded as given: name what the samples are
    ("repeats in fresh processes", "logged intervals of one run")."""
    minimum = max(minimum, 2)
    a = [x for x in a if x is not None]
    b = [x for x in b if x is not None]
    short = needed_samples(len(a), len(b), minimum)
    if short:
        raise StatsError(short)
    if not 0 < level < 1:
        raise StatsError(f"level {level} is not between 0 and 1 (0.95 is a 95% interval)")
    for side, xs in (("A", a), ("B", b)):
        bad = [x for x in xs if not isinstance(x, (int, float)) or not x > 0 or math.isinf(x)]
        if bad:
            raise StatsError(
                f"{side} has a sample that is not a positive number ({bad[0]!r}): "
                "a ratio needs rates or times"
            )
    la, lb = [math.log(x) for x in a], [math.log(x) for x in b]
    ma, mb = sum(la) / len(la), sum(lb) / len(lb)
    va = sum((x - ma) ** 2 for x in la) / (len(la) - 1) / len(la)  # variance of the mean
    vb = sum((x - mb) ** 2 for x in lb) / (len(lb) - 1) / len(lb)
    d = mb - ma
    se = math.sqrt(va + vb)
    if se == 0.0:  # identical samples on both sides (a count, not a timing): no noise at all
        half = 0.0
    else:
        df = (va + vb) ** 2 / (va**2 / (len(la) - 1) + vb**2 / (len(lb) - 1))
        half = t_quantile(0.5 + level / 2, df) * se
    return RatioInterval(math.exp(d), math.exp(d - half), math.exp(d + half), len(a), len(b), level, method)


def verdict(iv: RatioInterval | None, digits: int = 2) -> str:
    """What a reader may conclude: "no difference within noise" when the interval holds 1.0 (no
    percentage: it would be noise), else "1.23x (1.10-1.38)"."""
    if iv is None:
        return "-"
    if iv.holds_one:
        return "no difference within noise"
    return f"{iv.ratio:.{digits}f}x ({iv.low:.{digits}f}-{iv.high:.{digits}f})"


# ---------------------------------------------------------------------------- Student's t


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` (possibly fractional) degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with t_cdf(t, df) == p (0.5 < p < 1): Welch's degrees of freedom are fractional, which
    tables and the standard library's NormalDist do not cover. Newton's method from the normal
    quantile: the CDF is concave for t > 0, so from below each step stays below the root and the
    steps shrink to it without overshooting."""
    t = NormalDist().inv_cdf(p)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    for _ in range(100):
        pdf = math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df))
        step = (t_cdf(t, df) - p) / pdf
        t -= step
        if abs(step) < 1e-12 * max(1.0, abs(t)):
            break
    return t

"""minigpt.analysis.stats: a ratio's 95% interval covers the true ratio about 95% of the time, reads "no
difference within noise" when it holds 1.0, and refuses samples that cannot give one."""

from __future__ import annotations

import math
import random

import pytest

from minigpt.analysis.stats import (
    MIN_SAMPLES,
    RatioInterval,
    StatsError,
    needed_samples,
    ratio_interval,
    t_quantile,
    verdict,
)


@pytest.mark.parametrize(
    "df, t",  # two-sided 95% points of Student's t, from any table
    [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042), (1e6, 1.960)],
)
def test_t_quantile_matches_the_tables(df, t):
    assert t_quantile(0.975, df) == pytest.approx(t, abs=1e-3)


def coverage(
    rng: random.Random, true: float, n_a: int, n_b: int, sd_a: float, sd_b: float, pairs=1000
) -> float:
    """The fraction of `pairs` simulated comparisons whose interval holds the true ratio: A's
    samples scatter around 1, B's around `true`, with multiplicative noise."""
    held = 0
    for _ in range(pairs):
        a = [100.0 * math.exp(rng.gauss(0, sd_a)) for _ in range(n_a)]
        b = [100.0 * true * math.exp(rng.gauss(0, sd_b)) for _ in range(n_b)]
        iv = ratio_interval(a, b)
        held += iv.low <= true <= iv.high
    return held / pairs


@pytest.mark.parametrize(
    "true, n_a, n_b, sd_a, sd_b",
    [
        (1.25, 3, 3, 0.05, 0.05),  # three repeats each: the benchmarks' default
        (0.8, 11, 11, 0.10, 0.10),  # a dozen logged intervals, a slow-down
        (1.10, 4, 9, 0.02, 0.12),  # unequal sizes and noise: what Welch's form is for
    ],
)
def test_95_percent_of_intervals_hold_the_true_ratio(true, n_a, n_b, sd_a, sd_b):
    # 1,000 pairs: a binomial's standard deviation at 95% is 0.7 points; 2.5 points is 3.6 of them.
    got = coverage(random.Random(24), true, n_a, n_b, sd_a, sd_b)
    assert 0.925 <= got <= 0.975, got


def test_ratio_is_b_over_a_and_narrows_with_more_samples():
    rng = random.Random(3)
    a = [1000 * math.exp(rng.gauss(0, 0.05)) for _ in range(40)]
    b = [1500 * math.exp(rng.gauss(0, 0.05)) for _ in range(40)]
    wide, narrow = ratio_interval(a[:3], b[:3]), ratio_interval(a, b)
    assert narrow.ratio == pytest.approx(1.5, rel=0.03) and narrow.low < 1.5 < narrow.high
    assert (narrow.high - narrow.low) < (wide.high - wide.low)
    assert (narrow.n_a, narrow.n_b, narrow.level) == (40, 40, 0.95)
    assert ratio_interval(b, a).ratio == pytest.approx(1 / narrow.ratio)


def test_verdict_says_noise_when_the_interval_holds_one():
    assert verdict(RatioInterval(1.36, 0.7, 2.6, 3, 3, 0.95, "")) == "no difference within noise"
    assert verdict(RatioInterval(1.234, 1.101, 1.382, 3, 3, 0.95, "")) == "1.23x (1.10-1.38)"
    assert verdict(RatioInterval(0.5, 0.45, 0.56, 3, 3, 0.95, "")) == "0.50x (0.45-0.56)"
    # Two noisy samples a side 30% apart: the interval is wide and holds 1.0, so no percentage.
    iv = ratio_interval([100, 130, 80], [125, 100, 140])
    assert iv.holds_one and "x" not in verdict(iv)
    # Counts that do not vary (bytes): the interval is the point itself.
    iv = ratio_interval([4096] * 3, [2048] * 3)
    assert iv.low == iv.ratio == iv.high == pytest.approx(0.5) and verdict(iv) == "0.50x (0.50-0.50)"


def test_too_few_samples_say_what_they_had_and_need():
    assert needed_samples(3, 5) is None
    assert needed_samples(1, 1) == f"A has 1 sample, B 1; an interval needs at least {MIN_SAMPLES} per side"
    line = needed_samples(2, 4, unit=("logged interval", "logged intervals"), per="run")
    assert line == "A has 2 logged intervals, B 4; an interval needs at least 3 per run"
    with pytest.raises(StatsError, match="A has 1 sample, B 3; an interval needs at least 3"):
        ratio_interval([1.0], [1.0, 2.0, 3.0])
    # One repeat never gives an interval, whatever minimum is asked for.
    with pytest.raises(StatsError, match="at least 2"):
        ratio_interval([1.0], [1.0], minimum=1)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "12"])
def test_non_positive_samples_refused(bad):
    with pytest.raises(StatsError, match="not a positive number"):
        ratio_interval([1.0, 2.0, bad], [1.0, 2.0, 3.0])

"""The 95% intervals `agentrl up` and `agentrl eval` report, rounded to 3 digits.

A mean of 0/1 outcomes (an accuracy; an agent whose reward is 1 or 0) gets the Wilson score interval: the
normal approximation (mean +- 1.96 sd/sqrt(n)) is too narrow for few tasks or a mean near 0 or 1 and can
leave [0, 1] (6 of 30: [0.054, 0.346] where Wilson gives [0.095, 0.373]). Any other reward gets the
normal approximation, labelled as such: nothing bounds it, so no score interval applies. Three digits,
because at the few hundred tasks an evaluation runs on the fourth is noise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

Z95 = 1.959964  # two-sided 95% normal quantile
DIGITS = 3


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (``successes`` of ``n``); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return round(max(0.0, centre - half), DIGITS), round(min(1.0, centre + half), DIGITS)


def normal_interval(values: Sequence[float]) -> tuple[float, float] | None:
    """Mean +- 1.96 standard errors; None for fewer than 2 values."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = Z95 * statistics.stdev(values) / math.sqrt(len(values))
    return round(mean - half, DIGITS), round(mean + half, DIGITS)


def binary(values: Sequence[float]) -> bool:
    return bool(values) and all(v in (0.0, 1.0) for v in values)


def mean_ci(values: Sequence[float], *, proportion: bool = True) -> dict[str, Any]:
    """``{"n", "mean", "ci95", "method"}``: Wilson for 0/1 values, else the normal approximation.

    ``proportion=False`` for values that only happen to be 0 or 1 (a paired difference can be -1 too).
    """
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "ci95": None, "method": None}
    mean = statistics.fmean(values)
    if proportion and binary(values):
        return {"n": n, "mean": round(mean, DIGITS), "ci95": list(wilson_interval(sum(values), n)), "method": "wilson"}
    interval = normal_interval(values)
    return {"n": n, "mean": round(mean, DIGITS), "ci95": None if interval is None else list(interval),
            "method": "normal"}

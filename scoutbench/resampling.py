"""The one percentile bootstrap of the project: the resamples, their seed and count, the 95% interval and the
standard error that every interval is made of.

Both sides of the comparison use it: a throughput's and a speed-up's interval resample the timed steps
(`step_stats.throughput_interval`), every accuracy figure resamples the records (`analysis/bootstrap.py`). Step times
are skewed and a task's scores are bounded and lumpy (0 or 100 per record), so neither fits a t-interval; the
percentile bootstrap assumes no shape. One seeded generator makes a report or a table of the same results the same
file on every machine and rerun.

- `resample_indices`: per sample (a run's steps, a task's records: the strata of a stratified bootstrap), `RESAMPLES`
  draws of its indices with replacement, all from one generator seeded with `SEED`, the samples in order; the same
  sizes always give the same draws.
- `percentile_interval`: the 2.5th and 97.5th percentiles of a statistic over the resamples (linear interpolation
  between order statistics, numpy's default).
- `bootstrap_stderr`: the resamples' sample standard deviation (lm-eval's `bootstrap_stderr`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SEED = 0
RESAMPLES = 2000
CONFIDENCE = 0.95


def resample_indices(sizes: Sequence[int], count: int = RESAMPLES, seed: int = SEED) -> list[Any]:
    """Per sample of `sizes[i]` values, a (count, sizes[i]) numpy array of indices drawn with replacement, every
    sample from the same generator seeded with `seed`, in order."""
    import numpy as np

    generator = np.random.default_rng(seed)
    return [generator.integers(0, size, size=(count, size)) for size in sizes]


def percentile_interval(values: Any, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The percentile bootstrap interval of a statistic from its values over the resamples."""
    import numpy as np

    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_stderr(values: Any) -> float:
    """The standard error of a statistic from its values over the resamples: their sample standard deviation (0 for
    a single value)."""
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    return float(values.std(ddof=1)) if values.size > 1 else 0.0

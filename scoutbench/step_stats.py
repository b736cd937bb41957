"""How far a measured decode step can be trusted: spread of the timed steps and a confidence interval of their
median, the 95% interval of the throughput, and the warning a result carries when the spread is too wide to compare
methods by their ratio.

Throughput has one definition everywhere (tables, figures, summaries, exports, gates): tokens over the total timed
decode time, `decode_throughput_tok_s` (batch x steps / the sum of the step times: the mean step). The median step
is a separate number with its own interval, always labelled as the median step.

The median step's interval is distribution-free (order statistics of the binomial): step times are skewed and have
outliers (a page fault, another process), so a t-interval around the mean would be the wrong model. The bounds are
two of the measured steps, [x_(j), x_(n+1-j)], with the largest j whose coverage is still at least 95%; fewer than 6
steps cannot give 95% at all (coverage 1 - 2 / 2^n), so the interval is then null and the result says so.

The throughput's interval (and a speed-up's, a ratio of two throughputs) is the project's one percentile bootstrap
(`scoutbench/resampling.py`: fixed seed and resample count) over the timed steps: the same skew rules out a
t-interval of the mean, and the fixed seed makes a report of the same results the same file.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from scoutbench.resampling import CONFIDENCE, percentile_interval, resample_indices

# how every table, figure, summary and export states its throughput column
THROUGHPUT_DEFINITION = "tok/s is tokens over the total timed decode time (batch x timed steps / their summed time)."
# A ratio of two medians each known to +-10% is uncertain by ~+-14%: beyond that a speed-up is not worth quoting.
MAX_CI_HALF_WIDTH_FRAC = 0.10


def percentile(values: list[float], fraction: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median_ci_ranks(n: int, confidence: float = CONFIDENCE) -> tuple[int, int, float] | None:
    """1-based ranks (j, n+1-j) of the widest-needed order statistics whose interval covers the median with at least
    `confidence`, and its exact coverage; None when n is too small for any interval to reach it."""
    best = None
    cumulative = 0.0  # P(Binomial(n, 1/2) <= j - 1)
    for j in range(1, n // 2 + 1):
        cumulative += math.comb(n, j - 1) / 2**n
        coverage = 1.0 - 2.0 * cumulative
        if coverage < confidence:
            break
        best = (j, n + 1 - j, coverage)
    return best


def step_summary(step_ms: list[float]) -> dict[str, Any]:
    """`decode_step_ms`: location (median, mean), spread (std, p25, p75, iqr, min, max, p90) and the median's
    95% interval (`ci95_low`, `ci95_high`, `ci95_coverage`; null under 6 steps), all in ms."""
    ranks = median_ci_ranks(len(step_ms))
    ordered = sorted(step_ms)
    p25, p75 = percentile(step_ms, 0.25), percentile(step_ms, 0.75)
    return {
        "median": statistics.median(step_ms), "p90": percentile(step_ms, 0.9), "mean": statistics.fmean(step_ms),
        "min": ordered[0], "max": ordered[-1],
        "std": statistics.stdev(step_ms) if len(step_ms) > 1 else 0.0,  # sample std (n - 1)
        "p25": p25, "p75": p75, "iqr": p75 - p25,
        "ci95_low": ordered[ranks[0] - 1] if ranks else None, "ci95_high": ordered[ranks[1] - 1] if ranks else None,
        "ci95_coverage": ranks[2] if ranks else None, "n": len(step_ms),
    }


def spread_warning(summary: dict[str, Any]) -> str | None:
    """Why the median step should not be used for a ratio between methods, or None when it can."""
    if summary.get("ci95_low") is None:
        return (f"only {summary['n']} timed steps: no 95% interval of the median exists below 6; use more --steps "
                "before comparing methods")
    half_width = (summary["ci95_high"] - summary["ci95_low"]) / 2
    frac = half_width / summary["median"] if summary["median"] else math.inf
    if frac > MAX_CI_HALF_WIDTH_FRAC:
        return (f"the median step's 95% interval is +-{100 * frac:.0f}% (over {100 * MAX_CI_HALF_WIDTH_FRAC:.0f}%): "
                "too noisy to trust a ratio between methods; rerun on an idle machine or with more --steps")
    return None


# below this many values in a sample the bootstrap's resamples repeat the same few values: no interval
MIN_BOOTSTRAP_VALUES = 6

Samples = Sequence[Sequence[float]]


def bootstrap_resamples(samples: Samples) -> list[Any] | None:
    """Each of `samples` (independent samples, e.g. the timed steps of each run that a number is made of: the strata
    of a stratified bootstrap) resampled with replacement (`resampling.resample_indices`), as one (resamples, len)
    numpy array per sample. None when a sample is too small to resample."""
    import numpy as np

    if not samples or any(len(sample) < MIN_BOOTSTRAP_VALUES for sample in samples):
        return None
    return [np.asarray(sample, dtype=np.float64)[indices]
            for sample, indices in zip(samples, resample_indices([len(sample) for sample in samples]), strict=True)]


def _resampled_throughputs(runs: Sequence[tuple[float, Sequence[float]]], resampled: list[Any]) -> Any:
    """Per resample, the median over the runs of each run's tokens over total time had its steps been the
    resampled ones (throughput scales with 1 / the mean step)."""
    import numpy as np

    each = [tok_s * statistics.fmean(steps) / again.mean(axis=1)
            for (tok_s, steps), again in zip(runs, resampled, strict=True)]
    return np.median(np.stack(each), axis=0)


def throughput_interval(runs: Sequence[tuple[float, Sequence[float]]]) -> tuple[float, float] | None:
    """The 95% interval of a point's throughput, the median over its repeats of each run's tokens over the total
    timed time; `runs` are (decode_throughput_tok_s, its timed steps in ms) per repeat. None without enough steps."""
    resampled = bootstrap_resamples([steps for _, steps in runs])
    return None if resampled is None else percentile_interval(_resampled_throughputs(runs, resampled))


def speedup_interval(runs: Sequence[tuple[float, Sequence[float]]],
                     base_runs: Sequence[tuple[float, Sequence[float]]]) -> tuple[float, float] | None:
    """The 95% interval of the ratio of two points' throughputs (each as `throughput_interval` takes it), the two
    points' steps resampled independently."""
    resampled = bootstrap_resamples([steps for _, steps in [*runs, *base_runs]])
    if resampled is None:
        return None
    ratio = (_resampled_throughputs(runs, resampled[:len(runs)])
             / _resampled_throughputs(base_runs, resampled[len(runs):]))
    return percentile_interval(ratio)

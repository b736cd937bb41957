"""The one interval of every accuracy number: the project's percentile bootstrap (`scoutbench/resampling.py`) over
records.

An accuracy figure is a mean over a handful of records (LongBench's tasks here have 3-15), so one record more or
less moves it by whole points; a difference between two methods means something only when it is larger than that.
Every accuracy output (the scores, their change against FullKV, the agreement with FullKV's prediction, the
teacher-forced top-1 and KL, the figure's error bars) takes its 95% interval from `bootstrap` below:

- the records are resampled with replacement (`resampling.resample_indices`: `RESAMPLES` times, one generator
  seeded with `SEED`, the same draws as the throughput's interval over as many steps), so a table is the same on
  every machine and rerun; every statistic over the same number of records sees the same resamples;
- the interval is the 2.5th and 97.5th percentiles of the statistic over the resamples
  (`resampling.percentile_interval`), its standard error the resamples' standard deviation
  (`resampling.bootstrap_stderr`, lm-eval's `bootstrap_stderr`);
- a comparison with FullKV is paired: one resample picks the same records for both sides;
- a mean over tasks resamples each task's records on their own (stratified) and takes the mean of the tasks'
  statistics, so every task keeps its weight;
- a difference whose interval contains 0 is not resolved (`Interval.resolved`), and a figure with a task of fewer
  than `MIN_RECORDS` records is marked (and a difference there is not resolved): a bootstrap of 1-4 records cannot
  see the spread it is asked about.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from scoutbench.resampling import RESAMPLES, SEED, bootstrap_stderr, percentile_interval, resample_indices

MIN_RECORDS = 5  # below this many records a cell is marked (n < 5)

Statistic = Callable[[Sequence[Sequence[int]]], float | None]  # per stratum, the record indices of one resample


@dataclass(frozen=True)
class Interval:
    """A statistic with its bootstrap interval: `value` on the records as they are, [`low`, `high`] the 95%
    percentile interval, `stderr` the resamples' standard deviation, `n` the records (summed over strata) and
    `smallest` the records of the smallest stratum (a task)."""

    value: float
    low: float
    high: float
    stderr: float
    n: int
    smallest: int  # the fewest records of a stratum (n for one stratum)

    @property
    def resolved(self) -> bool:
        """For a difference: whether its interval excludes 0 (a sign the records support), over strata of at least
        MIN_RECORDS records each (a task of one or two records has no spread to resample: a sign there is not
        resolved however narrow the interval)."""
        return (self.low > 0 or self.high < 0) and not self.few

    @property
    def few(self) -> bool:
        """Fewer than MIN_RECORDS records in a stratum: the interval is there, but that task has too few records
        for it to see the task's spread."""
        return self.smallest < MIN_RECORDS

    def fields(self, name: str, digits: int = 2) -> dict[str, Any]:
        """`{name}_ci95: [low, high]` and `{name}_stderr`, rounded, for a result file."""
        return {f"{name}_ci95": [round(self.low, digits), round(self.high, digits)],
                f"{name}_stderr": round(self.stderr, digits + 2)}


@lru_cache(maxsize=64)
def resamples(sizes: tuple[int, ...], count: int = RESAMPLES, seed: int = SEED) -> tuple[tuple[tuple[int, ...], ...],
                                                                                         ...]:
    """`count` resamples of records for strata of `sizes` records: per resample, per stratum, the indices drawn
    with replacement (`resampling.resample_indices`, regrouped by resample). The same `sizes` always give the same
    resamples."""
    per_stratum = [draws.tolist() for draws in resample_indices(sizes, count, seed)]
    return tuple(tuple(tuple(draws[r]) for draws in per_stratum) for r in range(count))


def bootstrap(sizes: Sequence[int], statistic: Statistic, count: int = RESAMPLES, seed: int = SEED
              ) -> Interval | None:
    """The percentile interval of `statistic` over record resamples of strata of `sizes` records. `statistic`
    takes, per stratum, the record indices to use (all of them, in order, for the value itself) and may return
    None where it is undefined (e.g. a change relative to a resampled FullKV score of 0): those resamples are
    left out, and the interval is None when more than half are. None for no records."""
    sizes = tuple(sizes)
    if not sizes or min(sizes) < 1:
        return None
    value = statistic([range(n) for n in sizes])
    if value is None:
        return None
    values = [v for v in (statistic(draw) for draw in resamples(sizes, count, seed)) if v is not None]
    if len(values) < count / 2:
        return None
    return Interval(value, *percentile_interval(values), bootstrap_stderr(values), sum(sizes), min(sizes))


def mean_of(values: Sequence[float]) -> Statistic:
    """The mean of one stratum's per-record `values` (a score, an agreement), as a statistic."""
    return lambda draw: statistics.fmean(values[i] for i in draw[0])


def mean_interval(values: Sequence[float]) -> Interval | None:
    """The mean of per-record values with its interval."""
    return bootstrap([len(values)], mean_of(values))


def change_pct(ours: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]]) -> Statistic:
    """The relative change in percent of the mean over strata of per-stratum means, `ours` against `theirs`
    (FullKV), paired: both sides use the same records of each stratum. None where theirs is 0."""
    def statistic(draw: Sequence[Sequence[int]]) -> float | None:
        a = statistics.fmean(statistics.fmean(values[i] for i in idx) for values, idx in zip(ours, draw, strict=True))
        b = statistics.fmean(statistics.fmean(values[i] for i in idx)
                             for values, idx in zip(theirs, draw, strict=True))
        return None if b == 0 else 100 * (a - b) / b
    return statistic


def mean_over_strata(values: Sequence[Sequence[float]]) -> Statistic:
    """The mean over strata (tasks) of each stratum's mean of per-record values: a mean row."""
    return lambda draw: statistics.fmean(statistics.fmean(v[i] for i in idx) for v, idx in zip(values, draw,
                                                                                                 strict=True))


def pooled(numerators: Sequence[Sequence[float]], denominators: Sequence[Sequence[float]]) -> Statistic:
    """Sum of per-record numerators over sum of denominators across every stratum (e.g. top-1 hits over compared
    steps, every (record, step) weighing the same); None when the denominators sum to 0."""
    def statistic(draw: Sequence[Sequence[int]]) -> float | None:
        total = sum(d[i] for d, idx in zip(denominators, draw, strict=True) for i in idx)
        if not total:
            return None
        return sum(v[i] for v, idx in zip(numerators, draw, strict=True) for i in idx) / total
    return statistic

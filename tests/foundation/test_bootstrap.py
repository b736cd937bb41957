"""The one interval of every accuracy output (scoutbench/analysis/bootstrap.py) against hand computations: the
percentile interval and standard error of known resamples, the bootstrap distribution of a two-record mean, paired
changes, stratified means and pooled per-step means."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from scoutbench import resampling
from scoutbench.analysis import bootstrap


def test_the_interval_is_the_percentiles_and_the_stderr_the_std_of_the_resamples():
    """Four resamples of three records, drawn by hand from the same seeded generator (numpy's, as
    scoutbench/resampling.py seeds it): the interval is the 2.5th and 97.5th percentiles of their means (linear
    interpolation between order statistics) and the standard error their sample standard deviation."""
    values = [10.0, 20.0, 60.0]
    draws = np.random.default_rng(7).integers(0, 3, size=(4, 3)).tolist()
    assert bootstrap.resamples((3,), 4, 7) == tuple((tuple(d),) for d in draws)
    means = sorted(sum(values[i] for i in d) / 3 for d in draws)
    interval = bootstrap.bootstrap([3], bootstrap.mean_of(values), count=4, seed=7)
    # numpy's linear percentile of four values: position q * 3
    assert interval.low == pytest.approx(means[0] + (means[1] - means[0]) * 0.025 * 3)
    assert interval.high == pytest.approx(means[2] + (means[3] - means[2]) * (0.975 * 3 - 2))
    assert interval.stderr == pytest.approx(statistics.stdev(means))
    assert interval.value == pytest.approx(30.0) and interval.n == 3 and interval.few


def test_a_two_record_mean_has_the_bootstrap_distribution_worked_out_by_hand():
    """Records worth 0 and 100: a resample's mean is 0, 50 or 100 with probabilities 1/4, 1/2, 1/4, so the 95%
    interval is [0, 100] and the standard error sqrt(1250) = 35.4 (within the sampling error of 2000 resamples)."""
    interval = bootstrap.mean_interval([0.0, 100.0])
    assert (interval.low, interval.high, interval.value) == (0.0, 100.0, 50.0)
    assert interval.stderr == pytest.approx(math.sqrt(1250), abs=1.5)
    assert not interval.resolved  # as a difference: it spans 0
    # the defaults are fixed: the same numbers on every call and machine
    assert bootstrap.mean_interval([0.0, 100.0]) == interval and resampling.SEED == 0
    assert resampling.RESAMPLES == 2000 and resampling.CONFIDENCE == 0.95 and bootstrap.MIN_RECORDS == 5


def test_constant_records_have_a_zero_width_interval():
    interval = bootstrap.mean_interval([40.0] * 6)
    assert (interval.low, interval.high, interval.stderr, interval.few) == (40.0, 40.0, 0.0, False)
    assert interval.fields("score") == {"score_ci95": [40.0, 40.0], "score_stderr": 0.0}


def test_a_paired_change_resamples_the_same_records_on_both_sides():
    """A method equal to FullKV on every record changes by exactly 0 in every resample (not resolved); one that
    scores 1.2 times FullKV on every record changes by +20% in every resample, however the records vary: paired,
    the records' own spread cancels."""
    fullkv = [0.0, 100.0, 50.0, 50.0, 100.0, 10.0]
    same = bootstrap.bootstrap([6], bootstrap.change_pct([fullkv], [fullkv]))
    assert (same.low, same.high, same.value, same.resolved) == (0.0, 0.0, 0.0, False)
    better = bootstrap.bootstrap([6], bootstrap.change_pct([[1.2 * v for v in fullkv]], [fullkv]))
    assert (better.value, better.low, better.high) == pytest.approx((20.0, 20.0, 20.0))
    assert better.resolved
    # a method better on some records and worse on others: the interval spans 0
    mixed = bootstrap.bootstrap([6], bootstrap.change_pct([[100.0, 0.0, 50.0, 60.0, 90.0, 10.0]], [fullkv]))
    assert mixed.low < 0 < mixed.high and not mixed.resolved
    # where FullKV's resampled mean is 0 the relative change is undefined: those resamples are left out
    assert bootstrap.bootstrap([2], bootstrap.change_pct([[1.0, 0.0]], [[0.0, 0.0]])) is None


def test_a_mean_row_resamples_each_task_on_its_own():
    """Two tasks of constant records (20 and 60) have a mean over tasks of exactly 40 in every resample, whatever
    their sizes; a record-weighted mean would give (3 * 20 + 1 * 60) / 4 = 30 instead."""
    interval = bootstrap.bootstrap([3, 1], bootstrap.mean_over_strata([[20.0] * 3, [60.0]]))
    assert (interval.value, interval.low, interval.high, interval.n, interval.smallest) == (40.0, 40.0, 40.0, 4, 1)
    assert interval.few  # a task of one record: the mean over tasks cannot see that task's spread
    # ... so a difference over it is not resolved, however narrow its interval
    change = bootstrap.bootstrap([6, 1], bootstrap.change_pct([[60.0] * 6, [60.0]], [[50.0] * 6, [50.0]]))
    assert (change.low, change.high) == pytest.approx((20.0, 20.0)) and not change.resolved


def test_a_pooled_mean_weighs_every_step_the_same():
    """Top-1 hits over compared steps: records of 1 hit in 4 steps and 3 hits in 4 steps pool to 4 / 8 = 0.5; a
    resample of the first record twice gives 0.25 and of the second twice 0.75, so the interval is [0.25, 0.75]."""
    interval = bootstrap.bootstrap([2], bootstrap.pooled([[1.0, 3.0]], [[4, 4]]))
    assert (interval.value, interval.low, interval.high) == (0.5, 0.25, 0.75)
    assert bootstrap.bootstrap([1], bootstrap.pooled([[0.0]], [[0]])) is None  # no step compared
    assert bootstrap.bootstrap([], bootstrap.mean_of([])) is None

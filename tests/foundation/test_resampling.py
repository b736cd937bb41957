"""The project's one percentile bootstrap (scoutbench/resampling.py): the throughput's interval over timed steps
and every accuracy interval over records draw the same resamples from it, and its interval and standard error are
the percentiles and the sample standard deviation of a statistic over them."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from scoutbench import resampling, step_stats
from scoutbench.analysis import bootstrap


def test_the_draws_are_one_seeded_generator_over_the_samples_in_order():
    """Per sample, (count, size) indices with replacement from numpy's generator seeded with `seed`, the samples
    drawn one after the other: the same sizes give the same draws on every call."""
    generator = np.random.default_rng(3)
    expected = [generator.integers(0, 4, size=(5, 4)), generator.integers(0, 2, size=(5, 2))]
    drawn = resampling.resample_indices([4, 2], count=5, seed=3)
    assert [d.tolist() for d in drawn] == [e.tolist() for e in expected]
    assert [d.tolist() for d in resampling.resample_indices([4, 2], count=5, seed=3)] == [d.tolist() for d in drawn]
    assert all(d.shape == (resampling.RESAMPLES, 7) for d in resampling.resample_indices([7]))


def test_throughput_and_accuracy_intervals_resample_alike():
    """The timed steps of a throughput and the records of an accuracy figure, as many of each, are resampled by
    the same draws: one definition of the bootstrap, not two generators."""
    steps = [10.0, 11.0, 9.5, 12.0, 10.5, 30.0, 10.2]
    by_steps = step_stats.bootstrap_resamples([steps])[0]
    by_records = bootstrap.resamples((len(steps),))
    assert by_steps.tolist() == [[steps[i] for i in draw[0]] for draw in by_records]
    # the throughput's interval is the accuracy side's interval of the same statistic over the same draws
    tok_s = 1000 / statistics.fmean(steps)
    throughput = bootstrap.bootstrap([len(steps)], lambda draw: 1000 / statistics.fmean(steps[i] for i in draw[0]))
    assert step_stats.throughput_interval([(tok_s, steps)]) == pytest.approx((throughput.low, throughput.high))


def test_the_interval_and_stderr_are_the_percentiles_and_std_of_the_resampled_statistic():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    ordered = sorted(values)
    # numpy's linear percentile: position q * (n - 1) between order statistics
    low = ordered[0] + (ordered[1] - ordered[0]) * 0.025 * 7
    high = ordered[6] + (ordered[7] - ordered[6]) * (0.975 * 7 - 6)
    assert resampling.percentile_interval(values) == pytest.approx((low, high))
    assert resampling.bootstrap_stderr(values) == pytest.approx(statistics.stdev(values))
    assert resampling.bootstrap_stderr([2.0]) == 0.0

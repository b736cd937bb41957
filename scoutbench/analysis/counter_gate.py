"""The counter gate: compare what methods *read and moved* per decode step, not how long it took.

Timing gates on shared CI machines need wide tolerances (2-4x noise, results/baselines/README.md). The work
counters of a seeded run (scoutbench/analysis/work.py: device and host KV bytes, digest/speculation bytes, CPU- and
device-attended tokens, bus bytes each way, recall bytes, linear FLOPs) follow only from the method's choices,
so they are the same on every machine and every rerun: a method that starts reading more fails CI at once,
however noisy the clock. Both kinds are compared: what the work model derives from the run's selections, and
what the method measured itself (`method_stats`, e.g. `h2d_bytes_per_step`, `recall.bytes`: `measured.<field>`),
so that a run whose measured bytes grew (or a result edited to say so) fails even where the model's inputs did
not change. Points match as in the timing gate (scoutbench/analysis/points.py: method and full config, model,
dtype, length, batch, and the run settings: steps, warm-up, seed, prefill, kv_skew, dense layers; a point whose
only counterpart differs in one is MISMATCH, naming it), but on any hardware: the device class is not checked.
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

from scoutbench.analysis.gate import GateReport, Row, mismatch_row
from scoutbench.analysis.points import Point, group_points, mismatched_settings, point_labels
from scoutbench.analysis.work import measured_work, result_shape, step_work, work_problem

DEFAULT_COUNTER_TOLERANCE = 0.01  # selections are deterministic for a seed; 1% absorbs a rare tie broken otherwise


def work_counters(result: dict[str, Any]) -> dict[str, float]:
    """Per-step work counters of one ok throughput result, at the shape it ran at: the work model's, then the
    method's own (`measured_counters`)."""
    return step_work(measured_work(result), result_shape(result)).totals() | measured_counters(result)


# a timing, not a count: a field named with a time unit (cpu_attention_ms, wait_ms_per_step, fetch_wait_ms_per_layer)
_TIMING = re.compile(r"_(ns|us|ms|s)(_|$)")


def measured_counters(result: dict[str, Any]) -> dict[str, float]:
    """What the method counted in the run (`method_stats`): every number but the timings, a list as its sum
    (`per_layer[sum]`), each as `measured.<path>`. Booleans, nulls and text are no counts. A method's own
    counters are deterministic for a seed, as the work model's are."""
    return {path: value for path, value in _measured_values(result).items() if isinstance(value, float)}


def _measured_values(result: dict[str, Any]) -> dict[str, Any]:
    """Every value at a counter's place (`measured.<path>`, `host.<key>`): a float where it is a count, else the
    value as it is (text, a boolean, a list that is not all numbers), which `counter_problems` compares. A null
    is a count not recorded (CUDA graph replays off CUDA): left out, as an absent field is."""
    values: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if _TIMING.search(path.rsplit(".", 1)[-1]):
            return
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}")
        elif isinstance(value, list):
            entries = [v for v in value if v is not None]  # null: a layer without the count (a dense layer)
            if entries and all(_is_count(v) for v in entries):
                values[f"{path}[sum]"] = float(sum(entries))
            elif entries:
                values[f"{path}[sum]"] = value
        elif value is not None:
            values[path] = float(value) if _is_count(value) else value

    stats = result.get("method_stats")
    if isinstance(stats, dict):
        for key, value in stats.items():
            walk(value, f"measured.{key}")
    # the host side: torch calls (and CUDA graph replays) the main thread issued per step, as deterministic as the
    # rest for a seed and a code path: a step that starts issuing more calls fails, as one that reads more bytes
    host = result.get("host")
    if isinstance(host, dict):
        for key in ("torch_calls_per_step", "graph_replays_per_step"):
            if host.get(key) is not None:
                values[f"host.{key}"] = float(host[key]) if _is_count(host[key]) else host[key]
    return values


def counter_problems(baseline: list[dict[str, Any]], current: list[dict[str, Any]]) -> dict[str, str]:
    """Counters that cannot be compared, by name, and why: a count below zero (bytes, tokens and calls are never
    negative: -1 bytes passed as "improved"), or a count on one side that is no number on the other (a string
    was dropped from the comparison, 26 comparisons instead of 32, exit 0). A counter absent or null on one side
    (a field an older scoutbench did not record, a count of another device) is no problem: it is not compared."""
    problems: dict[str, str] = {}
    sides = {"baseline": [_measured_values(r) | work_counters(r) for r in baseline],
             "current": [_measured_values(r) | work_counters(r) for r in current]}
    counted = {name for runs in sides.values() for values in runs for name, v in values.items()
               if isinstance(v, float)}
    for side, runs in sides.items():
        for values in runs:
            for name in sorted(counted & set(values)):
                value = values[name]
                if isinstance(value, float) and value < 0:
                    problems.setdefault(name, f"{value:g} in the {side} run: a count is never negative")
                elif not isinstance(value, float):
                    problems.setdefault(name, f"{value!r} in the {side} run where the other side counts a number")
    return problems


def _is_count(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _median_counters(point: Point) -> dict[str, float]:
    """Each counter's median over the point's runs (the counters every run has: an older result may lack a
    measured field a newer scoutbench records)."""
    per_run = [work_counters(r) for r in point.ok]
    names = [name for name in per_run[0] if all(name in c for c in per_run)] if per_run else []
    return {name: statistics.median(c[name] for c in per_run) for name in names}


def counter_gate(baseline_results: list[dict[str, Any]], current_results: list[dict[str, Any]],
                 tolerance: float = DEFAULT_COUNTER_TOLERANCE, allow_missing: bool = False) -> GateReport:
    """Every baseline throughput point's counters against the current run's: more work than the baseline by more
    than `tolerance` is REGRESSED, less is `improved` (refresh the baseline), a missing point fails, and so does
    a point run with other settings (MISMATCH)."""
    keep = [r for r in baseline_results if r.get("kind") == "throughput"]
    current = [r for r in current_results if r.get("kind") == "throughput"]
    baseline_points, current_points = group_points(keep), group_points(current)
    labels = point_labels([*keep, *current])
    differing = mismatched_settings(baseline_points, current_points)
    report = GateReport()
    for key in sorted(baseline_points, key=lambda k: k.sort_key()):
        base = baseline_points[key]
        if not base.ok:
            report.rows.append(Row(key.describe(labels.get(key)), "work counters", None, None, tolerance, "skipped",
                                   f"baseline failed: {base.error()}"))
            continue
        name = key.describe(labels.get(key))
        if key in differing:
            report.rows.append(mismatch_row(name, "work counters", differing[key]))
            continue
        cur = current_points.get(key)
        if cur is None or not cur.ok:
            verdict = "FAILED" if cur is not None else ("skipped" if allow_missing else "MISSING")
            report.rows.append(Row(name, "work counters", None, None, tolerance, verdict,
                                   cur.error() if cur is not None else "not in current run"))
            continue
        problem = next((p for r in [*base.ok, *cur.ok] if (p := work_problem(r)) is not None), None)
        if problem is not None:
            report.rows.append(Row(name, "work counters", None, None, tolerance, "INVALID", problem))
            continue
        base_counters, cur_counters = _median_counters(base), _median_counters(cur)
        for counter, why in sorted(counter_problems(base.ok, cur.ok).items()):
            report.rows.append(Row(name, counter, base_counters.pop(counter, None), cur_counters.pop(counter, None),
                                   tolerance, "INVALID", why))
        unrecorded = sorted(set(base_counters) - set(cur_counters))
        if unrecorded:  # a field this scoutbench no longer records (or a null): listed, never dropped in silence
            report.warnings.append(f"{name}: {len(unrecorded)} baseline counter(s) not recorded in the current run, "
                                   f"not compared: {', '.join(unrecorded)}")
        for counter, base_value in base_counters.items():
            if counter not in cur_counters:
                continue
            value = cur_counters[counter]
            if not (math.isfinite(base_value) and math.isfinite(value)):
                report.rows.append(Row(name, counter, base_value, value, tolerance, "INVALID",
                                       "a counter that is not finite is not a measurement"))
                continue
            if value > base_value * (1 + tolerance) + 1e-9:
                verdict = "REGRESSED"
            elif value < base_value * (1 - tolerance) - 1e-9:
                verdict = "improved"
            else:
                verdict = "ok"
            report.rows.append(Row(name, counter, base_value, value, tolerance, verdict))
    explained = {k.comparable_part() for k in differing}
    new = [k for k in set(current_points) - set(baseline_points) if k.comparable_part() not in explained]
    if new:
        report.warnings.append(f"{len(new)} current point(s) have no baseline: "
                               + ", ".join(sorted(k.describe(labels.get(k)) for k in new)))
    return report

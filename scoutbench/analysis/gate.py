"""Performance gates: compare a current run with a baseline, or methods with each other within one run.

Points match as the result-point model says (scoutbench/analysis/points.py: kind, method and its full config, model,
dtype, length, batch, and every other setting that changes the measurement); a baseline point whose only match
differs in such a setting is refused as MISMATCH, naming the setting, never compared. The device class is checked
separately so that numbers from different hardware are refused instead of silently "missing". Repeats of one
point are summarised by their median. Verdicts: a metric regresses when it is worse than the baseline by more than
its tolerance (throughput and accuracy: higher is better; step time: lower is better); a non-finite metric, or a
throughput or step time that is not positive, is INVALID (never "ok"); a baseline point absent from the current
run fails the gate (a crashed benchmark must not pass as "nothing regressed") unless missing points are explicitly
allowed; and a gate that compared nothing fails.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from scoutbench.analysis.points import (
    THROUGHPUT_METRICS,
    Point,
    PointKey,
    batch_text,
    canonical_method,
    group_points,
    metric_values,
    mismatched_settings,
    point_labels,
    shared_settings,
)
from scoutbench.errors import ScoutbenchError, UsageError
from scoutbench.units import format_length, parse_fraction

DEFAULT_RATIO_METRIC = "decode_throughput_tok_s"


# ---- tolerances and ratio gates -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tolerances:
    default: float
    per_metric: dict[str, float]

    def of(self, metric: str) -> float:
        return self.per_metric.get(metric, self.default)


def parse_tolerances(specs: Iterable[str], default: str = "5%") -> Tolerances:
    """`5%` sets the default; `decode_step_ms=10%` one metric's."""
    value = _fraction(default)
    per_metric: dict[str, float] = {}
    for spec in specs:
        name, sep, amount = spec.rpartition("=")
        if sep:
            if not name.strip():
                raise UsageError(f"bad --tolerance {spec!r}: use 5% or METRIC=5%")
            per_metric[name.strip()] = _fraction(amount)
        else:
            value = _fraction(amount)
    return Tolerances(value, per_metric)


def _fraction(text: str) -> float:
    """5% or 0.05; 100% or more could never fail a higher-is-better metric, so it is refused (parse_fraction)."""
    return parse_fraction(text, "--tolerance")


_OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le, ">": operator.gt,
                                                    "<": operator.lt}
_RATIO_RE = re.compile(r"^\s*(?:(?P<metric>[\w.:-]+):)?(?P<num>[\w.+-]+)\s*/\s*(?P<den>[\w.+-]+)\s*"
                       r"(?P<op>>=|<=|>|<)\s*(?P<value>\d+(?:\.\d+)?)\s*x?\s*$")


@dataclass(frozen=True)
class RatioGate:
    """`scout/fullkv>=3`: metric(numerator) / metric(denominator) compared with a bound, within one run."""

    numerator: str
    denominator: str
    op: str
    bound: float
    metric: str = DEFAULT_RATIO_METRIC

    def __str__(self) -> str:
        prefix = "" if self.metric == DEFAULT_RATIO_METRIC else f"{self.metric}:"
        return f"{prefix}{self.numerator}/{self.denominator}{self.op}{self.bound:g}"

    def holds(self, ratio: float) -> bool:
        return _OPS[self.op](ratio, self.bound)


def parse_ratio(spec: str) -> RatioGate:
    match = _RATIO_RE.match(spec)
    if not match:
        raise UsageError(f"bad --ratio {spec!r}: use NUM/DEN>=X, e.g. scout/fullkv>=3 "
                         "(optionally METRIC: first, e.g. decode_step_ms:scout/fullkv<=0.5)")
    return RatioGate(canonical_method(match["num"]), canonical_method(match["den"]), match["op"],
                     float(match["value"]), match["metric"] or DEFAULT_RATIO_METRIC)


# ---- comparison -----------------------------------------------------------------------------------------------

# verdicts that mean a real comparison of two measured values took place
COMPARED = ("ok", "improved", "REGRESSED")
FAILING = ("REGRESSED", "MISSING", "FAILED", "INVALID", "MISMATCH")


@dataclass
class Row:
    """One line of the gate table."""

    point: str
    metric: str
    baseline: float | None
    current: float | None
    tolerance: float | None
    verdict: str  # ok | improved | REGRESSED | MISSING | FAILED | INVALID | MISMATCH | new | skipped
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.baseline and self.current is not None and math.isfinite(self.baseline):
            return self.current / self.baseline
        return None

    @property
    def fails(self) -> bool:
        return self.verdict in FAILING

    @property
    def compared(self) -> bool:
        return self.verdict in COMPARED


@dataclass
class GateReport:
    rows: list[Row] = field(default_factory=list)
    ratio_rows: list[Row] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Row]:
        return [r for r in [*self.rows, *self.ratio_rows] if r.fails]

    @property
    def comparisons(self) -> int:
        """Rows that compared two measured values (ratio checks included): what a pass rests on."""
        return sum(r.compared for r in [*self.rows, *self.ratio_rows])

    @property
    def passed(self) -> bool:
        return not self.failures and self.comparisons > 0


def check_hardware(baseline: dict[PointKey, Point], current: dict[PointKey, Point]) -> str | None:
    """A message when the two sides were measured on different device classes, else None."""
    pairs = [(baseline[k].device_classes, current[k].device_classes) for k in baseline.keys() & current.keys()]
    if not pairs:  # nothing matched: compare the sides as wholes so the refusal still names the hardware
        pairs = [({c for p in baseline.values() for c in p.device_classes},
                  {c for p in current.values() for c in p.device_classes})]
    for base_classes, cur_classes in pairs:
        if base_classes != cur_classes:
            return (f"baseline measured on {', '.join(sorted(base_classes))} but current on "
                    f"{', '.join(sorted(cur_classes))}: absolute numbers are not comparable across hardware. "
                    "Use a baseline from this machine, a relative --ratio gate, or --force to compare anyway")
    return None




def mismatch_row(name: str, metric: str, difference: str) -> Row:
    return Row(name, metric, None, None, None, "MISMATCH",
               f"not comparable: {difference}; rerun with the baseline's settings or refresh the baseline")


def compare(baseline_results: list[dict[str, Any]], current_results: list[dict[str, Any]],
            tolerances: Tolerances, metrics: set[str] | None = None, force: bool = False,
            allow_missing: bool = False) -> GateReport:
    """Every baseline point against the matching current point, metric by metric."""
    report = GateReport()
    baseline_results = _gated_kinds(baseline_results, "baseline", report)
    current_results = _gated_kinds(current_results, "current", report)
    baseline, current = group_points(baseline_results), group_points(current_results)
    mismatch = check_hardware(baseline, current)
    if mismatch:
        if not force:
            raise UsageError(mismatch)
        report.warnings.append(f"--force: {mismatch.split(': absolute')[0]}")
    _check_metric_names(tolerances, metrics, [*baseline_results, *current_results])
    labels = point_labels([*baseline_results, *current_results])
    differing = mismatched_settings(baseline, current)
    explained = {k.comparable_part() for k in differing}
    for key in sorted(baseline.keys() | current.keys(), key=PointKey.sort_key):
        name = key.describe(labels.get(key))
        base, cur = baseline.get(key), current.get(key)
        if base is None:
            if key.comparable_part() not in explained:
                report.rows.append(Row(name, "-", None, None, None, "new", "no baseline point"))
            continue
        if not base.ok:
            report.rows.append(Row(name, "-", None, None, None, "skipped", f"baseline failed: {base.error()}"))
            continue
        if key in differing:
            report.rows.append(mismatch_row(name, "-", differing[key]))
            continue
        if cur is None or not cur.ok:
            verdict = "MISSING" if cur is None else "FAILED"
            note = "not in current run" if cur is None else cur.error()
            if allow_missing and cur is None:
                verdict, note = "skipped", "not in current run (--allow-missing)"
            report.rows.append(Row(name, "-", None, None, None, verdict, note))
            continue
        base_metrics, cur_metrics = base.metrics(), cur.metrics()
        base_invalid, cur_invalid = base.invalid(), cur.invalid()
        if not base_metrics and not base_invalid:
            report.rows.append(Row(name, "-", None, None, None, "skipped", "the baseline point has no gated metric"))
            continue
        for metric in sorted(base_metrics.keys() | base_invalid.keys()):
            if metrics is not None and metric not in metrics:
                continue
            tol = tolerances.of(metric)
            if metric in base_invalid:
                report.rows.append(Row(name, metric, None, None, tol, "INVALID",
                                       f"baseline {base_invalid[metric]}; refresh the baseline"))
                continue
            base_value, higher = base_metrics[metric]
            if metric in cur_invalid:
                report.rows.append(Row(name, metric, base_value, None, tol, "INVALID", f"current {cur_invalid[metric]}"))
                continue
            if metric not in cur_metrics:
                report.rows.append(Row(name, metric, base_value, None, tol, "MISSING", "metric absent in current"))
                continue
            cur_value = cur_metrics[metric][0]
            report.rows.append(Row(name, metric, base_value, cur_value, tol, _verdict(base_value, cur_value, higher, tol),
                                   _repeats_note(base, cur)))
    _warn_env(baseline_results, current_results, report)
    return report


GATED_KINDS = ("throughput", "accuracy")


def _gated_kinds(results: list[dict[str, Any]], side: str, report: GateReport) -> list[dict[str, Any]]:
    """The results the timing gate has metrics for; other kinds (projections, ...) are named in a warning."""
    others = sorted({str(r.get("kind")) for r in results if r.get("kind") not in GATED_KINDS})
    if others:
        report.warnings.append(f"{side}: ignored the results of kind {', '.join(others)} (no gated metrics)")
    return [r for r in results if r.get("kind") in GATED_KINDS]


def _verdict(base: float, cur: float, higher_is_better: bool, tolerance: float) -> str:
    if higher_is_better:
        worse, better = cur < base * (1 - tolerance), cur > base * (1 + tolerance)
    else:
        worse, better = cur > base * (1 + tolerance), cur < base * (1 - tolerance)
    return "REGRESSED" if worse else "improved" if better else "ok"


def _repeats_note(base: Point, cur: Point) -> str:
    """`median of 1 vs 3 runs`; for --batch auto points also the batches the plan chose when they differ (the
    same point: each method at its largest batch, but the throughputs are of other batches)."""
    counts = (len(base.ok), len(cur.ok))
    notes = [f"median of {counts[0]} vs {counts[1]} runs"] if counts != (1, 1) else []
    if base.key.batch == "auto":
        used = [sorted({str((r.get("workload") or {}).get("batch")) for r in p.ok}) for p in (base, cur)]
        if used[0] != used[1]:
            notes.append(f"--batch auto ran at {'/'.join(used[0])} in the baseline vs {'/'.join(used[1])} now")
    return "; ".join(notes)




def _check_metric_names(tolerances: Tolerances, metrics: set[str] | None, results: list[dict[str, Any]]) -> None:
    known = {name for r in results for name in metric_values(r)} | set(THROUGHPUT_METRICS)
    for name in [*tolerances.per_metric, *(metrics or ())]:
        if name not in known:
            raise UsageError(f"unknown metric {name!r}: the results have {', '.join(sorted(known))}")


def _warn_env(baseline: list[dict[str, Any]], current: list[dict[str, Any]], report: GateReport) -> None:
    for name in ("torch", "transformers"):
        seen = {side: {str((r.get("env") or {}).get(name)) for r in results if r.get("env")}
                for side, results in (("baseline", baseline), ("current", current))}
        if seen["baseline"] and seen["current"] and seen["baseline"] != seen["current"]:
            report.warnings.append(f"{name} differs: baseline {', '.join(sorted(seen['baseline']))}, "
                                   f"current {', '.join(sorted(seen['current']))}")


def ratio_rows(gate: RatioGate, current_results: list[dict[str, Any]],
               baseline_results: list[dict[str, Any]] | None = None) -> list[Row]:
    """Check `gate` in every group (model, dtype, length, batch, run settings, device) that has both methods."""
    cur = _ratios(gate, current_results)
    base = _ratios(gate, baseline_results or [])
    if not cur:
        return [Row(str(gate), gate.metric, None, None, None, "MISSING",
                    f"no point of the current run has both {gate.numerator} and {gate.denominator} "
                    f"with {gate.metric}")]
    rows = []
    for group, (ratio, problem) in sorted(cur.items()):
        reference = base.get(group, (None, None))[0]
        if problem:
            rows.append(Row(f"{gate} @ {group}", gate.metric, reference, None, None, "INVALID", problem))
            continue
        verdict = "ok" if gate.holds(ratio) else "REGRESSED"
        rows.append(Row(f"{gate} @ {group}", gate.metric, reference, ratio, None, verdict,
                        f"needs {gate.op}{gate.bound:g}"))
    return rows


def _ratios(gate: RatioGate, results: list[dict[str, Any]]) -> dict[str, tuple[float | None, str | None]]:
    """group description -> (ratio, None), or (None, why) when a side's metric is not a measurement; with several
    configs of one method, every pair is its own entry. Points with other run settings are other groups."""
    by_group: dict[tuple, dict[PointKey, Point]] = defaultdict(dict)
    for key, point in group_points(results).items():
        if point.ok and key.method in (gate.numerator, gate.denominator):
            classes = ",".join(sorted(point.device_classes))
            by_group[(key.model, key.dtype, key.length or 0, key.batch, shared_settings(key), classes)][key] = point
    labels = point_labels(results)
    several_devices = len({group[5] for group in by_group}) > 1
    several_settings = len({group[4] for group in by_group}) > 1
    out: dict[str, tuple[float | None, str | None]] = {}
    for (model, dtype, length, batch, settings, classes), points in sorted(by_group.items(), key=lambda g: str(g[0])):
        nums = [(k, p) for k, p in points.items() if k.method == gate.numerator]
        dens = [(k, p) for k, p in points.items() if k.method == gate.denominator]
        for num_key, num in nums:
            for den_key, den in dens:
                pair = f"{labels[num_key]}/{labels[den_key]}" if len(nums) > 1 or len(dens) > 1 else ""
                where = f"{model} {dtype} len {format_length(length)} {batch_text(batch)}" + (f" {pair}" if pair else "") \
                    + (f" {_settings_text(settings)}" if several_settings else "") \
                    + (f" on {classes}" if several_devices else "")
                problems = [f"{side} {p.invalid()[gate.metric]}" for side, p in ((gate.numerator, num),
                                                                                  (gate.denominator, den))
                            if gate.metric in p.invalid()]
                if problems:
                    out[where] = (None, "; ".join(problems))
                    continue
                num_value, den_value = num.metrics().get(gate.metric), den.metrics().get(gate.metric)
                if num_value is None or den_value is None:
                    continue
                if den_value[0] == 0:
                    out[where] = (None, f"{gate.denominator} {gate.metric} is 0: no ratio")
                    continue
                out[where] = (num_value[0] / den_value[0], None)
    return out


def _settings_text(settings: str) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(json.loads(settings).items()))


def check_ratio_names(gate: RatioGate, results: list[dict[str, Any]]) -> None:
    """A method or metric name in a --ratio that neither the registry nor the results know is a typo: a usage
    error (exit 2) with a did-you-mean, never a MISSING row that reads as a regression (exit 1)."""
    import difflib

    from scoutbench.methods import METHODS

    present = {canonical_method(str(r.get("method"))) for r in results}
    known = present | set(METHODS.names())
    for name in (gate.numerator, gate.denominator):
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"--ratio {gate}: unknown method {name!r}{hint} (the current run has "
                             f"{', '.join(sorted(present))})")
    metrics = {name for r in results for name in metric_values(r)} | set(THROUGHPUT_METRICS)
    if gate.metric not in metrics:
        close = difflib.get_close_matches(gate.metric, sorted(metrics), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"--ratio {gate}: unknown metric {gate.metric!r}{hint} (known: {', '.join(sorted(metrics))})")


def run_gate(baseline_results: list[dict[str, Any]] | None, current_results: list[dict[str, Any]],
             tolerances: Tolerances, ratios: list[RatioGate], metrics: set[str] | None = None,
             force: bool = False, allow_missing: bool = False) -> GateReport:
    if baseline_results is None and not ratios:
        raise UsageError("nothing to check: pass --baseline for an absolute comparison and/or --ratio A/B>=X")
    for gate in ratios:
        check_ratio_names(gate, current_results)
    report = GateReport()
    if baseline_results is not None:
        report = compare(baseline_results, current_results, tolerances, metrics, force, allow_missing)
    for gate in ratios:
        report.ratio_rows.extend(ratio_rows(gate, current_results, baseline_results))
    return report


def load_side(paths: Iterable[str], side: str,
              on_skip: Callable[[Any, str], None] | None = None) -> list[dict[str, Any]]:
    """Results of one side; unreadable or malformed files go to `on_skip` (listed by the gate), and a side with no
    usable result is a usage error (exit 2), never a vacuous pass."""
    from scoutbench.results import load_results

    paths = list(paths)
    results = load_results(paths, on_skip=on_skip)
    if not results:
        raise UsageError(f"--{side} {' '.join(paths)}: no usable result files found")
    return results


def fail_if_regressed(report: GateReport, what: str = "gate") -> None:
    """Exit 1 on any failing row, and when nothing was compared at all: a gate that compared no point (every
    baseline point missing and allowed to be, baseline points all failed, no ratio group) must not pass."""
    if report.failures:
        counts: dict[str, int] = defaultdict(int)
        for row in report.failures:
            counts[row.verdict.lower()] += 1
        summary = ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))
        raise ScoutbenchError(f"{what} failed: {summary}")
    if report.comparisons == 0:
        skipped = sum(r.verdict == "skipped" for r in report.rows)
        new = sum(r.verdict == "new" for r in report.rows)
        raise ScoutbenchError(f"{what} failed: it compared nothing ({skipped} baseline point(s) skipped, {new} "
                              "current point(s) without a baseline); a gate must compare at least one point")


def passed_message(report: GateReport, what: str = "gate") -> str:
    """`gate passed (4 comparisons, 1 ratio check; 2 skipped)`: only real comparisons are counted."""
    rows = sum(r.compared for r in report.rows)
    ratios = sum(r.compared for r in report.ratio_rows)
    skipped = sum(r.verdict == "skipped" for r in report.rows)
    text = f"{what} passed ({rows} comparisons" + (f", {ratios} ratio checks" if report.ratio_rows else "")
    return text + (f"; {skipped} skipped)" if skipped else ")")

"""`scoutbench report`: the paper's figures and a markdown summary from any mix of result files.

Figures (`analysis/figures/`): throughput vs input length per method (paper Figure 8), throughput vs batch size
(Figure 9), ScoutAttention throughput vs block size (Figure 10), stacked latency breakdown with idle time (Figure
11), the ablation bars with speed-up labels (Figure 12) and accuracy vs token budget, as PNG and vector files. A
figure is drawn wherever the results have the points it needs; everything that is not used (unreadable files,
failed points, other kinds, metrics that are not measurements, figures without enough points) is listed with the
reason, so an empty-looking report explains itself. Repeats of one point are merged: every number shown is the
median over the repeats (as the gate does). A file a point's run was given or made for it (a method's
`artefact_fields`: ScoutAttention's recall profile) neither labels nor splits a series.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scoutbench.analysis.bootstrap import MIN_RECORDS
from scoutbench.analysis.figures import (
    DEFAULT_FIGURE_FORMATS,
    FIGURE_FORMATS,
    FIGURE_STEMS,
    FigureWriter,
    ablation_groups,
    comparison_group,
    draw_all,
    variant_labels,
)
from scoutbench.analysis.figures.comparison import comparisons
from scoutbench.analysis.points import (
    PointKey,
    as_number,
    batch_order,
    canonical_method,
    device_class,
    metric_problem,
    metric_values,
    point_key,
    point_labels,
)
from scoutbench.errors import UsageError, require_module
from scoutbench.step_stats import THROUGHPUT_DEFINITION, speedup_interval, throughput_interval
from scoutbench.tiers import wait_frac
from scoutbench.units import format_length


@dataclass
class Point:
    """One ok throughput measurement (all its repeats on one device), flattened for plotting: every number is the
    median over the repeats."""

    key: PointKey
    runs: list[dict[str, Any]]
    label: str = ""
    _speedups: dict[PointKey, tuple[float, tuple[float, float] | None]] = field(default_factory=dict, repr=False)

    @property
    def result(self) -> dict[str, Any]:
        """The first run: what the repeats share (method config, device, model)."""
        return self.runs[0]

    @property
    def method(self) -> str:
        return self.key.method

    @property
    def config(self) -> dict[str, Any]:
        return self.result.get("method_config") or {}

    @property
    def tok_s(self) -> float:
        """Throughput as every table, figure and export gives it: tokens over the total timed decode time
        (`decode_throughput_tok_s`), the median over the repeats."""
        return statistics.median(float(r["decode_throughput_tok_s"]) for r in self.runs)

    def throughput_samples(self) -> list[tuple[float, list[float]]] | None:
        """(tok/s, timed steps in ms) of each repeat, what the throughput's interval resamples; None when a repeat
        has no steps that are all measurements (a hand-made or summarised result)."""
        samples = []
        for r in self.runs:
            steps = r.get("step_ms")
            if not isinstance(steps, list) or not steps or not all(
                    (v := as_number(x)) is not None and math.isfinite(v) and v > 0 for x in steps):
                return None
            samples.append((float(r["decode_throughput_tok_s"]), [float(x) for x in steps]))
        return samples

    @functools.cached_property
    def tok_s_interval(self) -> tuple[float, float] | None:
        """The 95% bootstrap interval of `tok_s` over the timed steps (step_stats.throughput_interval)."""
        samples = self.throughput_samples()
        return None if samples is None else throughput_interval(samples)

    def speedup(self, reference: Point) -> tuple[float, tuple[float, float] | None]:
        """tok/s over `reference`'s (the summary's `vs fullkv`, the speed-up figure's bar) and the ratio's 95%
        bootstrap interval over both points' timed steps (computed once per reference)."""
        if reference.key == self.key:  # FullKV against itself: 1 by definition, no interval
            return 1.0, None
        if reference.key not in self._speedups:
            value = self.tok_s / reference.tok_s
            samples, base = self.throughput_samples(), reference.throughput_samples()
            interval = None if samples is None or base is None else speedup_interval(samples, base)
            self._speedups[reference.key] = (value, None if interval is None
                                             else (min(interval[0], value), max(interval[1], value)))
        return self._speedups[reference.key]

    @property
    def step_ms(self) -> float:
        return statistics.median(float(r["decode_step_ms"]["median"]) for r in self.runs)

    @property
    def batch_used(self) -> int:
        """The batch the runs decoded (with --batch auto, the planned one; the median over repeats)."""
        return int(statistics.median(int(r["workload"]["batch"]) for r in self.runs))

    @property
    def wait_frac(self) -> float | None:
        values = [v for r in self.runs if isinstance(v := wait_frac(r), (int, float))]
        return statistics.median(values) if values else None

    @property
    def on_gpu(self) -> bool:
        return self.result.get("gpu_idle_frac") is not None

    @property
    def on_cuda(self) -> bool:
        """Whether the run's device was a GPU (its stages are named for one), from its device or its tiers."""
        device = self.result.get("device") if isinstance(self.result.get("device"), dict) else {}
        tiers = self.result.get("tiers") if isinstance(self.result.get("tiers"), dict) else {}
        return device.get("type") == "cuda" or tiers.get("device") == "cuda"

    def breakdown_ms(self) -> dict[str, float] | None:
        """The per-stage median over the repeats that recorded a breakdown (None when none did)."""
        with_breakdown = [r["latency_breakdown_ms"] for r in self.runs if isinstance(r.get("latency_breakdown_ms"), dict)]
        if not with_breakdown:
            return None
        stages = {stage for b in with_breakdown for stage in b}
        return {stage: statistics.median(_float(b.get(stage)) for b in with_breakdown) for stage in stages}

    @property
    def device(self) -> str:
        return device_class(self.result)

    @property
    def variant(self) -> str | None:
        """The ablation variant of the run (ScoutAttention's Figure 12: from its pc/pr fields, its registry
        preset and its defaults), as its method class declares them; None for a method without variants."""
        from scoutbench.methods import ablation_variant

        return ablation_variant(self.method, self.config)


def _float(value: Any) -> float:
    """A breakdown stage as a number (0 for a stage a run did not record or recorded as something else)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        else 0.0


@dataclass
class Report:
    points: list[Point] = field(default_factory=list)
    accuracy: list[dict[str, Any]] = field(default_factory=list)
    projections: list[dict[str, Any]] = field(default_factory=list)  # `scoutbench project -o` documents
    failed: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (what, why)
    merged: list[tuple[str, str]] = field(default_factory=list)  # (file, which point's median it is part of)
    figures: list[tuple[str, list[Path]]] = field(default_factory=list)  # (title, its file in each format)
    drawn: dict[PointKey, list[str]] = field(default_factory=dict)  # point -> the figures (stems) that show it
    summary: Path | None = None


def collect(paths: Iterable[str | Path]) -> Report:
    """Read every result under `paths`; keep what a figure or table can use and say why the rest was skipped."""
    from scoutbench.results import load_results

    report = Report()
    ok: list[dict[str, Any]] = []
    for result in load_results(paths, on_skip=lambda file, why: report.skipped.append((str(file), why))):
        kind, status = result.get("kind"), result.get("status", "ok")
        if status != "ok":
            report.failed.append(result)
            report.skipped.append((result["_path"], f"status {status}: {result.get('error')}"))
        elif kind == "accuracy":
            report.accuracy.append(result)
        elif kind == "projection":
            report.projections.append(result)
        elif kind != "throughput":
            report.skipped.append((result["_path"], f"kind {kind!r} has no figure or table here"))
        elif (problem := _measurement_problem(result)) is not None:
            report.skipped.append((result["_path"], problem))
        else:
            ok.append(_without_artefacts(result))
    report.points = _median_runs(ok, report)
    labels = point_labels([r for p in report.points for r in p.runs])
    for p in report.points:
        p.label = labels[p.key]
    return report


def _without_artefacts(result: dict[str, Any]) -> dict[str, Any]:
    """The result as the report compares it: its method config without the fields that name a per-point file."""
    from scoutbench.methods import artefact_fields

    config = result.get("method_config")
    if not isinstance(config, dict):
        return result
    artefacts = artefact_fields(canonical_method(str(result.get("method"))))
    return {**result, "method_config": {k: v for k, v in config.items() if k not in artefacts}}


def _measurement_problem(result: dict[str, Any]) -> str | None:
    """Why an ok throughput result cannot be plotted: a throughput or step time missing or not a measurement."""
    values = metric_values(result)
    for name in ("decode_throughput_tok_s", "decode_step_ms"):
        if name not in values:
            return f"throughput result without {name}"
        problem = metric_problem(name, values[name][0])
        if problem is not None:
            return problem
    return None


def _median_runs(results: list[dict[str, Any]], report: Report) -> list[Point]:
    """Repeats of one measurement (same point, same device) are merged into one point whose numbers are the median
    over the repeats (for an even count, the mean of the middle two, as `statistics.median` and the gate)."""
    repeats: dict[tuple[PointKey, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        repeats[(point_key(r), device_class(r))].append(r)
    points = []
    for (key, _), runs in repeats.items():
        points.append(Point(key, runs))
        if len(runs) > 1:
            for r in runs:
                report.merged.append((r["_path"], f"one of {len(runs)} repeats of {runs[0]['method']} "
                                                  f"{key.describe()}: the median of {len(runs)} runs is shown"))
    return points


# ---- the report ------------------------------------------------------------------------------------------------

def build_report(paths: Iterable[str | Path], out_dir: str | Path, overwrite: bool = False,
                 formats: tuple[str, ...] = DEFAULT_FIGURE_FORMATS) -> Report:
    """Figures (in `formats`) and summary.md of the results under `paths`, written into `out_dir`. A folder that
    holds an earlier report is refused unless `overwrite`; then the earlier report's files are replaced as a
    whole, so no figure of the previous results stays beside the new summary. Everything is drawn into a staging
    folder first: a failure leaves the earlier report as it was."""
    from scoutbench.results import check_writable, output_lock

    require_module("matplotlib", "report", "scoutbench report (its figures)")
    out = Path(out_dir)
    check_writable(out, single_file=False)  # an unwritable folder: exit 1, as for every other command's -o
    _refuse_earlier_report(out, overwrite)
    with output_lock(out):
        _refuse_earlier_report(out, overwrite)  # a report that finished while this one waited for nothing
        report = collect(paths)
        staging = Path(tempfile.mkdtemp(prefix=".report-", dir=out))
        try:
            draw_all(report, FigureWriter(report, staging, formats))
            (staging / "summary.md").write_text(summary_markdown(report), encoding="utf-8", errors="backslashreplace")
            for earlier in report_files(out):
                earlier.unlink()
            for made in sorted(staging.iterdir()):
                os.replace(made, out / made.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    report.figures = [(title, [out / f.name for f in files]) for title, files in report.figures]
    report.summary = out / "summary.md"
    return report


_REPORT_FILE = re.compile(rf"^(?:{'|'.join(map(re.escape, FIGURE_STEMS))})(?:_[^/]*)?\.(?:{'|'.join(FIGURE_FORMATS)})$")


def report_files(folder: Path) -> list[Path]:
    """The files of a report in `folder`: summary.md and the figures (by their stems and formats)."""
    if not folder.is_dir():
        return []
    return sorted(f for f in folder.iterdir() if f.is_file() and (f.name == "summary.md" or _REPORT_FILE.match(f.name)))


def _refuse_earlier_report(out: Path, overwrite: bool) -> None:
    earlier = report_files(out)
    if earlier and not overwrite:
        names = ", ".join(f.name for f in earlier[:3]) + (f" and {len(earlier) - 3} more" if len(earlier) > 3 else "")
        raise UsageError(f"{out} already holds a report ({names}); pass --overwrite to replace it or choose another -o")


def _method_rank(method: str) -> int:
    from scoutbench.methods import display_rank

    return display_rank(method)


# ---- markdown -------------------------------------------------------------------------------------------------

def summary_markdown(report: Report) -> str:
    from scoutbench.methods import setting_text

    lines = ["# scoutbench report", "",
             f"{len(report.points)} throughput points, {len(report.accuracy)} accuracy results, "
             f"{len(report.projections)} projections, "
             f"{len(report.failed)} failed, {len(report.skipped)} items skipped.", ""]
    if report.points:
        lines += ["## Throughput", "",
                  f"{THROUGHPUT_DEFINITION} `tok/s 95% CI` is its bootstrap interval over the timed steps; "
                  "`median step ms` is the median step and `median step 95% CI` the median's distribution-free "
                  "interval (two of the measured steps), where the run stored one. `vs fullkv` compares tok/s with "
                  "FullKV's at the same point and settings (the speed-up figures show the same ratio); where the "
                  "two ran at different batches (`--batch auto`), it also gives the per-sequence ratio (`/seq`). "
                  "Repeats are merged: every number is the median over the `runs`. `setting` is the row's point on "
                  "its method's grid (docs/methods.md: one rule for every method's defaults), the paper-literal "
                  "point beside it.", "",
                  "| method | setting | model | dtype | len | batch | tok/s | tok/s 95% CI | median step ms "
                  "| median step 95% CI | idle/wait % | vs fullkv | runs | prefill | device |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        references = {group: c.reference for group, c in comparisons(report.points).items()}
        for p in sorted(report.points, key=lambda p: (p.key.model, p.key.dtype, p.key.length or 0,
                                                      batch_order(p.key.batch), _method_rank(p.method), p.label)):
            base = references.get(comparison_group(p))
            idle = p.wait_frac
            speedup = speedup_text(p.tok_s, p.batch_used, base.tok_s, base.batch_used) if base else "-"
            lines.append(f"| {p.label} | {setting_text(p.method, p.config) or '-'} | {p.key.model} | {p.key.dtype} "
                         f"| {format_length(p.key.length)} "
                         f"| {_batch_cell(p)} | {p.tok_s:.2f} | {_range_cell(p.tok_s_interval)} | {p.step_ms:.2f} "
                         f"| {_interval_cell(p)} | {_num(None if idle is None else 100 * idle, '.1f')} "
                         f"| {speedup} | {len(p.runs)} | {_setting(p, 'prefill')} | {p.device} |")
        lines.append("")
    groups = ablation_groups(report.points)
    if groups:
        lines += ["## Ablation (the variants of paper Figure 12; CPU-only points are not the paper's figure)", "",
                  "tok/s and the speed-ups as in the throughput table (tokens over the total timed time); the "
                  "speed-up is over the first variant, step-to-step over the one before.", "",
                  "| point | settings | variant | tok/s | speed-up | step-to-step |", "|---|---|---|---|---|---|"]
        for group, members in groups.items():
            where = _describe(("model", "dtype", "length", "batch", "device"), group[:5])
            settings = _settings_text(members[0])
            for i, (p, variant) in enumerate(zip(members, variant_labels(members), strict=True)):
                step_up = f"{p.tok_s / members[i - 1].tok_s:.2f}x" if i else "-"
                lines.append(f"| {where} | {settings} | {variant} | {p.tok_s:.2f} | {p.tok_s / members[0].tok_s:.2f}x "
                             f"| {step_up} |")
        lines.append("")
    if report.accuracy:
        lines += ["## Accuracy", "", "95% interval: the percentile bootstrap over records the result stores "
                  f"(`analysis/bootstrap.py`); † fewer than {MIN_RECORDS} records.", "",
                  "| method | setting | budget | model | metric | value | 95% interval | n |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in report.accuracy:
            config = r.get("method_config") if isinstance(r.get("method_config"), dict) else {}
            method, budget = canonical_method(str(r.get("method"))), config.get("budget")
            for metric, (value, _) in sorted(metric_values(r).items()):
                entry = (r.get("results") or {}).get(metric.removesuffix(".score")) or {}
                ci, n = entry.get("score_ci95"), entry.get("n")
                interval = f"[{ci[0]:.2f}, {ci[1]:.2f}]" if isinstance(ci, list) and len(ci) == 2 else "-"
                few = " †" if isinstance(n, int) and n < MIN_RECORDS else ""
                lines.append(f"| {method} | {setting_text(method, config) or '-'} | {'-' if budget is None else budget} "
                             f"| {(r.get('model') or {}).get('name')} | {metric} | {value:.2f} | {interval}{few} "
                             f"| {'-' if n is None else n} |")
        lines.append("")
    if report.projections:
        from scoutbench.analysis.projection import projection_markdown

        lines += ["## Projections", ""]
        for document in report.projections:
            lines += projection_markdown(document) + [""]
    if report.figures:
        lines += ["## Figures", ""]
        for title, files in report.figures:
            shown = next((f for f in files if f.suffix == ".png"), None)
            lines += [f"### {title}", ""]
            lines += [f"![{title}]({shown.name})", ""] if shown is not None else []
            lines += [" ".join(f"[{f.suffix.lstrip('.').upper()}]({f.name})" for f in files), ""]
    if report.failed:
        lines += ["## Failed points", "", "| method | model | len | batch | error |", "|---|---|---|---|---|"]
        for r in report.failed:
            key = point_key(r)
            error = str(r.get("error")).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {key.method} | {key.model} | {format_length(key.length) if key.length else '-'} "
                         f"| {key.batch} | {error} |")
        lines.append("")
    if report.skipped:
        lines += ["## Skipped", ""] + [f"- `{what}`: {why}" for what, why in report.skipped] + [""]
    if report.merged:
        lines += ["## Repeats merged", ""] + [f"- `{what}`: {why}" for what, why in report.merged] + [""]
    return "\n".join(lines)


def _describe(fields: tuple[str, ...], values: tuple) -> str:
    parts = []
    for name, value in zip(fields, values, strict=True):
        parts.append(f"len {format_length(value)}" if name == "length" else f"batch {value}" if name == "batch"
                     else str(value))
    return ", ".join(parts)


def _interval_cell(p: Point) -> str:
    """`4.70-5.59`: the median step's 95% interval (the median over the repeats of each end), `-` without one."""
    lows, highs = [], []
    for run in p.runs:
        step = run.get("decode_step_ms") or {}
        low, high = as_number(step.get("ci95_low")), as_number(step.get("ci95_high"))
        if low is not None and high is not None and math.isfinite(low) and math.isfinite(high) and low <= high:
            lows.append(low)
            highs.append(high)
    return f"{statistics.median(lows):.2f}-{statistics.median(highs):.2f}" if lows else "-"


def _range_cell(interval: tuple[float, float] | None) -> str:
    return "-" if interval is None else f"{interval[0]:.2f}-{interval[1]:.2f}"


def _setting(p: Point, name: str) -> str:
    value = json.loads(p.key.settings).get(name)
    return "-" if value is None else str(value)


def _settings_text(p: Point) -> str:
    """`8 steps, 2 warm-up, synthetic prefill`: the run settings an ablation's bars share."""
    settings = json.loads(p.key.settings)
    parts = [f"{settings['steps']} steps" if "steps" in settings else None,
             f"{settings['warmup']} warm-up" if "warmup" in settings else None,
             f"{settings['prefill']} prefill" if "prefill" in settings else None]
    return ", ".join(part for part in parts if part) or "-"


def speedup_text(tok_s: float, batch: int, base_tok_s: float, base_batch: int) -> str:
    """`1.20x` at equal batches; `1.20x (0.85x/seq)` when the two ran at different batches (`--batch auto`): the
    total-throughput ratio (what --batch auto compares: each method at its own largest batch) and the
    per-sequence one, each labelled."""
    if not base_tok_s:
        return "-"
    total = tok_s / base_tok_s
    if batch == base_batch:
        return f"{total:.2f}x"
    return f"{total:.2f}x ({total * base_batch / batch:.2f}x/seq)"


def _batch_cell(p: Point) -> str:
    """`auto (12)`: the planned batch this method actually ran at."""
    return f"{p.key.batch} ({p.batch_used})" if p.key.batch == "auto" else str(p.key.batch)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)

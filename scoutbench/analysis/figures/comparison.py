"""The comparison figures of the report, the two a reader of a methods paper looks for first: the speed-up over
FullKV at one point (`speedup*`: a bar per method and setting with its 95% interval) and cost against quality
(`cost_quality*`: each method and setting's speed-up, or throughput, against how closely it tracks FullKV).

Both read the one throughput of every table (`decode_throughput_tok_s`, tokens over the total timed time): a
speed-up here is the summary's `vs fullkv`. Its interval is the bootstrap of the ratio over both points' timed
steps (step_stats.speedup_interval).

Quality comes from what the results measured against FullKV with the same method settings: an accuracy run's
teacher-forced top-1 agreement (`--fidelity-steps`), else its score change against FullKV's on the same records,
or a throughput result that measured its own top-1 agreement (the real-text sweep). A method whose settings no
quality result matches is drawn on the speed side only, and the figure names it.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scoutbench.analysis.figures.style import (
    HEIGHT_IN,
    WIDTH_IN,
    comparison_group,
    error_bars,
    group_stems,
    legend_labels,
    line_style,
    method_color,
    ordered_series,
    place_legend,
    series_styles,
    set_title,
    where_text,
)
from scoutbench.analysis.points import as_number, canonical_method

if TYPE_CHECKING:
    from scoutbench.analysis.figures.style import FigureWriter
    from scoutbench.analysis.report import Point, Report

# what a comparison holds fixed (comparison_group without its run settings, which where_text states)
FIXED = ("model", "dtype", "length", "batch", "device")


def draw_comparisons(report: Report, writer: FigureWriter) -> None:
    speedup_figure(report, writer)
    cost_quality_figure(report, writer)


# ---- the speed side -------------------------------------------------------------------------------------------

@dataclass
class Comparison:
    """The points of one comparison group and FullKV's among them (None without exactly one)."""

    points: list[Point]
    reference: Point | None
    problem: str | None = None  # why there is no reference

    @property
    def others(self) -> list[Point]:
        return [p for p in self.points if p is not self.reference]


def comparisons(points: list[Point]) -> dict[tuple, Comparison]:
    """Points by comparison group (style.comparison_group: the summary's `vs fullkv` pairs the same), each with
    its FullKV point."""
    from scoutbench.methods import is_reference

    groups: dict[tuple, list[Point]] = defaultdict(list)
    for p in points:
        groups[comparison_group(p)].append(p)
    out = {}
    for group, members in sorted(groups.items(), key=lambda item: str(item[0])):
        references = [p for p in members if is_reference(p.method)]
        problem = None if len(references) == 1 else "no FullKV run" if not references else \
            f"{len(references)} FullKV runs ({'; '.join(p.label for p in references)})"
        out[group] = Comparison(members, references[0] if len(references) == 1 else None, problem)
    return out


def speedup_figure(report: Report, writer: FigureWriter) -> None:
    """One figure per comparison group with FullKV and another method: a bar per method and setting."""
    import matplotlib.pyplot as plt

    stem, title = "speedup", "Speed-up over FullKV"
    drawable = {g: c for g, c in comparisons(report.points).items() if c.reference is not None and c.others}
    without = sorted({p.key.describe(p.label) for c in comparisons(report.points).values() if c.reference is None
                      for p in c.points})
    if without:
        report.skipped.append((stem, f"no single FullKV run at the same point and settings: {'; '.join(without)}"))
    if not drawable:
        report.skipped.append((stem, "no point has both FullKV and another method with the same settings"))
        return
    names = group_stems(stem, [g[:5] for g in drawable], FIXED, [json.loads(g[5]) for g in drawable])
    for name, (group, comparison) in zip(names, drawable.items(), strict=True):
        labels = legend_labels(comparison.points)
        series = ordered_series(comparison.others, labels)
        styles = series_styles(series)
        bars = [(label, members[0]) for label, members in series.items()]
        values = [p.speedup(comparison.reference) for _, p in bars]
        fig, ax = plt.subplots(figsize=(min(7.5, max(WIDTH_IN, 1.4 + 0.7 * len(bars))), HEIGHT_IN))
        for i, ((label, _), (value, interval)) in enumerate(zip(bars, values, strict=True)):
            ax.bar([i], [value], 0.6, color=styles[label]["color"], hatch=styles[label]["hatch"],
                   edgecolor="white", linewidth=0.3, yerr=error_bars([value], [interval]), ecolor="#333333")
        for i, (value, interval) in enumerate(values):
            ax.annotate(f"{value:.2f}x", (i, interval[1] if interval else value), ha="center", va="bottom",
                        fontsize=7.5, xytext=(0, 2), textcoords="offset points")
        reference_line(ax, comparison.reference, labels[comparison.reference.key])
        rotate = len(bars) > 4
        ax.set_xticks(range(len(bars)), [label if rotate else textwrap.fill(label, 16) for label, _ in bars],
                      rotation=30 if rotate else 0, ha="right" if rotate else "center")
        ax.set_xlim(-0.6, len(bars) - 0.4)
        ax.set_ylabel("speed-up over FullKV (tok/s ratio)")
        ax.set_ylim(bottom=0)
        ax.margins(y=0.15)
        ax.grid(axis="x", visible=False)
        where = where_text(FIXED, group[:5], comparison.points)
        set_title(ax, f"{title} (95% intervals)", where)
        writer.save(fig, name, f"{title} ({where})", comparison.points)


def reference_line(ax: Any, reference: Point, label: str) -> None:
    """FullKV's level (1x) across the axes, named beside the axes' right edge, clear of the bars' labels."""
    ax.axhline(1.0, color=method_color(reference.method), linewidth=0.8, linestyle="--")
    ax.annotate(label, xy=(1.0, 1.0), xycoords=("axes fraction", "data"), xytext=(3, 0), textcoords="offset points",
                ha="left", va="center", fontsize=7)


# ---- the quality side -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Quality:
    """How closely one method configuration tracks FullKV, as one source measured it."""

    source: str  # what measured it: `qwen2.5-1.5b bfloat16 accuracy (6 tasks)`, `real-text sweep`
    top1_pct: float | None  # teacher-forced top-1 agreement with FullKV, %
    score_change: float | None  # score minus FullKV's on the same records, points, mean over tasks


QUALITY_AXES = {"top1_pct": "top-1 agreement with FullKV (%)",
                "score_change": "score change vs FullKV (points, mean over tasks)"}


def configuration(method: str, config: dict[str, Any]) -> str:
    """A method configuration as quality and speed results both name it: the method's family and every field,
    filled in from the registry's preset and the class defaults (a result written before a field existed still
    matches), without the fields that name a per-point file."""
    from scoutbench.methods import METHODS, artefact_fields, method_class, method_family

    name = canonical_method(method)
    cls = method_class(name)
    full = dict(config) if cls is None else {**cls.defaults(), **METHODS.preset(name), **config}
    artefacts = set(artefact_fields(name))
    # one spelling per number: a field given as 3 on the command line and recorded as 3.0 by the class is one setting
    fields = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in full.items() if k not in artefacts}
    return json.dumps([method_family(name) or name, fields], sort_keys=True, default=str)


def accuracy_quality(result: dict[str, Any]) -> Quality | None:
    """An accuracy result's quality: its teacher-forced top-1 agreement over every compared step of its tasks, and
    its score minus FullKV's on the same records, the mean over the tasks that have both."""
    tasks = result.get("results") if isinstance(result.get("results"), dict) else {}
    agree = steps = 0.0
    changes = []
    for entry in tasks.values():
        if not isinstance(entry, dict):
            continue
        fidelity = entry.get("fidelity") if isinstance(entry.get("fidelity"), dict) else {}
        top1, compared = as_number(fidelity.get("top1_agreement")), as_number(fidelity.get("compared_steps"))
        if top1 is not None and compared and math.isfinite(top1) and math.isfinite(compared):
            agree, steps = agree + top1 * compared, steps + compared
        versus = entry.get("vs_fullkv") if isinstance(entry.get("vs_fullkv"), dict) else {}
        score, base = as_number(versus.get("score")), as_number(versus.get("fullkv_score"))
        if score is not None and base is not None and math.isfinite(score) and math.isfinite(base):
            changes.append(score - base)
    if not steps and not changes:
        return None
    model = result.get("model") if isinstance(result.get("model"), dict) else {}
    source = f"{model.get('name')} {model.get('dtype')} accuracy ({len(tasks)} task{'s' * (len(tasks) != 1)})"
    return Quality(source, agree / steps if steps else None, statistics.fmean(changes) if changes else None)


def own_quality(point: Point) -> Quality | None:
    """A throughput point that measured its own top-1 agreement with FullKV (the real-text sweep's results)."""
    values = []
    for run in point.runs:
        section = run.get("real_text_sweep") if isinstance(run.get("real_text_sweep"), dict) else {}
        top1 = as_number(section.get("top1_agreement"))
        if top1 is not None and math.isfinite(top1):
            values.append(100 * top1)
    return Quality("the run itself (real-text sweep)", statistics.median(values), None) if values else None


def quality_index(report: Report) -> dict[str, dict[str, Quality]]:
    """configuration -> source -> its quality, from the report's accuracy results."""
    index: dict[str, dict[str, Quality]] = defaultdict(dict)
    for result in report.accuracy:
        quality = accuracy_quality(result)
        config = result.get("method_config") if isinstance(result.get("method_config"), dict) else {}
        if quality is not None:
            index[configuration(str(result.get("method")), config)][quality.source] = quality
    return dict(index)


def cost_quality_figure(report: Report, writer: FigureWriter) -> None:
    """Per comparison group with two or more methods, and per source of quality: speed-up over FullKV (or tok/s
    without FullKV) against top-1 agreement (or score change) with FullKV, one marker per method and setting;
    what has no quality result is drawn on the speed side only and named."""
    stem = "cost_quality"
    index = quality_index(report)
    drawn = []
    for group, comparison in comparisons(report.points).items():
        if len({p.key for p in comparison.points}) < 2:
            continue
        by_source: dict[str, dict[Any, Quality]] = defaultdict(dict)
        for p in comparison.points:
            own = own_quality(p)
            if own is not None:
                by_source[own.source][p.key] = own
            for source, quality in index.get(configuration(p.method, p.config), {}).items():
                by_source[source][p.key] = quality
        for source, qualities in (sorted(by_source.items()) or [(None, {})]):
            if comparison.reference is not None and source is not None:  # the reference is its own quality
                qualities.setdefault(comparison.reference.key, Quality(source, 100.0, 0.0))
            drawn.append((group, source, comparison, qualities))
    if not drawn:
        report.skipped.append((stem, "no point has two or more methods or settings to compare"))
        return
    names = group_stems(stem, [g[:5] for g, _, _, _ in drawn], FIXED,
                        [{**json.loads(g[5]), "quality": (s or "none").split(" ")[0]} for g, s, _, _ in drawn])
    for name, (group, source, comparison, qualities) in zip(names, drawn, strict=True):
        _cost_quality(writer, name, group, source, comparison, qualities)


def _cost_quality(writer: FigureWriter, name: str, group: tuple, source: str | None, comparison: Comparison,
                  qualities: dict[Any, Quality]) -> None:
    import matplotlib.pyplot as plt

    title = "Cost vs quality"
    points = comparison.points
    labels = legend_labels(points)
    series = ordered_series(points, labels)
    styles = series_styles(series)
    axis = next((a for a in QUALITY_AXES if any(getattr(q, a) is not None for q in qualities.values())), None)
    measured = [p for p in points if axis is not None and getattr(qualities.get(p.key), axis, None) is not None]
    missing = [p for p in points if p not in measured]
    reference = comparison.reference

    def speed(p: Point) -> tuple[float, tuple[float, float] | None]:
        return p.speedup(reference) if reference is not None else (p.tok_s, p.tok_s_interval)

    if measured and missing:
        fig, (ax, ax_missing) = plt.subplots(1, 2, sharey=True, figsize=(WIDTH_IN + 1.0, HEIGHT_IN),
                                             gridspec_kw={"width_ratios": [4, 1.3]})
    else:
        fig, single = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN))
        ax, ax_missing = (single, None) if measured else (None, single)
    for label, members in series.items():
        p = members[0]
        value, interval = speed(p)
        style = line_style(styles[label])
        yerr = error_bars([value], [interval])
        if p in measured:
            ax.errorbar([getattr(qualities[p.key], axis)], [value], yerr=yerr, label=label, markersize=6,
                        linestyle="none", color=style["color"], marker=style["marker"])
    if ax is not None:
        ax.set_xlabel(QUALITY_AXES[axis])
        ax.set_ylabel("speed-up over FullKV (tok/s ratio)" if reference is not None else "decode throughput (tok/s)")
        place_legend(ax, len(measured))
    if ax_missing is not None:
        for i, p in enumerate(missing):
            value, interval = speed(p)
            style = line_style(styles[labels[p.key]])
            ax_missing.errorbar([i], [value], yerr=error_bars([value], [interval]), linestyle="none", markersize=6,
                                color=style["color"], marker=style["marker"])
        rotate = len(missing) > 1
        ax_missing.set_xticks(range(len(missing)), [labels[p.key] for p in missing], rotation=40 if rotate else 0,
                              ha="right" if rotate else "center", fontsize=7)
        ax_missing.set_xlim(-0.6, len(missing) - 0.4)
        ax_missing.set_xlabel("quality not measured")
        ax_missing.grid(axis="x", visible=False)
        if ax is None:
            ax_missing.set_ylabel("speed-up over FullKV (tok/s ratio)" if reference is not None
                                  else "decode throughput (tok/s)")
    if reference is not None:
        reference_line(ax_missing if ax_missing is not None else ax, reference, labels[reference.key])
        if ax is not None and ax_missing is not None:
            ax.axhline(1.0, color=method_color(reference.method), linewidth=0.8, linestyle="--")
    where = where_text(FIXED, group[:5], points)
    quality = f"quality: {source}" if source else "quality: no accuracy or fidelity result with these settings"
    hint = "run `scoutbench accuracy --fidelity-steps N` with the same method settings"
    note = "" if not missing else f" ({hint})" if not measured else \
        f"; not measured: {', '.join(labels[p.key] for p in missing)} ({hint})"
    set_title(ax if ax is not None else ax_missing, title, f"speed: {where}; {quality}{note}")
    writer.save(fig, name, f"{title} ({where}; {quality})", points)

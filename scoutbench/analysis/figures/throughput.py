"""The throughput figures of the report, the paper's figure types: throughput vs input length (Figure 8) and vs
batch size (Figure 9), block size (Figure 10), the latency breakdown with its idle time (Figure 11) and the
ablation (Figure 12). Throughput is tokens over the total timed time (`decode_throughput_tok_s`, the number of
every table and export), with its 95% bootstrap interval as error bars. Every figure's subtitle states its setup
(model, dtype, length, batch, budget, block size, prefill, timed steps, device)."""

from __future__ import annotations

import json
import textwrap
from collections import defaultdict
from typing import TYPE_CHECKING

from scoutbench.analysis.figures.style import (
    HEIGHT_IN,
    STAGE_COLORS,
    WIDTH_IN,
    dodge,
    error_bars,
    figure_value,
    file_stems,
    group_points,
    group_stems,
    legend_labels,
    line_style,
    method_color,
    ordered_series,
    place_legend,
    point_field,
    series_styles,
    set_title,
    stage_label,
    where_text,
)
from scoutbench.units import format_length

if TYPE_CHECKING:
    from scoutbench.analysis.figures.style import FigureWriter
    from scoutbench.analysis.report import Point, Report


THROUGHPUT_LABEL = "decode throughput (tok/s)"


def draw_throughput(report: Report, writer: FigureWriter) -> None:
    """Every throughput figure the points allow; what cannot be drawn is listed in `report.skipped`."""
    if not report.points:
        report.skipped.append(("throughput figures", "no successful throughput results"))
        return
    line_figure(report, writer, "length", "throughput_vs_length", "Decode throughput vs input length")
    line_figure(report, writer, "batch", "batch_scaling", "Decode throughput vs batch size")
    block_size_figure(report, writer)
    breakdown_figure(report, writer)
    ablation_figure(report, writer)


def line_figure(report: Report, writer: FigureWriter, axis: str, stem: str, title: str) -> None:
    """Throughput against `axis` (length or batch), one line per series, for each fixed rest of the point."""
    import matplotlib.pyplot as plt

    fixed = ("model", "dtype", "batch" if axis == "length" else "length", "device")
    plotted = [p for p in report.points if isinstance(point_field(p, axis), int)]  # batch "auto" has no x position
    groups = {g: ps for g, ps in group_points(plotted, fixed).items() if len({point_field(p, axis) for p in ps}) > 1}
    if not groups:
        what = "lengths" if axis == "length" else "batch sizes"
        report.skipped.append((stem, f"no model/{fixed[2]} has results at two or more {what}"))
        return
    unplaced = [p for p in report.points if not isinstance(point_field(p, axis), int)
                and tuple(point_field(p, f) for f in fixed[:2] + fixed[3:]) in {g[:2] + g[3:] for g in groups}]
    if unplaced:  # beside a drawn batch figure: each method ran at its own batch, which no batch axis places
        report.skipped.append((stem, "batch auto has no place on a batch-size axis (each method ran at its own "
                                     f"batch): {'; '.join(sorted({p.label for p in unplaced}))}"))
    names = file_stems(stem, list(groups), fixed)
    for group, points in groups.items():
        series = ordered_series(points, legend_labels(points))
        lone = [label for label, members in series.items() if len({point_field(p, axis) for p in members}) < 2]
        if lone:  # a point no other of its series' points joins into a line (another sweep's, say)
            report.skipped.append((names[group], f"series with one {axis} only, not drawn: {'; '.join(lone)}"))
            points = [p for label, members in series.items() if label not in lone for p in members]
            if not points:
                continue
            # labelled again without them: a field that told only a dropped series apart names nothing here
            series = ordered_series(points, legend_labels(points))
        fig, ax = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN))
        styles = series_styles(series)
        for index, (label, members) in enumerate(series.items()):
            members.sort(key=lambda p: point_field(p, axis))
            values = [figure_value(p) for p in members]
            ys = [v for v, _ in values]
            shift = dodge(index, len(series))  # error bars at one x side by side, not on top of each other
            ax.errorbar([point_field(p, axis) * shift for p in members], ys, yerr=error_bars(ys, [i for _, i in values]),
                        label=label, markersize=4, linewidth=1.4, **line_style(styles[label]))
        ticks = sorted({point_field(p, axis) for p in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [format_length(t) if axis == "length" else str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("input length (tokens)" if axis == "length" else "batch size (sequences)")
        ax.set_ylabel(THROUGHPUT_LABEL)
        ax.set_ylim(bottom=0)
        where = where_text(fixed, group, points, axis)
        set_title(ax, title, where)
        place_legend(ax, len(series))
        writer.save(fig, names[group], f"{title} ({where})", points)


def block_size_figure(report: Report, writer: FigureWriter) -> None:
    import matplotlib.pyplot as plt

    stem, title = "block_size", "Decode throughput vs block size"
    fixed = ("model", "dtype", "length", "batch", "device")
    with_blocks = [p for p in report.points if isinstance(p.config.get("block_size"), int)
                   and not isinstance(p.config.get("block_size"), bool)]
    groups = {g: ps for g, ps in group_points(with_blocks, fixed).items()
              if len({p.config["block_size"] for p in ps}) > 1}
    if not groups:
        report.skipped.append((stem, "no point has results at two or more block sizes"))
        return
    names = file_stems(stem, list(groups), fixed)
    for group, points in groups.items():
        series = ordered_series(points, legend_labels(points, exclude=("block_size",)))
        styles = series_styles(series)
        sizes = sorted({p.config["block_size"] for p in points})
        width = 0.8 / len(series)
        fig, ax = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN))
        for i, (label, members) in enumerate(series.items()):
            by_size = {p.config["block_size"]: figure_value(p) for p in members}
            shown = [s for s in sizes if s in by_size]
            ys = [by_size[s][0] for s in shown]
            xs = [sizes.index(s) + (i - (len(series) - 1) / 2) * width for s in shown]
            ax.bar(xs, ys, width * 0.92, label=label, color=styles[label]["color"], hatch=styles[label]["hatch"],
                   edgecolor="white", linewidth=0.3, yerr=error_bars(ys, [by_size[s][1] for s in shown]),
                   ecolor="#333333")
            for x, s in zip(xs, shown, strict=True):
                top = by_size[s][1][1] if by_size[s][1] else by_size[s][0]
                ax.annotate(f"{by_size[s][0]:.3g}", (x, top), ha="center", va="bottom", fontsize=7,
                            xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(THROUGHPUT_LABEL)
        ax.margins(y=0.15)
        ax.grid(axis="x", visible=False)
        where = where_text(fixed, group, points, "block_size")
        set_title(ax, title, where)
        if len(series) > 1:  # beside the bars, never over them
            ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
        writer.save(fig, names[group], f"{title} ({where})", points)


def breakdown_figure(report: Report, writer: FigureWriter) -> None:
    """Stacked per-stage latency per method at one (model, length, batch, device); the idle share (the GPU stalled
    on CPU work or copies; on a CPU the main thread waiting for its worker) labelled on each bar."""
    import matplotlib.pyplot as plt

    from scoutbench.methods import display_rank
    from scoutbench.timing import STAGES

    stem, title = "latency_breakdown", "Decode latency breakdown per step"
    fixed = ("model", "dtype", "length", "batch", "device")
    usable = [p for p in report.points if p.breakdown_ms() is not None]
    if not usable:
        report.skipped.append((stem, "no result has latency_breakdown_ms"))
        return
    groups = group_points(usable, fixed)
    names = file_stems(stem, list(groups), fixed)
    for group, points in groups.items():
        labels = legend_labels(points)
        points.sort(key=lambda p: (display_rank(p.method), labels[p.key]))
        rotate = len(points) > 5
        ticks = [labels[p.key] if rotate else textwrap.fill(labels[p.key], 14) for p in points]
        fig, ax = plt.subplots(figsize=(min(7.5, max(WIDTH_IN, 1.6 + 0.6 * len(points))), HEIGHT_IN + 0.4))
        bottoms = [0.0] * len(points)
        breakdowns = [p.breakdown_ms() or {} for p in points]
        on_cuda = points[0].on_cuda  # one device per figure
        for stage in STAGES:
            values = [breakdown.get(stage, 0.0) for breakdown in breakdowns]
            ax.bar(range(len(points)), values, 0.6, bottom=bottoms, label=stage_label(stage, on_cuda),
                   color=STAGE_COLORS.get(stage), hatch="////" if stage == "idle" else None, edgecolor="white",
                   linewidth=0.3)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
        for i, p in enumerate(points):
            word = "idle" if p.on_gpu else "wait"  # CPU: the main thread's wait
            ax.annotate(f"{word} {100 * float(p.wait_frac or 0.0):.0f}%", (i, bottoms[i]), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(points)), ticks, rotation=30 if rotate else 0, ha="right" if rotate else "center")
        ax.set_ylabel("ms per decode step (mean)")
        ax.set_xlim(-0.6, len(points) - 0.4)
        ax.margins(y=0.12)
        ax.grid(axis="x", visible=False)
        handles, legend_names = ax.get_legend_handles_labels()
        ax.legend(handles[::-1], legend_names[::-1], loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  borderaxespad=0.0)  # the stack's order, top first
        where = where_text(fixed, group, points)
        set_title(ax, title, where)
        writer.save(fig, names[group], f"{title} ({where})", points)


def ablation_groups(points: list[Point]) -> dict[tuple, list[Point]]:
    """Groups of runs of one method family that differ only in its ablation fields (ScoutAttention: pc/pr), at one
    point and with the same run settings (steps, warm-up, prefill: the ablation preset's points and a plain sweep's
    of the same point are two ablations, not one), with at least two variants, in the order the method declares
    (the paper's). Two runs of one variant (`scout --method-arg pc=off pr=off` beside `scout-base`) both stay."""
    from scoutbench.methods import ablation_order, display_rank, method_class

    groups: dict[tuple, list[Point]] = defaultdict(list)
    for p in points:
        if p.variant is None:
            continue
        cls = method_class(p.method)
        rest = json.dumps({k: v for k, v in p.config.items() if k not in cls.ablation_fields}, sort_keys=True,
                          default=str)
        groups[(p.key.model, p.key.dtype, p.key.length, p.key.batch, p.device, rest, cls.name,
                p.key.settings)].append(p)
    out = {}
    for group, members in sorted(groups.items(), key=lambda item: str(item[0])):
        order = ablation_order(members[0].method)
        if len({p.variant for p in members}) > 1:
            out[group] = sorted(members, key=lambda p: (order.index(p.variant), display_rank(p.method), p.label))
    return out


def ablation_lone_points(points: list[Point]) -> list[Point]:
    """Ablation variants (other than the method's own default, which is a plain run of it) with no other variant of
    their method at their point and settings: an ablation that has nothing to compare with."""
    from scoutbench.methods import ablation_variant, method_class

    grouped = {p.key for members in ablation_groups(points).values() for p in members}
    return [p for p in points if p.variant is not None and p.key not in grouped
            and p.variant != ablation_variant(method_class(p.method).name, {})]


def variant_labels(members: list[Point]) -> list[str]:
    """An ablation's bar labels: the variant (`+PC`), with the method's name where two bars are one variant."""
    counts = defaultdict(int)
    for p in members:
        counts[p.variant] += 1
    return [p.variant if counts[p.variant] == 1 else f"{p.variant} [{p.method}]" for p in members]


def ablation_figure(report: Report, writer: FigureWriter) -> None:
    import matplotlib.pyplot as plt

    from scoutbench.methods import ABLATION_METHODS, method_class

    stem = "ablation"
    groups = ablation_groups(report.points)
    if not groups:
        report.skipped.append((stem, f"no point has two or more of {' / '.join(ABLATION_METHODS)}"))
        return
    lone = ablation_lone_points(report.points)
    if lone:
        report.skipped.append((stem, "a variant with no other variant of its method at its point and settings: "
                                     f"{'; '.join(sorted(p.key.describe(p.label) for p in lone))}"))
    names = group_stems(stem, [group[:5] for group in groups], ("model", "dtype", "length", "batch", "device"),
                        [{**json.loads(group[5]), **json.loads(group[7])} for group in groups])
    for (group, members), name in zip(groups.items(), names, strict=True):
        cls = method_class(members[0].method)
        title = f"Ablation of {cls.display_name or cls.name}"
        values = [figure_value(p) for p in members]
        ys = [v for v, _ in values]
        fig, ax = plt.subplots(figsize=(max(3.4, 1.1 * len(members) + 1.2), HEIGHT_IN))
        ax.bar(range(len(members)), ys, 0.6, color=[method_color(p.method) for p in members],
               yerr=error_bars(ys, [i for _, i in values]), ecolor="#333333")
        for i, (value, interval) in enumerate(values):
            ax.annotate(f"{value / ys[0]:.2f}x", (i, interval[1] if interval else value), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(members)), variant_labels(members))
        ax.set_ylabel(THROUGHPUT_LABEL)
        ax.margins(y=0.15)
        ax.grid(axis="x", visible=False)
        where = where_text(("model", "dtype", "length", "batch", "device"), group[:5], members)
        set_title(ax, f"{title} (speed-up vs {members[0].variant})", where)
        writer.save(fig, name, f"{title} ({where})", members)

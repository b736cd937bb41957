"""The report's figures, drawn for a paper: the paper's figure types (throughput vs input length, Figure 8; batch
scaling, Figure 9; block size, Figure 10; latency breakdown with idle time, Figure 11; ablation, Figure 12; and
accuracy vs budget), each written as PNG (300 dpi) and as vector PDF/SVG with embedded TrueType text.

What a reader of a paper needs: method names as the papers write them (`ScoutAttention (+PC)`, not
`scout-pc pc=True`), one colour per method in every figure (the registry's display order picks it), the median
step's 95% interval as error bars wherever the results store it, and legends that are never cut off (figures are
saved with a tight bounding box). Throughput in a figure is the throughput of the median step (batch x 1000 /
median step ms), the number the stored interval belongs to; the summary's tables give the mean-step throughput too.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scoutbench.analysis.points import as_number
from scoutbench.units import format_length

if TYPE_CHECKING:
    from scoutbench.analysis.report import Point, Report

FIGURE_FORMATS = ("png", "pdf", "svg")
DEFAULT_FIGURE_FORMATS = ("png", "pdf")
PNG_DPI = 300
# the file stems figures are written under (with `_<group>` suffixes when there are several of one type): what a
# rerun of `report --overwrite` replaces
FIGURE_STEMS = ("throughput_vs_length", "batch_scaling", "block_size", "latency_breakdown", "ablation",
                "accuracy_vs_budget")
# Okabe-Ito's colour-blind-safe palette: one colour per method family in registration order (the dense reference
# first, so black), the proposed method's family vermillion; families past its end (third-party ones) continue with
# matplotlib's tab10. A family's other registered forms (ablation variants, presets) are lighter tints of its colour.
FAMILY_COLORS = ("#000000", "#56B4E9", "#009E73", "#E69F00", "#CC79A7", "#0072B2", "#999999")
PROPOSED_COLOR = "#D55E00"
EXTRA_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
LIGHTEST_TINT = 0.7  # the share of white that a family's variants' tints approach (the first gets the most)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", ":", "-.")
HATCHES = (None, "///", "...", "xxx")  # a method's second, third... series of bars
STAGE_COLORS = {"qkv_proj": "#4c72b0", "predict": "#8172b3", "attn_device": "#55a868", "idle": "#c44e52",
                "merge": "#937860", "o_proj": "#64b5cd", "mlp": "#dd8452", "other": "#b0b0b0"}
STAGE_LABELS = {"qkv_proj": "QKV projection", "predict": "query prediction", "attn_device": "device attention",
                "idle": "idle (waiting)", "merge": "merge", "o_proj": "output projection", "mlp": "MLP",
                "other": "other"}
# readable names of the config fields and run settings a legend may have to show
FIELD_LABELS = {"block_size": "block", "dense_layers": "dense layers", "recall_interval": "recall every",
                "kv_skew": "KV skew", "warmup": "warm-up"}
STYLE = {"font.size": 9, "axes.titlesize": 9, "axes.labelsize": 9, "legend.fontsize": 8, "xtick.labelsize": 8,
         "ytick.labelsize": 8, "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
         "grid.alpha": 0.3, "grid.linewidth": 0.5, "errorbar.capsize": 2.5, "legend.frameon": False,
         # TrueType (Type 42) fonts in PDF (venues reject Type 3), text kept as text in SVG, and no creation date or
         # random ids in either, so that a re-render of the same results gives the same file
         "pdf.fonttype": 42, "svg.fonttype": "none", "svg.hashsalt": "scoutbench"}
WIDTH_IN = 5.0  # a figure's width: a single column of a two-column paper at about 70%, or half a text width
HEIGHT_IN = 3.2


def parse_formats(text: str) -> tuple[str, ...]:
    """`png,pdf` -> ("png", "pdf"); an unknown format is a one-line usage error."""
    from scoutbench.errors import UsageError

    formats = tuple(dict.fromkeys(f.strip().lower() for f in text.split(",") if f.strip()))
    unknown = [f for f in formats if f not in FIGURE_FORMATS]
    if unknown or not formats:
        raise UsageError(f"bad --figure-format {text!r}: use one or more of {', '.join(FIGURE_FORMATS)}, "
                         "comma-separated")
    return formats


# ---- names and colours ----------------------------------------------------------------------------------------

def method_color(method: str) -> str:
    """The method's colour in every figure: its family's, and for a family's other registered forms (scout-base,
    scout-pc, infinigen-dynamic, ...) a tint of it, lightest first in registration order."""
    from scoutbench.methods import METHODS, PROPOSED_METHOD, method_family

    family = method_family(method) or method
    if family == PROPOSED_METHOD:
        base = PROPOSED_COLOR
    else:
        families = [f for f in dict.fromkeys(method_family(n) for n in METHODS.names()) if f != PROPOSED_METHOD]
        rank = families.index(family) if family in families else len(families)
        base = FAMILY_COLORS[rank] if rank < len(FAMILY_COLORS) else \
            EXTRA_COLORS[(rank - len(FAMILY_COLORS)) % len(EXTRA_COLORS)]
    forms = [n for n in METHODS.names() if method_family(n) == family and n != family]
    name = METHODS.canonical(method) if method in METHODS else method
    if name not in forms:
        return base
    return _tint(base, LIGHTEST_TINT * (len(forms) - forms.index(name)) / (len(forms) + 1))


def _tint(color: str, white: float) -> str:
    """`color` mixed with `white` parts of white (0: the colour, 1: white)."""
    channels = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * white):02x}" for c in channels)


def method_display(method: str, config: dict[str, Any]) -> str:
    """How a paper names a run: the method's display name, plus its ablation variant unless it is the method's own
    default (`ScoutAttention (+PC)`, `ScoutAttention`, `FullKV`), or, for another registered form of a method, the
    fields its registration sets (`InfiniGen (dynamic count on)`); an unknown method keeps its id."""
    from scoutbench.methods import METHODS, ablation_variant, method_class

    cls = method_class(method)
    if cls is None:
        return method
    name = cls.display_name or cls.name
    variant = ablation_variant(method, config)
    if variant is not None:
        return f"{name} ({variant})" if variant != ablation_variant(cls.name, {}) else name
    preset = METHODS.preset(method)
    return f"{name} ({', '.join(_field_text(k, v) for k, v in preset.items())})" if preset else name


def _field_text(name: str, value: Any) -> str:
    return f"{FIELD_LABELS.get(name, name.replace('_', ' '))} {_value_text(name, value)}"


def _value_text(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and name in ("budget", "len") and value >= 1024 and value % 1024 == 0:
        return format_length(value)
    return "-" if value is None else str(value)


def legend_labels(points: list[Point], exclude: tuple[str, ...] = ()) -> dict[Any, str]:
    """Each point's legend label: the paper's name of its method plus only the config fields and run settings that
    differ among that method's points here (`ScoutAttention, budget 1k`), never a field that only tells methods
    apart (FullKV's `dense_layers` null against a sparse method's 2). Two different series never share a label."""
    by_method: dict[str, list[Point]] = defaultdict(list)
    for p in points:
        by_method[p.method].append(p)
    labels: dict[Any, str] = {}
    for method, members in by_method.items():
        fields = [{**p.config, **json.loads(p.key.settings)} for p in members]
        names = sorted({name for f in fields for name in f} - set(exclude))
        varying = [n for n in names if len({json.dumps(f.get(n), sort_keys=True, default=str) for f in fields}) > 1]
        for p, f in zip(members, fields, strict=True):
            parts = [_field_text(n, f.get(n)) for n in varying]
            labels[p.key] = ", ".join([method_display(method, p.config), *parts])
    owners: dict[str, set[str]] = defaultdict(set)
    for p in points:
        owners[labels[p.key]].add(p.method)
    for p in points:  # e.g. `scout --method-arg pc=off` beside `scout-base`: both are "co-attention"
        if len(owners[labels[p.key]]) > 1:
            labels[p.key] = f"{labels[p.key]} [{p.method}]"
    return labels


def device_text(result: dict[str, Any]) -> str:
    """`NVIDIA H200` or `Intel Xeon Processor (AVX512, 2 threads)`: the device class without its separators."""
    device = result.get("device") if isinstance(result.get("device"), dict) else {}
    name = re.sub(r"\((R|TM|tm)\)", "", str(device.get("name") or device.get("class") or "unknown device"))
    name = re.sub(r"\s+", " ", name).strip()
    if device.get("type") != "cpu":
        return name
    parts = str(device.get("class", "")).split(":")
    isa = parts[2] if len(parts) > 3 else None
    threads = device.get("threads")
    details = [d for d in (isa, f"{threads} threads" if threads else None) if d]
    return f"{name} ({', '.join(details)})" if details else name


def _where(fields: tuple[str, ...], values: tuple, points: list[Point]) -> str:
    """The fixed part of a figure as a subtitle: `tiny-qwen3, float32, 16k tokens, batch 1, Intel Xeon (...)`."""
    parts = []
    for name, value in zip(fields, values, strict=True):
        if name == "length":
            parts.append(f"{format_length(value)} tokens")
        elif name == "batch":
            parts.append(f"batch {value}")
        elif name == "device":
            parts.append(device_text(points[0].result))
        else:
            parts.append(str(value))
    return ", ".join(parts)


# ---- values ---------------------------------------------------------------------------------------------------

def median_step_tok_s(run: dict[str, Any], step_ms: float | None = None) -> float | None:
    """batch x 1000 / the median step (or `step_ms`): a run's throughput at its median step, None if not a
    measurement."""
    step = as_number((run.get("decode_step_ms") or {}).get("median")) if step_ms is None else step_ms
    batch = (run.get("workload") or {}).get("batch")
    if step is None or not math.isfinite(step) or step <= 0 or not isinstance(batch, int) or batch < 1:
        return None
    return batch * 1000.0 / step


def figure_value(point: Point) -> tuple[float, tuple[float, float] | None]:
    """(throughput at the median step, its 95% interval or None): the median over the repeats of each. A run's
    interval is used only where it holds its own median (hand-edited or older results without one get no bar)."""
    values, lows, highs = [], [], []
    for run in point.runs:
        value = median_step_tok_s(run)
        if value is None:
            continue
        values.append(value)
        step = run.get("decode_step_ms") or {}
        low_ms, high_ms = as_number(step.get("ci95_low")), as_number(step.get("ci95_high"))
        median = as_number(step.get("median"))
        if low_ms is not None and high_ms is not None and math.isfinite(low_ms) and math.isfinite(high_ms) \
                and 0 < low_ms <= median <= high_ms:
            lows.append(median_step_tok_s(run, high_ms))
            highs.append(median_step_tok_s(run, low_ms))
    value = statistics.median(values) if values else point.tok_s
    if not lows:
        return value, None
    low, high = statistics.median(lows), statistics.median(highs)
    return value, (min(low, value), max(high, value))


def _error_bars(values: list[float], intervals: list[tuple[float, float] | None]) -> list[list[float]] | None:
    """matplotlib's yerr (distances below and above) from intervals; None when no point has one."""
    if all(i is None for i in intervals):
        return None
    below = [v - i[0] if i else 0.0 for v, i in zip(values, intervals, strict=True)]
    above = [i[1] - v if i else 0.0 for v, i in zip(values, intervals, strict=True)]
    return [below, above]


# ---- drawing ----------------------------------------------------------------------------------------------------

class FigureWriter:
    """Saves figures in the chosen formats into a folder and records them in the report."""

    def __init__(self, report: Report, out: Path, formats: tuple[str, ...]) -> None:
        self.report, self.out, self.formats = report, out, formats

    def save(self, fig: Any, stem: str, title: str) -> None:
        import matplotlib.pyplot as plt

        files = []
        for fmt in self.formats:
            path = self.out / f"{stem}.{fmt}"
            metadata = {"CreationDate": None} if fmt == "pdf" else {"Date": None} if fmt == "svg" else None
            fig.savefig(path, dpi=PNG_DPI, bbox_inches="tight", pad_inches=0.03, metadata=metadata)
            files.append(path)
        plt.close(fig)
        self.report.figures.append((title, files))


def draw_all(report: Report, writer: FigureWriter) -> None:
    """Every figure the results have the points for; what cannot be drawn is listed in `report.skipped`."""
    import matplotlib

    matplotlib.use("Agg")
    with matplotlib.rc_context(STYLE):
        if report.points:
            _line_figure(report, writer, "length", "throughput_vs_length", "Decode throughput vs input length")
            _line_figure(report, writer, "batch", "batch_scaling", "Decode throughput vs batch size")
            _block_size_figure(report, writer)
            _breakdown_figure(report, writer)
            _ablation_figure(report, writer)
        else:
            report.skipped.append(("throughput figures", "no successful throughput results"))
        _accuracy_figure(report, writer)


def _field(p: Point, name: str) -> Any:
    return {"model": p.key.model, "dtype": p.key.dtype, "length": p.key.length, "batch": p.key.batch,
            "device": p.device, "method": p.method}[name]


def _groups(points: list[Point], fields: tuple[str, ...]) -> dict[tuple, list[Point]]:
    groups: dict[tuple, list[Point]] = defaultdict(list)
    for p in points:
        groups[tuple(_field(p, f) for f in fields)].append(p)
    return dict(sorted(groups.items(), key=lambda item: str(item[0])))


def file_stems(stem: str, groups: list[tuple], fields: tuple[str, ...] = ()) -> dict[tuple, str]:
    """`stem` for one group; otherwise a suffix made of the group fields that differ between groups
    (`latency_breakdown_len16k_b1`), named by `fields` where given."""
    if len(groups) == 1:
        return {groups[0]: stem}
    differing = [i for i in range(len(groups[0])) if len({g[i] for g in groups}) > 1]
    names = {}
    for g in groups:
        suffix = "_".join(_stem_part(fields[i] if i < len(fields) else "", g[i]) for i in differing)
        names[g] = f"{stem}_{re.sub(r'[^A-Za-z0-9.=-]+', '-', suffix).strip('-')}"
    return names


def _stem_part(name: str, value: Any) -> str:
    if name == "length" and isinstance(value, int):
        return f"len{format_length(value)}"
    if name == "batch":
        return f"b{value}"
    return "none" if value is None else str(value)


def _title(ax: Any, title: str, where: str) -> None:
    """The figure's title over what it holds fixed, wrapped to the figure's width (about 15 characters an inch)."""
    width = max(40, int(ax.figure.get_figwidth() * 15))
    ax.set_title(f"{title}\n{textwrap.fill(where, width)}", fontsize=8.5, loc="left")


def _series_styles(series: dict[str, list[Point]]) -> dict[str, dict[str, Any]]:
    """One colour per method; a method's second, third... series (other budgets, say) get other markers, dashes
    and bar hatches in the same colour."""
    seen: dict[str, int] = defaultdict(int)
    styles = {}
    for label, members in series.items():
        method = members[0].method
        index = seen[method]
        seen[method] += 1
        styles[label] = {"color": method_color(method), "marker": MARKERS[index % len(MARKERS)],
                         "linestyle": LINESTYLES[index % len(LINESTYLES)], "hatch": HATCHES[index % len(HATCHES)]}
    return styles


def _ordered_series(points: list[Point], labels: dict[Any, str]) -> dict[str, list[Point]]:
    from scoutbench.methods import display_rank

    series: dict[str, list[Point]] = defaultdict(list)
    for p in sorted(points, key=lambda p: (display_rank(p.method), labels[p.key])):
        series[labels[p.key]].append(p)
    return dict(series)


def _dodge(index: int, count: int) -> float:
    """The factor that moves series `index` of `count` sideways on a log2 axis (about 3% of a doubling apart)."""
    return 2.0 ** (0.03 * (index - (count - 1) / 2))


def _legend(ax: Any, count: int) -> None:
    """Inside the axes for a few series; for more, in two columns under the axes, so that the figure keeps its
    width (never clipped: figures are saved with a tight bounding box)."""
    if count <= 4:
        ax.legend(loc="best")
    else:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, borderaxespad=0.0)


def _line_figure(report: Report, writer: FigureWriter, axis: str, stem: str, title: str) -> None:
    """Throughput against `axis` (length or batch), one line per series, for each fixed rest of the point."""
    import matplotlib.pyplot as plt

    fixed = ("model", "dtype", "batch" if axis == "length" else "length", "device")
    plotted = [p for p in report.points if isinstance(_field(p, axis), int)]  # batch "auto" has no x position
    groups = {g: ps for g, ps in _groups(plotted, fixed).items() if len({_field(p, axis) for p in ps}) > 1}
    if not groups:
        what = "lengths" if axis == "length" else "batch sizes"
        report.skipped.append((stem, f"no model/{fixed[2]} has results at two or more {what}"))
        return
    names = file_stems(stem, list(groups), fixed)
    for group, points in groups.items():
        series = _ordered_series(points, legend_labels(points))
        lone = [label for label, members in series.items() if len({_field(p, axis) for p in members}) < 2]
        if lone:  # a point no other of its series' points joins into a line (another sweep's, say)
            report.skipped.append((names[group], f"series with one {axis} only, not drawn: {'; '.join(lone)}"))
            points = [p for label, members in series.items() if label not in lone for p in members]
            if not points:
                continue
            # labelled again without them: a field that told only a dropped series apart names nothing here
            series = _ordered_series(points, legend_labels(points))
        fig, ax = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN))
        styles = _series_styles(series)
        for index, (label, members) in enumerate(series.items()):
            members.sort(key=lambda p: _field(p, axis))
            values = [figure_value(p) for p in members]
            ys = [v for v, _ in values]
            shift = _dodge(index, len(series))  # error bars at one x side by side, not on top of each other
            ax.errorbar([_field(p, axis) * shift for p in members], ys, yerr=_error_bars(ys, [i for _, i in values]),
                        label=label, markersize=4, linewidth=1.4, **styles[label])
        ticks = sorted({_field(p, axis) for p in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [format_length(t) if axis == "length" else str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("input length (tokens)" if axis == "length" else "batch size (sequences)")
        ax.set_ylabel("decode throughput (tok/s)")
        ax.set_ylim(bottom=0)
        where = _where(fixed, group, points)
        _title(ax, title, where)
        _legend(ax, len(series))
        writer.save(fig, names[group], f"{title} ({where})")


def _block_size_figure(report: Report, writer: FigureWriter) -> None:
    import matplotlib.pyplot as plt

    stem, title = "block_size", "Decode throughput vs block size"
    fixed = ("model", "dtype", "length", "batch", "device")
    with_blocks = [p for p in report.points if isinstance(p.config.get("block_size"), int)
                   and not isinstance(p.config.get("block_size"), bool)]
    groups = {g: ps for g, ps in _groups(with_blocks, fixed).items()
              if len({p.config["block_size"] for p in ps}) > 1}
    if not groups:
        report.skipped.append((stem, "no point has results at two or more block sizes"))
        return
    names = file_stems(stem, list(groups), fixed)
    for group, points in groups.items():
        series = _ordered_series(points, legend_labels(points, exclude=("block_size",)))
        styles = _series_styles(series)
        sizes = sorted({p.config["block_size"] for p in points})
        width = 0.8 / len(series)
        fig, ax = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN))
        for i, (label, members) in enumerate(series.items()):
            by_size = {p.config["block_size"]: figure_value(p) for p in members}
            shown = [s for s in sizes if s in by_size]
            ys = [by_size[s][0] for s in shown]
            xs = [sizes.index(s) + (i - (len(series) - 1) / 2) * width for s in shown]
            ax.bar(xs, ys, width * 0.92, label=label, color=styles[label]["color"], hatch=styles[label]["hatch"],
                   edgecolor="white", linewidth=0.3, yerr=_error_bars(ys, [by_size[s][1] for s in shown]),
                   ecolor="#333333")
            for x, s in zip(xs, shown, strict=True):
                top = by_size[s][1][1] if by_size[s][1] else by_size[s][0]
                ax.annotate(f"{by_size[s][0]:.3g}", (x, top), ha="center", va="bottom", fontsize=7,
                            xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("decode throughput (tok/s)")
        ax.margins(y=0.15)
        ax.grid(axis="x", visible=False)
        where = _where(fixed, group, points)
        _title(ax, title, where)
        if len(series) > 1:  # beside the bars, never over them
            ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
        writer.save(fig, names[group], f"{title} ({where})")


def _breakdown_figure(report: Report, writer: FigureWriter) -> None:
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
    groups = _groups(usable, fixed)
    names = file_stems(stem, list(groups), fixed)
    for group, points in groups.items():
        labels = legend_labels(points)
        points.sort(key=lambda p: (display_rank(p.method), labels[p.key]))
        rotate = len(points) > 5
        ticks = [labels[p.key] if rotate else textwrap.fill(labels[p.key], 14) for p in points]
        fig, ax = plt.subplots(figsize=(min(7.5, max(WIDTH_IN, 1.6 + 0.6 * len(points))), HEIGHT_IN + 0.4))
        bottoms = [0.0] * len(points)
        breakdowns = [p.breakdown_ms() or {} for p in points]
        for stage in STAGES:
            values = [breakdown.get(stage, 0.0) for breakdown in breakdowns]
            ax.bar(range(len(points)), values, 0.6, bottom=bottoms, label=STAGE_LABELS.get(stage, stage),
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
        where = _where(fixed, group, points)
        _title(ax, title, where)
        writer.save(fig, names[group], f"{title} ({where})")


def ablation_groups(points: list[Point]) -> dict[tuple, list[Point]]:
    """Groups of runs of one method family that differ only in its ablation fields (ScoutAttention: pc/pr), with
    at least two variants, in the order the method declares (the paper's)."""
    from scoutbench.methods import ablation_order, method_class

    groups: dict[tuple, list[Point]] = defaultdict(list)
    for p in points:
        if p.variant is None:
            continue
        cls = method_class(p.method)
        rest = json.dumps({k: v for k, v in p.config.items() if k not in cls.ablation_fields}, sort_keys=True,
                          default=str)
        groups[(p.key.model, p.key.dtype, p.key.length, p.key.batch, p.device, rest, cls.name)].append(p)
    out = {}
    for group, members in sorted(groups.items(), key=lambda item: str(item[0])):
        by_variant = {p.variant: p for p in members}
        if len(by_variant) > 1:
            out[group] = [by_variant[v] for v in ablation_order(members[0].method) if v in by_variant]
    return out


def _ablation_figure(report: Report, writer: FigureWriter) -> None:
    import matplotlib.pyplot as plt

    from scoutbench.methods import ABLATION_METHODS, method_class

    stem = "ablation"
    groups = ablation_groups(report.points)
    if not groups:
        report.skipped.append((stem, f"no point has two or more of {' / '.join(ABLATION_METHODS)}"))
        return
    keys = [group[:5] for group in groups]
    if len(set(keys)) < len(keys):  # same point, different other fields (e.g. budgets): number them
        keys = [key + (str(i),) for i, key in enumerate(keys, 1)]
    names = file_stems(stem, keys, ("model", "dtype", "length", "batch", "device"))
    for (group, members), key in zip(groups.items(), keys, strict=True):
        cls = method_class(members[0].method)
        title = f"Ablation of {cls.display_name or cls.name}"
        values = [figure_value(p) for p in members]
        ys = [v for v, _ in values]
        fig, ax = plt.subplots(figsize=(max(3.4, 1.1 * len(members) + 1.2), HEIGHT_IN))
        ax.bar(range(len(members)), ys, 0.6, color=[method_color(p.method) for p in members],
               yerr=_error_bars(ys, [i for _, i in values]), ecolor="#333333")
        for i, (value, interval) in enumerate(values):
            ax.annotate(f"{value / ys[0]:.2f}x", (i, interval[1] if interval else value), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(members)), [p.variant for p in members])
        ax.set_ylabel("decode throughput (tok/s)")
        ax.margins(y=0.15)
        ax.grid(axis="x", visible=False)
        where = _where(("model", "dtype", "length", "batch", "device"), group[:5], members)
        _title(ax, f"{title} (speed-up vs {members[0].variant})", where)
        writer.save(fig, names[key], f"{title} ({where})")


# ---- accuracy ----------------------------------------------------------------------------------------------------

def _accuracy_rows(report: Report) -> dict[tuple, list[tuple[dict[str, Any], str, float, int | None]]]:
    """(model, dtype, max length) -> (result, task, score, records) of every accuracy score."""
    from scoutbench.analysis.points import canonical_method

    rows: dict[tuple, list] = defaultdict(list)
    for r in report.accuracy:
        model = r.get("model") if isinstance(r.get("model"), dict) else {}
        tasks = r.get("results") if isinstance(r.get("results"), dict) else {}
        r = {**r, "method": canonical_method(str(r.get("method")))}
        for task, entry in sorted(tasks.items()):
            score = as_number(entry.get("score")) if isinstance(entry, dict) else None
            if score is not None and math.isfinite(score):
                n = entry.get("n") if isinstance(entry.get("n"), int) else None
                rows[(str(model.get("name")), str(model.get("dtype")), r.get("max_length"))].append(
                    (r, str(task), score, n))
    return dict(rows)


def _budget(result: dict[str, Any]) -> int | None:
    budget = (result.get("method_config") or {}).get("budget")
    return budget if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 else None


def _accuracy_figure(report: Report, writer: FigureWriter) -> None:
    """Score against the token budget, one panel per task: a line per sparse method (and per other setting that
    differs), the dense reference as a horizontal line, since it has no budget."""
    import matplotlib.pyplot as plt

    from scoutbench.methods import display_rank, is_reference

    stem, title = "accuracy_vs_budget", "Accuracy vs token budget"
    groups = {}
    for group, rows in _accuracy_rows(report).items():
        budgets = {_budget(r) for r, *_ in rows} - {None}
        if len(budgets) > 1:
            groups[group] = rows
    if not groups:
        report.skipped.append((stem, "no accuracy results at two or more budgets of one model"))
        return
    names = file_stems(stem, list(groups), ("model", "dtype", "max_length"))
    for group, rows in groups.items():
        tasks = sorted({task for _, task, _, _ in rows}, key=_natural)
        columns = min(3, len(tasks))
        lines = math.ceil(len(tasks) / columns)
        fig, axes = plt.subplots(lines, columns, figsize=(min(7.5, 2.6 * columns + 0.4), 2.3 * lines + 0.5),
                                 squeeze=False)
        handles: dict[str, Any] = {}
        for ax, task in zip(axes.flat, tasks, strict=False):
            series: dict[tuple[str, str], list[tuple[int | None, float]]] = defaultdict(list)
            records = {n for _, t, _, n in rows if t == task and n}
            for r, t, score, _ in rows:
                if t == task:
                    series[(r["method"], _accuracy_label(r))].append((_budget(r), score))
            ordered = sorted(series.items(), key=lambda item: (display_rank(item[0][0]), item[0][1]))
            for index, ((method, label), values) in enumerate(ordered):
                color = method_color(method)
                if is_reference(method) or all(b is None for b, _ in values):
                    handles[label] = ax.axhline(statistics.median(s for _, s in values), color=color,
                                                linestyle="--", linewidth=1.2, label=label)
                    continue
                values = sorted((b, s) for b, s in values if b is not None)
                shift = _dodge(index, len(ordered))  # equal scores stay visible side by side
                handles[label] = ax.plot([b * shift for b, _ in values], [s for _, s in values], linewidth=1.4,
                                         marker=MARKERS[index % len(MARKERS)], markersize=4, color=color,
                                         label=label)[0]
            budgets = sorted({_budget(r) for r, t, _, _ in rows if t == task} - {None})
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [format_length(b) for b in budgets])
            ax.minorticks_off()
            top = max(s for _, t, s, _ in rows if t == task)
            ax.set_ylim(0, max(1.0, min(105.0, top * 1.12)))  # from 0: a difference looks as large as it is
            ax.set_title(f"{task}" + (f" (n={max(records)})" if records else ""), fontsize=8)
        for index, ax in enumerate(axes.flat):  # axis titles on the outer panels only
            if index % columns == 0:
                ax.set_ylabel("score")
            if index + columns >= len(tasks):
                ax.set_xlabel("token budget")
        for ax in list(axes.flat)[len(tasks):]:
            ax.set_visible(False)
        model, dtype, max_length = group
        where = ", ".join(str(v) for v in (model, dtype, f"prompts up to {format_length(max_length)} tokens"
                                           if isinstance(max_length, int) else None) if v)
        fig.suptitle(f"{title}\n{where}", fontsize=9, x=0.02, ha="left")
        fig.legend(list(handles.values()), list(handles), loc="upper left", bbox_to_anchor=(1.0, 0.9),
                   borderaxespad=0.0)
        fig.tight_layout()
        writer.save(fig, names[group], f"{title} ({where})")


def _natural(text: str) -> list[Any]:
    """`passkey_4096` before `passkey_16384`: numbers inside names compared as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _accuracy_label(result: dict[str, Any]) -> str:
    """The method's paper name; with the config fields other than the budget that it ran with (the x axis holds
    the budget) only when they are not its defaults."""
    from scoutbench.methods import method_class

    method = result["method"]
    config = {k: v for k, v in (result.get("method_config") or {}).items() if k != "budget"}
    cls = method_class(method)
    defaults = cls.defaults() if cls is not None else {}
    changed = [_field_text(k, v) for k, v in sorted(config.items())
               if k in defaults and defaults[k] != v and k not in (cls.ablation_fields if cls else ())]
    return ", ".join([method_display(method, result.get("method_config") or {}), *changed])


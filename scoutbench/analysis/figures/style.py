"""What every figure of the report shares: the output formats and the writer that saves them, the paper's names
and one colour per method (the registry's display order picks it), legend labels, the median step's throughput
with its 95% interval as error bars, and the layout helpers (groups of points, file names, titles, legends) the
figure families draw with (`figures/throughput.py`, `figures/accuracy.py`)."""

from __future__ import annotations

import json
import re
import textwrap
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scoutbench.analysis.points import shared_settings
from scoutbench.units import format_length

if TYPE_CHECKING:
    from scoutbench.analysis.report import Point, Report

FIGURE_FORMATS = ("png", "pdf", "svg")
DEFAULT_FIGURE_FORMATS = ("png", "pdf")
PNG_DPI = 300
# the file stems figures are written under (with `_<group>` suffixes when there are several of one type): what a
# rerun of `report --overwrite` replaces
FIGURE_STEMS = ("throughput_vs_length", "batch_scaling", "block_size", "latency_breakdown", "ablation", "speedup",
                "cost_quality", "accuracy_vs_budget")
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
STAGE_LABELS = {"qkv_proj": "QKV projection", "predict": "query prediction", "attn_device": "GPU attention",
                "idle": "GPU idle (waiting on CPU work or copies)", "merge": "merge", "o_proj": "output projection",
                "mlp": "MLP", "other": "other"}
# a CPU-only run has no device: its "device" attention is the main thread's and its idle stage the main thread
# waiting for the CPU worker (tiers.py)
CPU_STAGE_LABELS = {**STAGE_LABELS, "attn_device": "attention on the main thread",
                    "idle": "main thread waiting for the CPU worker"}
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
    return f"{name} ({', '.join(field_text(k, v) for k, v in preset.items())})" if preset else name


def field_text(name: str, value: Any) -> str:
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
            parts = [field_text(n, f.get(n)) for n in varying]
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


def stage_label(stage: str, on_cuda: bool) -> str:
    """A breakdown stage under its honest name on the run's device (no "GPU" anything on a CPU-only run)."""
    return (STAGE_LABELS if on_cuda else CPU_STAGE_LABELS).get(stage, stage)


# what every figure states about its points besides what its groups fix (SETUP_FIELDS): the method settings and run
# settings that change a number; a field that is a figure's axis is its axis's to show
SETUP_FIELDS = ("budget", "block_size", "prefill", "steps")


def where_text(fields: tuple[str, ...], values: tuple, points: list[Point], axis: str | None = None) -> str:
    """The setup of a figure as its subtitle: what its group fixes (`tiny-qwen3, float32, 16k tokens, batch 1`),
    then the budget, block size, prefill and timed steps of its points, then the device: `..., budget 1k, block 32,
    synthetic prefill, 8 timed steps, Intel Xeon (AVX512, 2 threads)`. A setting that differs among the points
    lists its values and says that the legend tells them apart; `axis` is left to the axis."""
    parts = []
    device = None
    for name, value in zip(fields, values, strict=True):
        if name == "length":
            parts.append(f"{format_length(value)} tokens")
        elif name == "batch":
            parts.append(f"batch {value}" + (" (each method's largest)" if value == "auto" else ""))
        elif name == "device":
            device = device_text(points[0].result)
        else:
            parts.append(str(value))
    parts += [text for name in SETUP_FIELDS if name != axis and (text := setup_part(name, points))]
    return ", ".join([*parts, *([device] if device else [])])


def setup_part(name: str, points: list[Point]) -> str | None:
    """`budget 1k`; where the points differ, per method when each has one value (`budget Quest 1k, ScoutAttention
    2k`), else the values, which the legend tells apart (`budget 1k/2k (legend)`); `no budget (dense)`;
    `synthetic prefill`; `8 timed steps`."""
    def value(p: Point) -> Any:
        return p.config.get(name) if name in ("budget", "block_size") else json.loads(p.key.settings).get(name)

    having = [p for p in points if name not in ("budget", "block_size") or name in p.config]
    if not having:
        return "no budget (dense)" if name == "budget" else None
    # by their JSON: a hand-edited file's value may be a list, which a set cannot hold
    values = {json.dumps(value(p), sort_keys=True, default=str): value(p) for p in having}
    if len(values) == 1:
        shown = _value_text(name, next(iter(values.values())))
    else:
        per_method: dict[str, set[str]] = defaultdict(set)
        for p in having:
            per_method[method_display(p.method, p.config)].add(_value_text(name, value(p)))
        if all(len(v) == 1 for v in per_method.values()):
            shown = ", ".join(f"{method} {next(iter(v))}" for method, v in per_method.items())
        else:
            ordered = sorted(values.values(), key=lambda v: (v is None, str(v)))
            shown = "/".join(_value_text(name, v) for v in ordered) + " (legend)"
    if name == "prefill":
        return f"prefill {shown}" if len(values) > 1 else f"{shown} prefill"
    if name == "steps":
        return f"timed steps {shown}" if len(values) > 1 else f"{shown} timed steps"
    return f"{FIELD_LABELS.get(name, name)} {shown}"


# ---- values ---------------------------------------------------------------------------------------------------

def figure_value(point: Point) -> tuple[float, tuple[float, float] | None]:
    """(throughput, its 95% interval or None): the point's `decode_throughput_tok_s` (tokens over the total timed
    time, the median over its repeats: the number of every table, summary and export) and the bootstrap interval
    of it over the timed steps (step_stats.throughput_interval); no interval for runs without their steps."""
    return point.tok_s, point.tok_s_interval


def error_bars(values: list[float], intervals: list[tuple[float, float] | None]) -> list[list[float]] | None:
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

    def save(self, fig: Any, stem: str, title: str, points: Iterable[Point] = ()) -> None:
        """Write `fig` in every format; `points` are the throughput points it shows (the report checks that every
        point is in a figure or named with the reason it is not)."""
        import matplotlib.pyplot as plt

        files = []
        for fmt in self.formats:
            path = self.out / f"{stem}.{fmt}"
            metadata = {"CreationDate": None} if fmt == "pdf" else {"Date": None} if fmt == "svg" else None
            fig.savefig(path, dpi=PNG_DPI, bbox_inches="tight", pad_inches=0.03, metadata=metadata)
            files.append(path)
        plt.close(fig)
        self.report.figures.append((title, files))
        for p in points:
            self.report.drawn.setdefault(p.key, []).append(stem)



def comparison_group(p: Point) -> tuple:
    """What a point is compared with FullKV within (the summary's `vs fullkv`, the speed-up and cost-quality
    figures): everything but the method, its config and its dense layers (points.shared_settings)."""
    return (p.key.model, p.key.dtype, p.key.length, p.key.batch, p.device, shared_settings(p.key))


def point_field(p: Point, name: str) -> Any:
    return {"model": p.key.model, "dtype": p.key.dtype, "length": p.key.length, "batch": p.key.batch,
            "device": p.device, "method": p.method}[name]


def group_points(points: list[Point], fields: tuple[str, ...]) -> dict[tuple, list[Point]]:
    groups: dict[tuple, list[Point]] = defaultdict(list)
    for p in points:
        groups[tuple(point_field(p, f) for f in fields)].append(p)
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


def group_stems(stem: str, groups: list[tuple], fields: tuple[str, ...], extras: list[dict[str, Any]]) -> list[str]:
    """One file stem per group, in order: `file_stems` over the group's `fields`, and where groups share those
    (a point run twice with other steps, say), the `extras` (settings, config) that tell them apart
    (`ablation_len16k_steps8-warmup2`); numbered where nothing does."""
    shared: dict[tuple, list[int]] = defaultdict(list)
    for index, group in enumerate(groups):
        shared[group].append(index)
    parts = [""] * len(groups)
    for indices in shared.values():
        if len(indices) < 2:
            continue
        names = sorted({k for i in indices for k in extras[i]})
        varying = [k for k in names if len({json.dumps(extras[i].get(k), sort_keys=True, default=str)
                                             for i in indices}) > 1]
        for number, i in enumerate(indices, 1):
            parts[i] = "-".join(_setting_part(k, extras[i].get(k)) for k in varying) or str(number)
    keys = [group + (part,) for group, part in zip(groups, parts, strict=True)]
    names = file_stems(stem, list(dict.fromkeys(keys)), (*fields, ""))
    return [names[key] for key in keys]


def _setting_part(name: str, value: Any) -> str:
    """`steps8`, `prefill-real`: a setting as part of a file name."""
    text = _value_text(name, value)
    return f"{name}{text}" if isinstance(value, (int, float)) else f"{name}-{text}"


def _stem_part(name: str, value: Any) -> str:
    if name == "length" and isinstance(value, int):
        return f"len{format_length(value)}"
    if name == "batch":
        return f"b{value}"
    return "none" if value is None else str(value).replace(" ", "")


def set_title(ax: Any, title: str, where: str) -> None:
    """The figure's title over what it holds fixed, wrapped to the figure's width (about 15 characters an inch)."""
    width = max(40, int(ax.figure.get_figwidth() * 15))
    ax.set_title(f"{title}\n{textwrap.fill(where, width)}", fontsize=8.5, loc="left")


def series_styles(series: dict[str, list[Point]]) -> dict[str, dict[str, Any]]:
    """One colour per method; a method's second, third... series (other budgets, say) get other markers, dashes
    and bar hatches in the same colour (a line takes `line_style`, a bar its colour and hatch)."""
    seen: dict[str, int] = defaultdict(int)
    styles = {}
    for label, members in series.items():
        method = members[0].method
        index = seen[method]
        seen[method] += 1
        styles[label] = {"color": method_color(method), "marker": MARKERS[index % len(MARKERS)],
                         "linestyle": LINESTYLES[index % len(LINESTYLES)], "hatch": HATCHES[index % len(HATCHES)]}
    return styles


def line_style(style: dict[str, Any]) -> dict[str, Any]:
    """What a line (matplotlib's `errorbar`) takes of a series' style: no hatch, which only bars have."""
    return {k: style[k] for k in ("color", "marker", "linestyle")}


def ordered_series(points: list[Point], labels: dict[Any, str]) -> dict[str, list[Point]]:
    from scoutbench.methods import display_rank

    series: dict[str, list[Point]] = defaultdict(list)
    for p in sorted(points, key=lambda p: (display_rank(p.method), labels[p.key])):
        series[labels[p.key]].append(p)
    return dict(series)


def dodge(index: int, count: int) -> float:
    """The factor that moves series `index` of `count` sideways on a log2 axis (about 3% of a doubling apart)."""
    return 2.0 ** (0.03 * (index - (count - 1) / 2))


def place_legend(ax: Any, count: int) -> None:
    """Inside the axes for a few series; for more, in two columns under the axes, so that the figure keeps its
    width (never clipped: figures are saved with a tight bounding box)."""
    if count <= 4:
        ax.legend(loc="best")
    else:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, borderaxespad=0.0)


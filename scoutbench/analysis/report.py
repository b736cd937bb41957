"""`scoutbench report`: the paper's performance figures and a markdown summary from any mix of result files.

Figures (PNG, headless matplotlib): throughput vs input length per method (paper Figure 8), throughput vs batch
size (Figure 9), ScoutAttention throughput vs block size (Figure 10), stacked latency breakdown with idle time
(Figure 11) and the ablation bars with speed-up labels (Figure 12). A figure is drawn wherever the results have
the points it needs; everything that is not used (unreadable files, failed points, other kinds, metrics that are
not measurements, figures without enough points) is listed with the reason, so an empty-looking report explains
itself. Repeats of one point are merged: every number shown is the median over the repeats (as the gate does).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scoutbench.analysis.gate import (
    PointKey,
    batch_order,
    batch_text,
    canonical_method,
    device_class,
    method_label,
    metric_problem,
    metric_values,
    point_key,
    point_labels,
    shared_settings,
    varying_fields,
)
from scoutbench.errors import require_module
from scoutbench.methods import is_reference
from scoutbench.tiers import wait_frac
from scoutbench.units import format_length

STAGE_COLORS = {"qkv_proj": "#4c72b0", "predict": "#8172b3", "attn_device": "#55a868", "idle": "#c44e52",
                "merge": "#937860", "o_proj": "#64b5cd", "mlp": "#dd8452", "other": "#b0b0b0"}


@dataclass
class Point:
    """One ok throughput measurement (all its repeats on one device), flattened for plotting: every number is the
    median over the repeats."""

    key: PointKey
    runs: list[dict[str, Any]]
    label: str = ""

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
        return statistics.median(float(r["decode_throughput_tok_s"]) for r in self.runs)

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
    figures: list[tuple[str, Path]] = field(default_factory=list)  # (title, file)
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
            ok.append(result)
    report.points = _median_runs(ok, report)
    labels = point_labels([r for p in report.points for r in p.runs])
    for p in report.points:
        p.label = labels[p.key]
    return report


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


# ---- figures --------------------------------------------------------------------------------------------------

def build_report(paths: Iterable[str | Path], out_dir: str | Path) -> Report:
    from scoutbench.results import check_writable

    require_module("matplotlib", "report", "scoutbench report (its PNG figures)")
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    check_writable(out, single_file=False)  # an unwritable folder: exit 1, as for every other command's -o
    report = collect(paths)
    if not report.points:
        report.skipped.append(("figures", "no successful throughput results"))
    else:
        _line_figure(report, out, "length", "throughput_vs_length", "Decode throughput vs input length")
        _line_figure(report, out, "batch", "batch_scaling", "Decode throughput vs batch size")
        _block_size_figure(report, out)
        _breakdown_figure(report, out)
        _ablation_figure(report, out)
    report.summary = out / "summary.md"
    report.summary.write_text(summary_markdown(report, out), encoding="utf-8", errors="backslashreplace")
    return report


def _groups(points: list[Point], fields: tuple[str, ...]) -> dict[tuple, list[Point]]:
    groups: dict[tuple, list[Point]] = defaultdict(list)
    for p in points:
        groups[tuple(_field(p, f) for f in fields)].append(p)
    return dict(sorted(groups.items(), key=lambda item: str(item[0])))


def _field(p: Point, name: str) -> Any:
    return {"model": p.key.model, "dtype": p.key.dtype, "length": p.key.length, "batch": p.key.batch,
            "device": p.device, "method": p.method}[name]


def _describe(fields: tuple[str, ...], values: tuple) -> str:
    parts = []
    for name, value in zip(fields, values, strict=True):
        parts.append(f"len {format_length(value)}" if name == "length" else f"batch {value}" if name == "batch"
                     else str(value))
    return ", ".join(parts)


def _file_names(stem: str, groups: list[tuple]) -> dict[tuple, str]:
    """`stem.png` for one group; otherwise a suffix made of the group fields that differ between groups."""
    if len(groups) == 1:
        return {groups[0]: f"{stem}.png"}
    differing = [i for i in range(len(groups[0])) if len({g[i] for g in groups}) > 1]
    names = {}
    for g in groups:
        suffix = "_".join(str(g[i]) for i in differing)
        names[g] = f"{stem}_{re.sub(r'[^A-Za-z0-9.=-]+', '-', suffix).strip('-')}.png"
    return names


def _save(report: Report, fig: Any, out: Path, name: str, title: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    report.figures.append((title, out / name))


def _line_figure(report: Report, out: Path, axis: str, stem: str, title: str) -> None:
    """Throughput against `axis` (length or batch), one line per method, for each fixed rest of the point."""
    import matplotlib.pyplot as plt

    fixed = ("model", "dtype", "batch" if axis == "length" else "length", "device")
    plotted = [p for p in report.points if isinstance(_field(p, axis), int)]  # batch "auto" has no x position
    groups = {g: ps for g, ps in _groups(plotted, fixed).items() if len({_field(p, axis) for p in ps}) > 1}
    if not groups:
        what = "lengths" if axis == "length" else "batch sizes"
        report.skipped.append((f"{stem}.png", f"no model/{fixed[2]} has results at two or more {what}"))
        return
    names = _file_names(stem, list(groups))
    for group, points in groups.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label, series in _series(points).items():
            series.sort(key=lambda p: _field(p, axis))
            xs = [_field(p, axis) for p in series]
            ax.plot(xs, [p.tok_s for p in series], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ticks = sorted({_field(p, axis) for p in points})
        ax.set_xticks(ticks, [format_length(t) if axis == "length" else str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("input length (tokens)" if axis == "length" else "batch size")
        ax.set_ylabel("decode throughput (tok/s)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{title}\n{_describe(fixed, group)}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        _save(report, fig, out, names[group], f"{title} ({_describe(fixed, group)})")


def _series(points: list[Point], exclude: str | None = None) -> dict[str, list[Point]]:
    series: dict[str, list[Point]] = defaultdict(list)
    if exclude is None:
        for p in points:
            series[p.label].append(p)
        return dict(series)
    varying = varying_fields([p.result for p in points], exclude=[exclude])
    for p in points:
        series[method_label(p.method, p.config, varying.get(p.method, ()))].append(p)
    return dict(series)


def _block_size_figure(report: Report, out: Path) -> None:
    import matplotlib.pyplot as plt

    stem, title = "block_size", "Decode throughput vs block size"
    fixed = ("model", "dtype", "length", "batch", "device")
    with_blocks = [p for p in report.points if isinstance(p.config.get("block_size"), int)
                   and not isinstance(p.config.get("block_size"), bool)]
    groups = {g: ps for g, ps in _groups(with_blocks, fixed).items()
              if len({p.config["block_size"] for p in ps}) > 1}
    if not groups:
        report.skipped.append((f"{stem}.png", "no point has results at two or more block sizes"))
        return
    names = _file_names(stem, list(groups))
    for group, points in groups.items():
        series = _series(points, exclude="block_size")
        sizes = sorted({p.config["block_size"] for p in points})
        width = 0.8 / len(series)
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for i, (label, members) in enumerate(series.items()):
            by_size = {p.config["block_size"]: p.tok_s for p in members}
            xs = [j + i * width for j, s in enumerate(sizes) if s in by_size]
            bars = ax.bar(xs, [by_size[s] for s in sizes if s in by_size], width, label=label)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [str(s) for s in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("decode throughput (tok/s)")
        ax.set_title(f"{title}\n{_describe(fixed, group)}", fontsize=10)
        ax.legend(fontsize=8)
        _save(report, fig, out, names[group], f"{title} ({_describe(fixed, group)})")


def _breakdown_figure(report: Report, out: Path) -> None:
    """Stacked per-stage latency per point; the idle share (GPU stalled on the CPU or on copies) is labelled."""
    import matplotlib.pyplot as plt

    from scoutbench.timing import STAGES

    stem, title = "latency_breakdown", "Decode latency breakdown per step"
    fixed = ("model", "dtype", "device")
    usable = [p for p in report.points if p.breakdown_ms() is not None]
    if not usable:
        report.skipped.append((f"{stem}.png", "no result has latency_breakdown_ms"))
        return
    groups = _groups(usable, fixed)
    names = _file_names(stem, list(groups))
    for group, points in groups.items():
        points.sort(key=lambda p: (p.key.length or 0, batch_order(p.key.batch), _method_rank(p.method), p.label))
        several = len({(p.key.length, p.key.batch) for p in points}) > 1
        labels = [p.label.replace(" ", "\n") + (f"\n{format_length(p.key.length)} {batch_text(p.key.batch)}"
                                                if several else "") for p in points]
        fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(points) + 2), 4.6))
        bottoms = [0.0] * len(points)
        breakdowns = [p.breakdown_ms() or {} for p in points]
        for stage in STAGES:
            values = [breakdown.get(stage, 0.0) for breakdown in breakdowns]
            ax.bar(range(len(points)), values, 0.6, bottom=bottoms, label=stage, color=STAGE_COLORS.get(stage),
                   hatch="//" if stage == "idle" else None)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
        for i, p in enumerate(points):
            idle = 100 * float(p.wait_frac or 0.0)
            word = "idle" if p.on_gpu else "wait"  # CPU: the main thread's wait
            ax.annotate(f"{word} {idle:.0f}%", (i, bottoms[i]), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(points)), labels, fontsize=7)
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"{title}\n{_describe(fixed, group)}", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_xlim(-0.8, len(points) - 0.2)
        ax.margins(y=0.1)
        _save(report, fig, out, names[group], f"{title} ({_describe(fixed, group)})")


def _method_rank(method: str) -> int:
    from scoutbench.methods import display_rank

    return display_rank(method)


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


def _ablation_figure(report: Report, out: Path) -> None:
    import matplotlib.pyplot as plt

    from scoutbench.methods import ABLATION_METHODS, method_class

    stem = "ablation"
    groups = ablation_groups(report.points)
    if not groups:
        report.skipped.append((f"{stem}.png", f"no point has two or more of {' / '.join(ABLATION_METHODS)}"))
        return
    keys = [group[:5] for group in groups]
    if len(set(keys)) < len(keys):  # same point, different other fields (e.g. budgets): number them
        keys = [key + (str(i),) for i, key in enumerate(keys, 1)]
    names = _file_names(stem, keys)
    for (group, members), key in zip(groups.items(), keys, strict=True):
        name = names[key]
        cls = method_class(members[0].method)
        title = f"Ablation: {cls.display_name or cls.name} optimisations"
        base = members[0].tok_s
        fig, ax = plt.subplots(figsize=(5.2, 4.2))
        bars = ax.bar([p.variant for p in members], [p.tok_s for p in members], 0.6, color="#4c72b0")
        ax.bar_label(bars, [f"{p.tok_s / base:.2f}x" for p in members], fontsize=9)
        ax.set_ylabel("decode throughput (tok/s)")
        where = _describe(("model", "dtype", "length", "batch", "device"), group[:5])
        ax.set_title(f"{title} (speed-up vs {members[0].variant})\n{where}", fontsize=10)
        ax.margins(y=0.15)
        _save(report, fig, out, name, f"{title} ({where})")


# ---- markdown -------------------------------------------------------------------------------------------------

def summary_markdown(report: Report, out: Path) -> str:
    lines = ["# scoutbench report", "",
             f"{len(report.points)} throughput points, {len(report.accuracy)} accuracy results, "
             f"{len(report.projections)} projections, "
             f"{len(report.failed)} failed, {len(report.skipped)} items skipped.", ""]
    if report.points:
        lines += ["## Throughput", "",
                  "tok/s is batch x timed steps / timed decode time (the mean step); step ms is the median step. "
                  "`vs fullkv` compares total throughput with FullKV's at the same point; where the two ran at "
                  "different batches (`--batch auto`), it also gives the per-sequence ratio (`/seq`). Repeats are "
                  "merged: every number is the median over the `runs`.", "",
                  "| method | model | dtype | len | batch | tok/s (mean step) | step ms (median) | idle/wait % "
                  "| vs fullkv | runs | device |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        fullkv = {_comparison_group(p): p for p in report.points if is_reference(p.method)}
        for p in sorted(report.points, key=lambda p: (p.key.model, p.key.dtype, p.key.length or 0,
                                                      batch_order(p.key.batch), _method_rank(p.method), p.label)):
            base = fullkv.get(_comparison_group(p))
            idle = p.wait_frac
            speedup = speedup_text(p.tok_s, p.batch_used, base.tok_s, base.batch_used) if base else "-"
            lines.append(f"| {p.label} | {p.key.model} | {p.key.dtype} | {format_length(p.key.length)} "
                         f"| {_batch_cell(p)} | {p.tok_s:.2f} | {p.step_ms:.2f} "
                         f"| {_num(None if idle is None else 100 * idle, '.1f')} "
                         f"| {speedup} | {len(p.runs)} | {p.device} |")
        lines.append("")
    groups = ablation_groups(report.points)
    if groups:
        lines += ["## Ablation (the variants of paper Figure 12; CPU-only points are not the paper's figure)", "", "| point | variant | tok/s | speed-up | step-to-step |",
                  "|---|---|---|---|---|"]
        for group, members in groups.items():
            where = _describe(("model", "dtype", "length", "batch", "device"), group[:5])
            for i, p in enumerate(members):
                step_up = f"{p.tok_s / members[i - 1].tok_s:.2f}x" if i else "-"
                lines.append(f"| {where} | {p.variant} | {p.tok_s:.2f} | {p.tok_s / members[0].tok_s:.2f}x "
                             f"| {step_up} |")
        lines.append("")
    if report.accuracy:
        lines += ["## Accuracy", "", "| method | model | metric | value |", "|---|---|---|---|"]
        for r in report.accuracy:
            for metric, (value, _) in sorted(metric_values(r).items()):
                lines.append(f"| {canonical_method(str(r.get('method')))} | {(r.get('model') or {}).get('name')} "
                             f"| {metric} | {value:.2f} |")
        lines.append("")
    if report.projections:
        from scoutbench.analysis.projection import projection_markdown

        lines += ["## Projections", ""]
        for document in report.projections:
            lines += projection_markdown(document) + [""]
    if report.figures:
        lines += ["## Figures", ""]
        for title, path in report.figures:
            lines += [f"### {title}", "", f"![{title}]({path.relative_to(out).as_posix()})", ""]
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


def _comparison_group(p: Point) -> tuple:
    """What a point is compared with FullKV within: everything but the method, its config and its dense layers."""
    return (p.key.model, p.key.dtype, p.key.length, p.key.batch, shared_settings(p.key), p.device)


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

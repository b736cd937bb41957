"""The accuracy figure of the report: score (0-100) against the token budget with each point's 95% interval, one
panel per task (and top-1 agreement and KL panels for a task whose scores are flat), a line per sparse method and
the dense reference as a horizontal line."""

from __future__ import annotations

import math
import re
import statistics
import textwrap
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from scoutbench.analysis.figures.style import (
    MARKERS,
    dodge,
    field_text,
    file_stems,
    method_color,
    method_display,
)
from scoutbench.analysis.points import as_number
from scoutbench.units import format_length

if TYPE_CHECKING:
    from scoutbench.analysis.figures.style import FigureWriter
    from scoutbench.analysis.report import Report


def _accuracy_rows(report: Report) -> dict[tuple, list[tuple[dict[str, Any], str, dict[str, Any]]]]:
    """(model, dtype, max length) -> (result, task, task entry) of every finite accuracy score."""
    from scoutbench.analysis.points import canonical_method

    rows: dict[tuple, list] = defaultdict(list)
    for r in report.accuracy:
        model = r.get("model") if isinstance(r.get("model"), dict) else {}
        tasks = r.get("results") if isinstance(r.get("results"), dict) else {}
        r = {**r, "method": canonical_method(str(r.get("method")))}
        for task, entry in sorted(tasks.items()):
            score = as_number(entry.get("score")) if isinstance(entry, dict) else None
            if score is not None and math.isfinite(score):
                rows[(str(model.get("name")), str(model.get("dtype")), r.get("max_length"))].append(
                    (r, str(task), entry))
    return dict(rows)


def _budget(result: dict[str, Any]) -> int | None:
    budget = (result.get("method_config") or {}).get("budget")
    return budget if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 else None


# what a panel plots: (title suffix, y label, entry -> (value, interval) or None, the reference's own value, y range)
PANELS: dict[str, tuple[str, str, Any, float, tuple[float, float] | None]] = {
    "score": ("", "score (0-100)", lambda e: _valued(e, "score"), None, (0.0, 105.0)),
    "top1": ("top-1 agreement", "top-1 agreement\nwith FullKV (%)",
             lambda e: _valued(e.get("fidelity"), "top1_agreement"), 100.0, (0.0, 105.0)),
    "kl": ("KL", "KL(FullKV || method)\n(nats)", lambda e: _valued(e.get("fidelity"), "kl_mean"), 0.0, None),
}


def _valued(entry: Any, name: str) -> tuple[float, tuple[float, float] | None] | None:
    """(value, its 95% interval or None) of `name` in a result entry (`<name>_ci95`, `analysis/bootstrap.py`)."""
    if not isinstance(entry, dict):
        return None
    value = as_number(entry.get(name))
    if value is None or not math.isfinite(value):
        return None
    ci = entry.get(f"{name}_ci95")
    low, high = (as_number(ci[0]), as_number(ci[1])) if isinstance(ci, list) and len(ci) == 2 else (None, None)
    interval = (min(low, value), max(high, value)) if low is not None and high is not None else None
    return value, interval


def _panels(rows: list[tuple[dict[str, Any], str, dict[str, Any]]]) -> list[tuple[str, str]]:
    """(kind, task) per panel: each task's official score; where those are flat (the same for every
    configuration, e.g. 0 on a model too small for the task, or 100 on every passkey) and the teacher-forced
    fidelity was measured, also its top-1 agreement and KL, which still tell the methods apart."""
    panels = []
    for task in sorted({t for _, t, _ in rows}, key=_natural):
        entries = [e for _, t, e in rows if t == task]
        panels.append(("score", task))
        scores = {round(float(e["score"]), 6) for e in entries}
        if len(scores) == 1 and any(PANELS["top1"][2](e) for e in entries):
            panels += [("top1", task), ("kl", task)]
    return panels


def accuracy_figure(report: Report, writer: FigureWriter) -> None:
    """Score (0-100) against the token budget, one panel per task, with the 95% interval of every point (the
    bootstrap over records the results store); a line per sparse method (and per other setting that differs), the
    dense reference as a horizontal line with its interval as a band, since it has no budget. Tasks whose scores
    are flat get top-1 agreement and KL panels. The title states what is fixed; the legend sits under the panels."""
    import matplotlib.pyplot as plt

    from scoutbench.analysis.figures.style import device_text, error_bars
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
        panels = _panels(rows)
        columns = min(3, len(panels))
        lines = math.ceil(len(panels) / columns)
        fig, axes = plt.subplots(lines, columns, figsize=(min(7.5, 2.6 * columns + 0.4), 2.3 * lines + 1.0),
                                 squeeze=False, layout="constrained")
        handles: dict[str, Any] = {}
        for ax, (kind, task) in zip(axes.flat, panels, strict=False):
            suffix, ylabel, value_of, reference_value, limits = PANELS[kind]
            series: dict[tuple[str, str], list[tuple[int | None, float, tuple[float, float] | None]]] = \
                defaultdict(list)
            records = {e.get("n") for _, t, e in rows if t == task and isinstance(e.get("n"), int)}
            for r, t, entry in rows:
                valued = value_of(entry) if t == task else None
                if valued is not None:
                    series[(r["method"], _accuracy_label(r))].append((_budget(r), *valued))
            ordered = sorted(series.items(), key=lambda item: (display_rank(item[0][0]), item[0][1]))
            for index, ((method, label), values) in enumerate(ordered):
                color = method_color(method)
                if is_reference(method) or all(b is None for b, _, _ in values):
                    value = statistics.median(v for _, v, _ in values)
                    handles[label] = ax.axhline(value, color=color, linestyle="--", linewidth=1.2, label=label)
                    band = next((i for _, v, i in values if i is not None and v == value), None)
                    if band is not None:
                        ax.axhspan(*band, color=color, alpha=0.08, linewidth=0)
                    continue
                values = sorted((b, v, i) for b, v, i in values if b is not None)
                shift = dodge(index, len(ordered))  # equal values stay visible side by side
                xs, ys = [b * shift for b, _, _ in values], [v for _, v, _ in values]
                handles[label] = ax.errorbar(xs, ys, yerr=error_bars(ys, [i for _, _, i in values]), linewidth=1.4,
                                             marker=MARKERS[index % len(MARKERS)], markersize=4, color=color,
                                             label=label)
            if reference_value is not None:  # FullKV against itself: top-1 100%, KL 0
                line = ax.axhline(reference_value, color=method_color("fullkv"), linestyle="--", linewidth=1.2)
                handles.setdefault(method_display("fullkv", {}), line)
            budgets = sorted({_budget(r) for r, t, _ in rows if t == task} - {None})
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [format_length(b) for b in budgets])
            ax.minorticks_off()
            if limits is not None:
                ax.set_ylim(*limits)  # the whole 0-100 scale: a difference looks as large as it is
            else:
                ax.set_ylim(bottom=0)
            n_text = f"n={max(records)}" if records else ""
            ax.set_title(", ".join(p for p in (task, suffix, n_text) if p), fontsize=8)
            ax.set_ylabel(ylabel)
            ax.set_xlabel("token budget")
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        model, dtype, max_length = group
        sample = rows[0][0]
        where = ", ".join(str(v) for v in (model, dtype, f"prompts up to {format_length(max_length)} tokens"
                                           if isinstance(max_length, int) else None, device_text(sample),
                                           "greedy", "error bars: 95% bootstrap interval over records") if v)
        fig.suptitle(f"{title}\n{textwrap.fill(where, 110)}", fontsize=9)
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=min(3, len(handles)))
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
    changed = [field_text(k, v) for k, v in sorted(config.items())
               if k in defaults and defaults[k] != v and k not in (cls.ablation_fields if cls else ())]
    return ", ".join([method_display(method, result.get("method_config") or {}), *changed])

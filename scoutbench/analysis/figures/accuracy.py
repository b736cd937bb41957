"""The accuracy figure of the report: score against the token budget, one panel per task, a line per sparse
method and the dense reference as a horizontal line."""

from __future__ import annotations

import math
import re
import statistics
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


def accuracy_figure(report: Report, writer: FigureWriter) -> None:
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
                shift = dodge(index, len(ordered))  # equal scores stay visible side by side
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
    changed = [field_text(k, v) for k, v in sorted(config.items())
               if k in defaults and defaults[k] != v and k not in (cls.ablation_fields if cls else ())]
    return ", ".join([method_display(method, result.get("method_config") or {}), *changed])

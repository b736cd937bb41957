"""The report's accuracy figure (issue 46 item 3): a 0-100 score axis labelled as such, every point with its 95%
interval, a title that never runs into the legend, and top-1 agreement and KL panels for a task whose official
scores are flat (0 for every configuration on a small model, although the fidelity tells the methods apart)."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402
from result_factory import make_accuracy  # noqa: E402

from scoutbench.analysis.figures import STYLE  # noqa: E402
from scoutbench.analysis.figures.accuracy import accuracy_figure  # noqa: E402
from scoutbench.analysis.report import Report  # noqa: E402


class _Keep:
    """A figure writer that keeps the figures to look at (and closes none)."""

    def __init__(self) -> None:
        self.figures: list[tuple[Any, str, str]] = []

    def save(self, fig: Any, stem: str, title: str) -> None:
        self.figures.append((fig, stem, title))


def _accuracy(method: str, budget: int | None, scores: dict[str, tuple[float, list[float]]],
              fidelity: dict[str, tuple[float, list[float], float, list[float]]] | None = None) -> dict[str, Any]:
    result = make_accuracy(method, {task: score for task, (score, _) in scores.items()})
    result["method_config"] = {} if budget is None else {"budget": budget}
    for task, (_, ci) in scores.items():
        result["results"][task] |= {"score_ci95": ci, "n": 3}
        if fidelity and task in fidelity:
            top1, top1_ci, kl, kl_ci = fidelity[task]
            result["results"][task]["fidelity"] = {"steps": 32, "top1_agreement": top1, "top1_agreement_ci95": top1_ci,
                                                   "kl_mean": kl, "kl_mean_ci95": kl_ci}
    return result


def test_the_accuracy_figure_is_a_0_100_score_with_intervals_and_a_fidelity_panel_when_flat():
    report = Report(accuracy=[
        _accuracy("fullkv", None, {"qasper": (0.6, [0.0, 1.8]), "samsum": (0.0, [0.0, 0.0])}),
        *(_accuracy("scout", budget, {"qasper": (score, [0.0, 2 * score]), "samsum": (0.0, [0.0, 0.0])},
                    {"samsum": (top1, [top1 - 5, top1 + 3], 0.1, [0.05, 0.2])})
          for budget, score, top1 in ((1024, 0.4, 80.0), (2048, 0.5, 90.0)))])
    writer = _Keep()
    with matplotlib.rc_context(STYLE):
        accuracy_figure(report, writer)
    (fig, stem, _), = writer.figures
    assert stem == "accuracy_vs_budget"
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(panels) == {"qasper, n=3", "samsum, n=3", "samsum, top-1 agreement, n=3", "samsum, KL, n=3"}
    qasper = panels["qasper, n=3"]
    # scores under 1 on a 0-100 score: the axis still spans 0-100 and says so
    assert qasper.get_ylabel() == "score (0-100)" and qasper.get_ylim() == (0.0, 105.0)
    bars = [c for c in qasper.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 1 and bars[0].has_yerr  # ScoutAttention's two budgets, with their intervals
    (segments,) = [c.get_segments() for c in bars[0].lines[2]]
    assert sorted((round(s[0][1], 6), round(s[1][1], 6)) for s in segments) == [(0.0, 0.8), (0.0, 1.0)]
    top1 = panels["samsum, top-1 agreement, n=3"]
    assert top1.get_ylim() == (0.0, 105.0) and "top-1" in top1.get_ylabel()
    (line,) = [c for c in top1.containers if isinstance(c, ErrorbarContainer)]
    assert [round(y, 6) for y in line.lines[0].get_ydata()] == [80.0, 90.0]
    # the title and the legend never overlap
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title, legend = fig._suptitle.get_window_extent(renderer), fig.legends[0].get_window_extent(renderer)
    assert not title.overlaps(legend)
    assert all(not title.overlaps(ax.get_window_extent(renderer)) for ax in panels.values())
    plt.close(fig)


def test_the_reports_accuracy_table_shows_each_scores_interval_and_n():
    from scoutbench.analysis.report import summary_markdown

    result = _accuracy("scout", 1024, {"qasper": (41.5, [30.0, 52.25])})
    text = summary_markdown(Report(accuracy=[result]))
    assert "| method | setting | budget | model | metric | value | 95% interval | n |" in text
    assert ("| scout | pool 1 (the paper's) | 1024 | smollm2-135m | qasper.score | 41.50 | [30.00, 52.25] † | 3 |"
            in text)

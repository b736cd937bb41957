"""The report's figures, drawn for a paper: the paper's figure types (throughput vs input length, Figure 8; batch
scaling, Figure 9; block size, Figure 10; latency breakdown with idle time, Figure 11; ablation, Figure 12), the
speed-up over FullKV at one point, cost against quality, and accuracy vs budget, each written as PNG (300 dpi) and
as vector PDF/SVG with embedded TrueType text.

What a reader of a paper needs: method names as the papers write them (`ScoutAttention (+PC)`, not
`scout-pc pc=True`), one colour per method in every figure (the registry's display order picks it), 95% intervals
as error bars, every figure's setup in its subtitle (model, dtype, length, batch, budget, block size, prefill,
timed steps, device), and legends that are never cut off (figures are saved with a tight bounding box).
Throughput in a figure is the one of every table and export: tokens over the total timed time
(`decode_throughput_tok_s`).

The figures are one module per family: `style.py` (what every figure shares: formats, writer, names, colours,
values, layout), `throughput.py` (Figures 8 to 12), `comparison.py` (speed-up, cost vs quality) and `accuracy.py`
(accuracy vs budget).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scoutbench.analysis.figures.accuracy import accuracy_figure
from scoutbench.analysis.figures.comparison import draw_comparisons
from scoutbench.analysis.figures.style import (
    DEFAULT_FIGURE_FORMATS,
    FIGURE_FORMATS,
    FIGURE_STEMS,
    STYLE,
    FigureWriter,
    comparison_group,
    device_text,
    figure_value,
    legend_labels,
    method_color,
    method_display,
    parse_formats,
)
from scoutbench.analysis.figures.throughput import ablation_groups, draw_throughput, variant_labels

if TYPE_CHECKING:
    from scoutbench.analysis.report import Report

__all__ = ["DEFAULT_FIGURE_FORMATS", "FIGURE_FORMATS", "FIGURE_STEMS", "FigureWriter", "ablation_groups",
           "comparison_group", "device_text", "draw_all", "figure_value", "legend_labels", "method_color",
           "method_display", "parse_formats", "variant_labels"]


def draw_all(report: Report, writer: FigureWriter) -> None:
    """Every figure the results have the points for; what cannot be drawn is listed in `report.skipped`."""
    import matplotlib

    matplotlib.use("Agg")
    with matplotlib.rc_context(STYLE):
        draw_throughput(report, writer)
        if report.points:
            draw_comparisons(report, writer)
        accuracy_figure(report, writer)
    shown = {p.key for p in report.points if p.key in report.drawn}
    for p in report.points:  # every point is in a figure or named here; each family's line above says why
        if p.key not in shown:
            report.skipped.append((p.label, f"{p.key.describe()} is in no figure (the lines above say why of "
                                             "each figure); it is in the summary's table"))

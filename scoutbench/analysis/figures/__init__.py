"""The report's figures, drawn for a paper: the paper's figure types (throughput vs input length, Figure 8; batch
scaling, Figure 9; block size, Figure 10; latency breakdown with idle time, Figure 11; ablation, Figure 12; and
accuracy vs budget), each written as PNG (300 dpi) and as vector PDF/SVG with embedded TrueType text.

What a reader of a paper needs: method names as the papers write them (`ScoutAttention (+PC)`, not
`scout-pc pc=True`), one colour per method in every figure (the registry's display order picks it), the median
step's 95% interval as error bars wherever the results store it, and legends that are never cut off (figures are
saved with a tight bounding box). Throughput in a figure is the throughput of the median step (batch x 1000 /
median step ms), the number the stored interval belongs to; the summary's tables give the mean-step throughput too.

The figures are one module per family: `style.py` (what every figure shares: formats, writer, names, colours,
values, layout), `throughput.py` (Figures 8 to 12) and `accuracy.py` (accuracy vs budget).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scoutbench.analysis.figures.accuracy import accuracy_figure
from scoutbench.analysis.figures.style import (
    DEFAULT_FIGURE_FORMATS,
    FIGURE_FORMATS,
    FIGURE_STEMS,
    STYLE,
    FigureWriter,
    device_text,
    figure_value,
    legend_labels,
    median_step_tok_s,
    method_color,
    method_display,
    parse_formats,
)
from scoutbench.analysis.figures.throughput import ablation_groups, draw_throughput

if TYPE_CHECKING:
    from scoutbench.analysis.report import Report

__all__ = ["DEFAULT_FIGURE_FORMATS", "FIGURE_FORMATS", "FIGURE_STEMS", "FigureWriter", "ablation_groups",
           "device_text", "draw_all", "figure_value", "legend_labels", "median_step_tok_s", "method_color",
           "method_display", "parse_formats"]


def draw_all(report: Report, writer: FigureWriter) -> None:
    """Every figure the results have the points for; what cannot be drawn is listed in `report.skipped`."""
    import matplotlib

    matplotlib.use("Agg")
    with matplotlib.rc_context(STYLE):
        draw_throughput(report, writer)
        accuracy_figure(report, writer)

"""`scoutbench report` renders every combination it is given: the grids of every sweep preset (both scales) and of
`sweep --help`'s example, each reported together with a plain sweep of the same points (other steps), as result
files made by the result factory (no decode). Every point is drawn in each figure family it belongs to, or named
with the reason it is not; every figure states its setup; nothing crashes.

The two defects this pins: one method at two configurations across lengths crashed `report` ("Line2D.set() got
an unexpected keyword argument 'hatch'"), and the ablation preset reported with a plain sweep of the same point
kept 4 of its 7 points, silently."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace

import pytest
from cli_runner import run_cli
from result_factory import SCOUT_CONFIG, make_result, sweep_results, write_results

from scoutbench.analysis.figures import FIGURE_STEMS
from scoutbench.analysis.figures.comparison import comparisons
from scoutbench.analysis.report import build_report
from scoutbench.bench.sweep_grid import PRESETS, Grid, Settings, expand
from scoutbench.methods import ABLATION_METHODS, ablation_variant

# `sweep --help`'s --config example: len: [4k, 8k], method: [fullkv, scout], method_arg: {recall_interval: [4, 8]}
HELP_EXAMPLE = Grid(("fullkv", "scout"), (4096, 8192), (1,), method_args={"recall_interval": ("4", "8")})


def _plain(settings: Settings) -> Settings:
    """The same points as a plain `sweep` runs them: its default steps and warm-up (the presets use a shorter
    warm-up at the cpu scale), the same model and prefill default."""
    return replace(Settings(), model=settings.model)


def _grid_results(name: str, scale: str) -> list[dict]:
    grid, settings = PRESETS[name].grid_and_settings(scale)
    # a plain sweep of the same point: for the ablation every variant by name (`--method scout-base,scout-pc,
    # scout-pr,scout`), as the issue ran it
    plain_grid = replace(grid, methods=tuple(ABLATION_METHODS)) if name == "ablation" else grid
    return sweep_results(expand(grid), settings) + sweep_results(expand(plain_grid), _plain(settings), 0.9)


def _check_report(results: list[dict], tmp_path) -> tuple:
    report = build_report([write_results(tmp_path / "runs", results)], tmp_path / "out", formats=("svg",))
    family = defaultdict(set)  # figure type -> the points drawn in a figure of it
    for key, stems in report.drawn.items():
        for stem in stems:
            family[next(name for name in FIGURE_STEMS if stem.startswith(name))].add(key)
    points = report.points
    summary = report.summary.read_text()

    # every point is a row of the summary's table, and in the breakdown (every result has one)
    table = summary.split("## Throughput")[1].split("\n## ")[0]
    assert len([line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| method")]) \
        == len(points)
    assert {p.key for p in points} <= family["latency_breakdown"]
    assert not [what for what, why in report.skipped if "is in no figure" in why]

    def series(p, axis):  # what a line of `axis` joins: everything of the point but that axis
        return (p.method, p.key.config, p.key.model, p.key.dtype, p.key.settings, p.device,
                p.key.batch if axis == "length" else p.key.length)

    for axis, stem, values in (("length", "throughput_vs_length", lambda p: p.key.length),
                               ("batch", "batch_scaling", lambda p: p.key.batch)):
        positions = defaultdict(set)
        for p in points:
            if isinstance(values(p), int):
                positions[series(p, axis)].add(values(p))
        expected = {p.key for p in points if isinstance(values(p), int) and len(positions[series(p, axis)]) > 1}
        assert expected <= family[stem], (stem, expected - family[stem])
    sizes = defaultdict(set)
    for p in points:
        if "block_size" in p.config:
            sizes[(p.key.model, p.key.dtype, p.key.length, p.key.batch, p.device)].add(p.config["block_size"])
    assert {p.key for p in points if "block_size" in p.config and len(
        sizes[(p.key.model, p.key.dtype, p.key.length, p.key.batch, p.device)]) > 1} <= family["block_size"]
    variants = defaultdict(set)
    for p in points:
        if p.variant is not None:
            rest = {k: v for k, v in p.config.items() if k not in ("pc", "pr")}
            variants[(p.key.model, p.key.length, p.key.batch, p.key.settings, json.dumps(rest, sort_keys=True))].add(
                p.key)
    ablated = {key for keys in variants.values() if len(keys) > 1 for key in keys}
    assert ablated <= family["ablation"]
    ablation_rows = summary.split("## Ablation")[1].split("\n## ")[0] if ablated else ""
    assert len([line for line in ablation_rows.splitlines() if line.startswith("| ") and "variant" not in line]) \
        == len(ablated)
    for comparison in comparisons(points).values():
        members = {p.key for p in comparison.points}
        if comparison.reference is not None and len(members) > 1:
            assert members <= family["speedup"]
        if len(members) > 1:
            assert members <= family["cost_quality"]

    # every figure states its setup
    for title, _ in report.figures:
        for part in (points[0].key.model, "batch", "prefill", "timed steps", "Test CPU"):
            assert part in title, (part, title)
        assert "budget" in title, title
        assert "tokens" in title or title.startswith("Decode throughput vs input length"), title
    return report


@pytest.mark.parametrize("scale", ["cpu", "paper"])
def test_every_preset_with_a_plain_sweep_of_its_points_renders_every_point(tmp_path, scale):
    results = [r for name in PRESETS for r in _grid_results(name, scale)]
    report = _check_report(results, tmp_path)
    ablations = [title for title, _ in report.figures if title.startswith("Ablation")]
    # cpu: the preset's (3 variants, warm-up 2) and the plain sweep's (4, warm-up 3), each a figure; paper: the
    # preset runs a plain sweep's steps and warm-up, so its 3 points are repeats of the plain sweep's and one figure
    # has all 4
    assert len(ablations) == (2 if scale == "cpu" else 1)


def test_sweep_help_example_grid_renders_both_recall_intervals(tmp_path):
    """`sweep --help`'s own grid: scout at recall_interval 4 and 8 over two lengths crashed the line figure."""
    settings = Settings(model="tiny-qwen3")
    results = sweep_results(expand(HELP_EXAMPLE), settings) + sweep_results(expand(HELP_EXAMPLE),
                                                                            replace(settings, steps=8), 1.1)
    _check_report(results, tmp_path)
    svg = (tmp_path / "out" / "throughput_vs_length.svg").read_text()
    assert all(f"recall every {n}" in svg for n in (4, 8)), svg


def test_one_method_at_two_budgets_across_lengths_is_one_line_each(monkeypatch, capsys, tmp_path):
    """The issue's first reproduction, end to end through the CLI: exit 1, "internal error ... 'hatch'", no figure."""
    results = [make_result("fullkv", 40.0, length=512), make_result("fullkv", 30.0, length=1024)]
    results += [make_result("scout", 80.0 + budget / 64, length=length, config={**SCOUT_CONFIG, "budget": budget})
                for budget in (128, 256) for length in (512, 1024)]
    folder = write_results(tmp_path / "runs", results)
    code, out, err = run_cli(monkeypatch, capsys, "report", folder, "-o", tmp_path / "out", "--figure-format", "svg")
    assert code == 0, out + err
    svg = (tmp_path / "out" / "throughput_vs_length.svg").read_text()
    assert "ScoutAttention, budget 128" in svg and "ScoutAttention, budget 256" in svg and ">FullKV<" in svg


def test_the_ablation_preset_and_a_plain_sweep_of_its_point_keep_all_seven(tmp_path):
    """The issue's second reproduction: 7 ablation points gave one figure and a 4-row table, with no word about the
    other 3."""
    grid, settings = PRESETS["ablation"].grid_and_settings("cpu")
    results = sweep_results(expand(grid), settings)
    results += sweep_results(expand(replace(grid, methods=tuple(ABLATION_METHODS))), _plain(settings), 0.9)
    report = build_report([write_results(tmp_path / "runs", results)], tmp_path / "out", formats=("svg",))
    assert len(report.points) == 7
    assert sorted(name.name for _, files in report.figures for name in files if name.name.startswith("ablation")) \
        == ["ablation_warmup2.svg", "ablation_warmup3.svg"]
    ablation = report.summary.read_text().split("## Ablation")[1].split("\n## ")[0]
    rows = defaultdict(list)  # settings -> the variants in the table's order
    for line in ablation.splitlines():
        if line.startswith("| bench-attn16"):
            settings_cell, variant = line.split("|")[2:4]
            rows[settings_cell.strip()].append(variant.strip())
    assert rows == {"32 steps, 2 warm-up, synthetic prefill": ["co-attention", "+PC", "+PC+PR"],
                    "32 steps, 3 warm-up, synthetic prefill": ["co-attention", "+PC", "+PR", "+PC+PR"]}
    assert all(ablation_variant(p.method, p.config) for p in report.points)

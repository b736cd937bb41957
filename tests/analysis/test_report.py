"""`scoutbench report` on a small folder of mixed results: the expected PNG figures and a markdown summary whose
numbers follow from the inputs, and every unused input listed with its reason."""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
import tempfile
from pathlib import Path

from cli_runner import run_cli
from hypothesis import given, settings
from random_results import PROPERTY_SETTINGS, result_files, write_documents
from repo_paths import REPO_ROOT
from result_factory import SCOUT_CONFIG, make_accuracy, make_result, write_results

from scoutbench.analysis.report import build_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def paper_like_results():
    scout = dict(SCOUT_CONFIG)
    return [
        # Figure 8: two lengths, two methods (fullkv written under its alias)
        make_result("full", 40.0, length=4096), make_result("scout", 80.0, length=4096, config=scout, idle_frac=0.05),
        make_result("fullkv", 20.0, length=8192), make_result("scout", 70.0, length=8192, config=scout),
        # Figure 9: batch scaling at 8k
        make_result("fullkv", 30.0, length=8192, batch=2), make_result("scout", 120.0, length=8192, batch=2,
                                                                       config=scout),
        # Figure 10: block sizes at 4k
        make_result("scout", 90.0, length=4096, config={**scout, "block_size": 64}),
        # Figure 12: ablation at 16k, two variants named by the registry, one by its fields
        make_result("scout-base", 50.0, length=16384, config={**scout, "pc": False, "pr": False}, idle_frac=0.4),
        make_result("scout-pc", 69.5, length=16384, config={**scout, "pc": True, "pr": False}, idle_frac=0.1),
        make_result("scout", 83.4, length=16384, config=scout, idle_frac=0.06),
    ]


def test_report_on_a_results_folder(tmp_path):
    folder = write_results(tmp_path / "runs", paper_like_results())
    write_results(tmp_path / "more", [
        make_result("hgca", 1.0, length=8192, status="failed", error="out of memory at batch 2"),
        make_accuracy("scout", {"qasper": 41.5}),
        make_result("fullkv", 19.0, length=8192),  # a repeat of the 8k fullkv point: the median run is shown
        make_result("fullkv", 25.0, length=8192),
    ])
    (tmp_path / "more" / "notes.json").write_text(json.dumps({"hello": "world"}), encoding="utf-8")
    (tmp_path / "more" / "broken.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "more" / ".00_x.json.ab12.tmp").write_text("{", encoding="utf-8")  # an interrupted write

    report = build_report([folder, tmp_path / "more"], tmp_path / "out")

    names = sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith("."))
    stems = {"ablation", "batch_scaling", "block_size", "latency_breakdown_len4k-b1", "latency_breakdown_len8k-b1",
             "latency_breakdown_len8k-b2", "latency_breakdown_len16k-b1", "throughput_vs_length",
             "speedup_len4k-b1", "speedup_len8k-b1", "speedup_len8k-b2", "cost_quality_len4k-b1",
             "cost_quality_len8k-b1", "cost_quality_len8k-b2", "cost_quality_len16k-b1"}
    assert set(names) == {f"{stem}.{fmt}" for stem in stems for fmt in ("png", "pdf")} | {"summary.md"}
    for stem in stems:
        assert (tmp_path / "out" / f"{stem}.png").read_bytes()[:8] == PNG_MAGIC
        assert (tmp_path / "out" / f"{stem}.pdf").read_bytes()[:5] == b"%PDF-"

    summary = (tmp_path / "out" / "summary.md").read_text()
    # speed-ups over FullKV in the same (model, length, batch): 80/40 at 4k, 70/20 at 8k (median of 19, 20, 25)
    assert ("| scout block_size=32 | pool 1 (the paper's) | tiny-qwen3 | float32 | 4k | 1 | 80.00 | 80.00-80.00 "
            "| 12.50 | - |") in summary
    assert "| fullkv | - | tiny-qwen3 |" in summary  # FullKV has no open setting
    assert "| 2.00x |" in summary and "| 3.50x |" in summary and "| 4.00x |" in summary
    # ablation speed-ups relative to the parallel co-attention baseline, step to step as in the paper
    assert "| 8 steps, 2 warm-up, synthetic prefill | co-attention | 50.00 | 1.00x | - |" in summary
    assert "| +PC | 69.50 | 1.39x | 1.39x |" in summary
    assert "| +PC+PR | 83.40 | 1.67x | 1.20x |" in summary
    assert "| scout | pool 1 (the paper's) | - | smollm2-135m | qasper.score | 41.50 |" in summary
    assert "out of memory at batch 2" in summary

    skipped = dict(report.skipped)
    assert any("median of 3 runs" in why for _, why in report.merged)
    assert skipped[str(tmp_path / "more" / "notes.json")] == "not a scoutbench result (no schema_version)"
    assert skipped[str(tmp_path / "more" / "broken.json")].startswith("unreadable")
    assert not any(".tmp" in what for what in skipped)


def test_report_cli_says_what_it_skipped(tmp_path, monkeypatch, capsys):
    from scoutbench.cli import main

    folder = write_results(tmp_path / "runs", [make_result("fullkv", 40.0)])
    monkeypatch.setattr(sys, "argv", ["scoutbench", "report", str(folder), "-o", str(tmp_path / "out")])
    main()
    out = capsys.readouterr().out
    assert "latency_breakdown.png, " in out and "latency_breakdown.pdf" in out
    assert "skipped throughput_vs_length: no model/batch has results at two or more lengths" in out
    assert "skipped ablation" in out
    assert (tmp_path / "out" / "summary.md").exists()


def test_auto_batch_methods_share_one_figure(tmp_path):
    """With `--batch auto` each method runs at its own batch; the figures compare them at equal length."""
    def auto(result):
        return {**result, "batch_plan": {"mode": "auto", "planned": result["workload"]["batch"]}}

    results = [auto(make_result("fullkv", 40.0, length=4096, batch=4)),
               auto(make_result("fullkv", 20.0, length=8192, batch=2)),
               auto(make_result("scout", 200.0, length=4096, batch=16, config=SCOUT_CONFIG)),
               auto(make_result("scout", 150.0, length=8192, batch=16, config=SCOUT_CONFIG))]
    report = build_report([write_results(tmp_path / "runs", results)], tmp_path / "out")
    assert [files[0].name for _, files in report.figures] == [
        "throughput_vs_length.png", "latency_breakdown_len4k.png", "latency_breakdown_len8k.png", "speedup_len4k.png",
        "speedup_len8k.png", "cost_quality_len4k.png", "cost_quality_len8k.png"]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| scout | pool 1 (the paper's) | tiny-qwen3 | float32 | 8k | auto (16) | 150.00 |" in summary
    assert "| 7.50x (0.94x/seq) |" in summary  # 150 / 20 at 8k, each at its own batch; per sequence 9.4 vs 10


def test_vs_fullkv_pairs_a_method_that_keeps_dense_layers_with_fullkv(tmp_path):
    """Results record `dense_layers`: null for FullKV (dense everywhere), 2 for a sparse method. The summary's
    speed-up over FullKV was "-" for every sparse method once they did."""
    fullkv, scout = make_result("fullkv", 20.0, length=8192), make_result("scout", 70.0, length=8192,
                                                                           config=SCOUT_CONFIG)
    fullkv["dense_layers"], scout["dense_layers"] = None, 2
    build_report([write_results(tmp_path / "runs", [fullkv, scout])], tmp_path / "out")
    assert "| 3.50x |" in (tmp_path / "out" / "summary.md").read_text()


def test_real_ablation_and_block_size_presets_render_every_variant(monkeypatch, capsys, tmp_path):
    """The presets' ScoutAttention points carry a per-point recall profile (a file path in method_config): the
    ablation lost +PC+PR and the block sizes split into three one-bar series labelled with file paths, while
    hand-made results (no profile) passed. End to end: the real sweeps, then `report`, read back from the SVGs."""
    from cli_runner import run_cli

    # a real prefill: the presets profile recall for it (a synthetic one keeps the fixed interval, no file)
    common = ("--scale", "cpu", "--model", "tiny-qwen3", "--len", "2k", "--steps", "6", "--warmup", "1",
              "--prefill", "real", "--device", "cpu")
    for preset in ("ablation", "block-size"):
        code, out, err = run_cli(monkeypatch, capsys, "sweep", "--preset", preset, *common, "-o", tmp_path / preset)
        assert code == 0, out + err
        assert "recall_profile=recall_profile-" in out and str(tmp_path) not in out  # the table names the file
        code, out, err = run_cli(monkeypatch, capsys, "report", tmp_path / preset, "-o", tmp_path / f"{preset}-report",
                                 "--figure-format", "svg,png")
        assert code == 0, out + err

    assert len(list((tmp_path / "ablation").glob("recall_profile-*.json"))) == 1
    assert len(list((tmp_path / "block-size").glob("recall_profile-*.json"))) == 3
    ablation = (tmp_path / "ablation-report" / "ablation.svg").read_text()
    assert all(f">{variant}<" in ablation for variant in ("co-attention", "+PC", "+PC+PR"))
    summary = (tmp_path / "ablation-report" / "summary.md").read_text()
    assert [line.split("|")[3].strip() for line in summary.splitlines()
            if line.startswith("| tiny-qwen3, float32, len 2k, batch 1")] == ["co-attention", "+PC", "+PC+PR"]

    block_size = (tmp_path / "block-size-report" / "block_size.svg").read_text()
    assert all(f">{size}<" in block_size for size in ("16", "32", "64"))
    assert "recall" not in block_size and str(tmp_path) not in block_size  # one series, no legend of file paths
    assert not any(str(tmp_path) in line for line in summary.splitlines() if line.startswith("| scout"))


def _report_cli(monkeypatch, capsys, *args):
    from cli_runner import run_cli

    return run_cli(monkeypatch, capsys, "report", *args)


def test_a_report_folder_is_replaced_as_a_whole_only_with_overwrite(tmp_path, monkeypatch, capsys):
    """A second report into a folder kept the first one's figures beside the new summary (a throughput_vs_length
    figure of results no longer reported), and report had no --overwrite rule unlike every other command."""
    out = tmp_path / "out"
    both = write_results(tmp_path / "both", [make_result("fullkv", 40.0, length=4096),
                                             make_result("fullkv", 20.0, length=8192)])
    code, _, err = _report_cli(monkeypatch, capsys, both, "-o", out)
    assert code == 0, err
    (out / "notes.txt").write_text("mine")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert "throughput_vs_length.png" in before

    one = write_results(tmp_path / "one", [make_result("fullkv", 40.0, length=4096)])
    code, _, err = _report_cli(monkeypatch, capsys, one, "-o", out)
    assert code == 2 and err.count("\n") == 1 and "already holds a report" in err and "--overwrite" in err, err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # nothing touched

    code, _, err = _report_cli(monkeypatch, capsys, one, "-o", out, "--overwrite")
    assert code == 0, err
    names = {f.name for f in out.iterdir()}
    assert not any(name.startswith("throughput_vs_length") for name in names)  # the earlier figure is gone
    assert {"summary.md", "latency_breakdown.png", "latency_breakdown.pdf", "notes.txt"} <= names
    assert "1 throughput points" in (out / "summary.md").read_text()


def test_a_report_that_fails_leaves_the_earlier_one_as_it_was(tmp_path, monkeypatch):
    from scoutbench.analysis import report as report_module

    folder = write_results(tmp_path / "runs", [make_result("fullkv", 40.0)])
    build_report([folder], tmp_path / "out")
    before = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}

    def broken(report, writer):
        writer.save(__import__("matplotlib.pyplot").pyplot.figure(), "ablation", "half-way")
        raise RuntimeError("renderer failed")

    monkeypatch.setattr(report_module, "draw_all", broken)
    try:
        build_report([folder], tmp_path / "out", overwrite=True)
    except RuntimeError:
        pass
    assert {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()} == before  # no staging folder either


def test_legends_name_methods_as_papers_do():
    """Legends said `fullkv dense_layers=None` and `scout-pc pc=True`; now the paper's names, and a field only
    where it tells a method's own series apart."""
    from scoutbench.analysis.figures import legend_labels
    from scoutbench.analysis.points import point_key
    from scoutbench.analysis.report import Point

    fullkv = make_result("fullkv", 40.0)
    fullkv["dense_layers"] = None
    runs = [fullkv]
    for budget in (1024, 2048):
        scout = make_result("scout", 80.0, config={**SCOUT_CONFIG, "budget": budget})
        scout["dense_layers"] = 2
        runs.append(scout)
    pc = make_result("scout-pc", 70.0, config={**SCOUT_CONFIG, "pc": True, "pr": False})
    pc["dense_layers"] = 2
    runs.append(pc)
    points = [Point(point_key(r), [r]) for r in runs]
    assert [legend_labels(points)[p.key] for p in points] == [
        "FullKV", "ScoutAttention, budget 1k", "ScoutAttention, budget 2k", "ScoutAttention (+PC)"]


def test_figures_plot_the_one_throughput_with_its_bootstrap_interval():
    """Figures plotted batch x 1000 / the median step while every table gave tokens over the total time: the same
    ablation read 2.09x in a figure and 1.89x in summary.md. A figure's value is now decode_throughput_tok_s, and
    its error bar the bootstrap interval of that number over the timed steps."""
    from scoutbench.analysis.figures import figure_value
    from scoutbench.analysis.points import point_key
    from scoutbench.analysis.report import Point

    run = make_result("fullkv", 40.0, batch=2)
    run["step_ms"] = [40.0, 42.0, 44.0, 46.0, 48.0, 50.0, 52.0, 120.0]  # a slow outlier: mean 55.25, median 47
    run["decode_throughput_tok_s"] = 2 * 8 * 1000 / sum(run["step_ms"])
    run["decode_step_ms"].update({"median": 47.0, "ci95_low": 40.0, "ci95_high": 80.0})
    value, (low, high) = figure_value(Point(point_key(run), [run]))
    assert value == run["decode_throughput_tok_s"] != 2 * 1000 / 47.0
    assert low < value < high  # resampling the steps moves the mean both ways
    # the extremes a resample of these steps can reach: all 120 ms, all 40 ms
    assert 2000 / 120.0 < low and high < 2000 / 40.0
    assert figure_value(Point(point_key(run), [run])) == (value, (low, high))  # a fixed seed: the same every time
    run["step_ms"] = run["step_ms"][:5]  # too few steps to resample: no bar
    assert figure_value(Point(point_key(run), [run]))[1] is None


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_several_sweeps_give_one_breakdown_per_point_of_bounded_size_and_one_colour_per_method(tmp_path):
    """Several sweeps reported together made one 3264-px breakdown of every point; each figure is now one
    (model, length, batch) at a paper's figure size, and a method has the same colour in every figure."""
    from scoutbench.analysis.figures import method_color

    results = [make_result(method, tok_s, length=length, batch=batch, config=config)
               for length in (4096, 8192, 16384) for batch in (1, 2)
               for method, tok_s, config in (("fullkv", 40.0, {}), ("quest", 60.0, {"budget": 1024}),
                                             ("hgca", 70.0, {"budget": 1024}), ("scout", 90.0, SCOUT_CONFIG))]
    report = build_report([write_results(tmp_path / "runs", results)], tmp_path / "out", formats=("png",))
    breakdowns = [files[0] for title, files in report.figures if title.startswith("Decode latency breakdown")]
    assert len(breakdowns) == 6
    for png in breakdowns:
        width, height = _png_size(png)
        assert width <= 7.5 * 300 + 100 and height <= 5 * 300, png
    from scoutbench.methods import METHODS

    assert len({method_color(m) for m in METHODS.names()}) == len(METHODS.names())
    assert method_color("full") == method_color("fullkv") == "#000000"


def test_a_field_that_told_only_a_dropped_series_apart_is_not_in_the_legend(tmp_path):
    """Two sweeps reported together: scout at 4k and 8k (budget 1k) and one lone scout point at 8k (budget 512, left
    out of the line figure). The legend said `budget 1k` for a series nothing else in the figure differed from."""
    budget = {**SCOUT_CONFIG, "budget": 1024}
    results = [make_result("fullkv", 40.0, length=4096), make_result("fullkv", 20.0, length=8192),
               make_result("scout", 80.0, length=4096, config=budget), make_result("scout", 70.0, length=8192,
                                                                                   config=budget),
               make_result("scout", 75.0, length=8192, config={**SCOUT_CONFIG, "budget": 512})]
    report = build_report([write_results(tmp_path / "runs", results)], tmp_path / "out", formats=("svg",))
    svg = (tmp_path / "out" / "throughput_vs_length.svg").read_text()
    assert ">ScoutAttention<" in svg and ">FullKV<" in svg and "ScoutAttention, budget" not in svg
    assert "budget 1k," in svg  # the setup line states the budget of what is drawn
    assert any("series with one length only, not drawn: ScoutAttention, budget 512" in why
               for _, why in report.skipped)


def test_report_shows_the_median_of_two_runs_not_the_lower_one(tmp_path):
    from scoutbench.analysis.report import build_report

    folder = write_results(tmp_path / "runs", [make_result("fullkv", 19.0), make_result("fullkv", 25.0)])
    report = build_report([folder], tmp_path / "out")
    (point,) = report.points
    assert point.tok_s == 22.0
    summary = report.summary.read_text()
    assert "| 22.00 |" in summary and "| 19.00 |" not in summary and "median of 2 runs" in summary


def test_report_and_gate_skip_a_foreign_schema_and_a_result_without_its_step_time(tmp_path, monkeypatch, capsys):
    from scoutbench.analysis.report import build_report

    folder = write_results(tmp_path / "runs", [make_result("fullkv", 40.0)])
    (folder / "future.json").write_text(json.dumps({**make_result("scout", 80.0), "schema_version": 99}))
    no_step = make_result("quest", 60.0)
    del no_step["decode_step_ms"]
    (folder / "no_step.json").write_text(json.dumps(no_step))
    report = build_report([folder], tmp_path / "out")
    skipped = {Path(what).name: why for what, why in report.skipped}
    assert [p.method for p in report.points] == ["fullkv"]
    assert "schema_version 99, but this scoutbench reads schema_version 2" in skipped["future.json"]
    assert "missing decode_step_ms" in skipped["no_step.json"]
    code, out, err = run_cli(monkeypatch, capsys, "gate", "--current", folder, "--ratio", "quest/fullkv>=1")
    assert code == 1 and "skipped" in out and "schema_version 99" in out and "MISSING" in out, out + err


def test_report_without_matplotlib_names_the_extra_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(monkeypatch, capsys, "report", tmp_path / "empty", "-o", tmp_path / "out")
    assert code == 1 and err.strip() == ("error: scoutbench report (its figures) needs matplotlib, which is not "
                                         "installed: pip install 'scoutbench[report]'"), err


def test_readme_install_line_installs_the_report_and_accuracy_extras():
    """The install line lacked `accuracy`: `scoutbench accuracy` then failed on a missing `rouge`."""
    readme = (REPO_ROOT / "README.md").read_text()
    install = next(line for line in readme.splitlines() if "pip install torch" in line)
    assert '".[report,accuracy]"' in install


def test_readme_method_table_lists_every_registered_method():
    """The README's table lacked infinigen-dynamic and quest-official."""
    from scoutbench.methods import METHODS

    readme = (REPO_ROOT / "README.md").read_text()
    table = readme.split("| method | `--method` |")[1].split("\n\n")[0]
    listed = set(re.findall(r"`([a-z0-9-]+)`", table))
    assert set(METHODS.names()) <= listed, set(METHODS.names()) - listed


@settings(max_examples=25, **PROPERTY_SETTINGS)
@given(documents=result_files())
def test_report_never_crashes_on_random_result_files(documents):
    from scoutbench.analysis.report import build_report
    from scoutbench.errors import ScoutbenchError

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_documents(Path(tmp) / "runs", documents)
        try:
            report = build_report([folder], Path(tmp) / "out", formats=("svg",))  # the cheapest to render
        except ScoutbenchError:
            return
        assert report.summary.exists()
        for point in report.points:  # only measurements are plotted and tabulated
            assert math.isfinite(point.tok_s) and point.tok_s > 0 and math.isfinite(point.step_ms)


def _skewed(method: str, steps_ms: list[float], **kwargs) -> dict:
    """A result whose timed steps are skewed (a slow outlier), so that the mean step and the median step give two
    different throughputs: the one definition (tokens over total time) must be the one everywhere."""
    run = make_result(method, 1.0, **kwargs)
    batch = run["workload"]["batch"]
    run.update({"step_ms": steps_ms, "decode_time_s": sum(steps_ms) / 1e3,
                "decode_throughput_tok_s": batch * len(steps_ms) * 1000 / sum(steps_ms)})
    run["decode_step_ms"].update({"median": statistics.median(steps_ms), "mean": statistics.fmean(steps_ms)})
    run["workload"]["steps"] = len(steps_ms)
    return run


def test_figure_summary_gate_and_exports_agree_on_tok_s(tmp_path, monkeypatch, capsys):
    """The same ablation read 2.09x in the report's figure (median step) and 1.89x in summary.md (mean), and the
    SGLang export's median_decode_throughput differed from the table's tok/s. One number now, everywhere."""
    from scoutbench.analysis.export import read_csv

    fullkv = _skewed("fullkv", [20.0] * 7 + [60.0] * 3, batch=2)  # mean 32 ms, median 20 ms
    scout = _skewed("scout", [10.0] * 9 + [40.0], batch=2, config=SCOUT_CONFIG)  # mean 13 ms, median 10 ms
    folder = write_results(tmp_path / "runs", [fullkv, scout])
    report = build_report([folder], tmp_path / "out", formats=("svg",))
    tok_s = {p.method: p.tok_s for p in report.points}
    assert tok_s == {"fullkv": 2 * 10 * 1000 / 320, "scout": 2 * 10 * 1000 / 130}
    ratio = tok_s["scout"] / tok_s["fullkv"]  # 2.46x; the median steps would say 2.00x
    summary = report.summary.read_text()
    assert f"| {tok_s['scout']:.2f} |" in summary and f"| {ratio:.2f}x |" in summary
    svg = (tmp_path / "out" / "speedup.svg").read_text()
    assert f"{ratio:.2f}x" in svg and "2.00x" not in svg
    from scoutbench.analysis.figures import figure_value

    assert [figure_value(p)[0] for p in report.points] == [tok_s[p.method] for p in report.points]

    code, out, err = run_cli(monkeypatch, capsys, "gate", "--current", folder, "--ratio", "scout/fullkv>=1")
    assert code == 0 and re.search(rf"\b{ratio:.4g}\b", out), out + err
    code, _, err = run_cli(monkeypatch, capsys, "export", folder, "--format", "sglang", "-o", tmp_path / "r.jsonl")
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert sorted(r["median_decode_throughput"] for r in records) == sorted(tok_s.values())
    code, _, err = run_cli(monkeypatch, capsys, "export", folder, "--format", "csv", "-o", tmp_path / "r.csv")
    assert code == 0, err
    assert sorted(row["decode_throughput_tok_s"] for row in read_csv(tmp_path / "r.csv")) == sorted(tok_s.values())


def test_speedup_bars_carry_the_bootstrap_interval_of_the_ratio(tmp_path):
    from scoutbench.step_stats import speedup_interval

    fullkv = make_result("fullkv", 40.0, spread=0.2)
    quest = make_result("quest", 60.0, spread=0.2, config={"budget": 1024})
    report = build_report([write_results(tmp_path / "runs", [fullkv, quest])], tmp_path / "out", formats=("svg",))
    points = {p.method: p for p in report.points}
    value, (low, high) = points["quest"].speedup(points["fullkv"])
    assert value == 1.5 and low < value < high
    assert (low, high) == speedup_interval([(60.0, quest["step_ms"])], [(40.0, fullkv["step_ms"])])
    assert points["fullkv"].speedup(points["fullkv"]) == (1.0, None)
    svg = (tmp_path / "out" / "speedup.svg").read_text()
    assert "1.50x" in svg and "Speed-up over FullKV" in svg and ">Quest<" in svg


def _fidelity_accuracy(method: str, config: dict, top1: float, score: float, fullkv_score: float) -> dict:
    result = make_accuracy(method, {"qasper": score})
    result["method_config"] = dict(config)
    result["results"]["qasper"].update({
        "vs_fullkv": {"n": 20, "score": score, "fullkv_score": fullkv_score},
        "fidelity": {"steps": 32, "records": 20, "compared_steps": 640, "top1_agreement": top1}})
    return result


def test_cost_quality_pairs_speed_with_the_quality_of_the_same_settings(tmp_path):
    from scoutbench.analysis.figures.comparison import accuracy_quality, configuration

    speed = [make_result("fullkv", 40.0, spread=0.1), make_result("scout", 80.0, spread=0.1, config=SCOUT_CONFIG),
             make_result("quest", 60.0, spread=0.1, config={"budget": 1024})]
    quality = [_fidelity_accuracy("scout", SCOUT_CONFIG, 91.5, 40.0, 42.0),
               _fidelity_accuracy("quest", {"budget": 2048}, 97.0, 41.0, 42.0)]  # another budget: no match
    report = build_report([write_results(tmp_path / "runs", speed), write_results(tmp_path / "acc", quality)],
                          tmp_path / "out", formats=("svg",))
    assert accuracy_quality(quality[0]).top1_pct == 91.5 and accuracy_quality(quality[0]).score_change == -2.0
    # a result written before a field existed names the same configuration (the class default fills it in)
    assert configuration("scout", SCOUT_CONFIG) == configuration("scout", {**SCOUT_CONFIG, "pc": True})
    assert configuration("quest", {"budget": 1024}) != configuration("quest", {"budget": 2048})
    (figure,) = [f for f in (tmp_path / "out").iterdir() if f.name.startswith("cost_quality")]
    svg = svg_text(figure)
    assert "top-1 agreement with FullKV (%)" in svg and "quality: smollm2-135m" in svg
    assert "not measured: Quest" in svg and "--fidelity-steps" in svg  # Quest's budget has no quality result
    assert report.drawn and all("cost_quality" in " ".join(stems) for stems in report.drawn.values())


def test_cost_quality_from_throughput_alone_draws_the_speed_side_and_says_what_is_missing(tmp_path):
    speed = [make_result("fullkv", 40.0), make_result("scout", 80.0, config=SCOUT_CONFIG)]
    build_report([write_results(tmp_path / "runs", speed)], tmp_path / "out", formats=("svg",))
    svg = svg_text(tmp_path / "out" / "cost_quality.svg")
    assert "quality not measured" in svg and "no accuracy or fidelity result" in svg and "--fidelity-steps" in svg
    assert "ScoutAttention" in svg and "FullKV" in svg


def svg_text(path: Path) -> str:
    """The text of an SVG figure (svg.fonttype none keeps it as text), its wrapped lines joined by spaces."""
    return " ".join(re.findall(r">([^<>]+)</text>", path.read_text()))


def test_every_figure_states_its_setup_and_names_stages_for_its_device(tmp_path):
    """No figure stated the budget or the prefill kind, and a CPU-only run's breakdown said "device attention"."""
    def on_cuda(result):
        return {**result, "device": {"type": "cuda", "name": "NVIDIA H200", "class": "cuda:NVIDIA H200"},
                "tiers": {"device": "cuda", "host": "cpu", "shared_memory": False}}

    cpu = [make_result("fullkv", 40.0, length=length) for length in (4096, 8192)]
    cpu += [make_result("scout", 80.0, length=length, config=SCOUT_CONFIG) for length in (4096, 8192)]
    report = build_report([write_results(tmp_path / "cpu", cpu), write_results(tmp_path / "gpu", [
        on_cuda(make_result("fullkv", 400.0)), on_cuda(make_result("scout", 900.0, config=SCOUT_CONFIG))])],
        tmp_path / "out", formats=("svg",))
    assert len(report.figures) == 10  # CPU: one line figure, two each of the other three kinds; GPU: three
    for _, (svg,) in report.figures:
        text = svg_text(svg)
        for part in ("tiny-qwen3", "float32", "batch 1", "budget 1k", "block 32", "synthetic prefill",
                     "8 timed steps"):
            assert part in text, (svg.name, part, text)
        assert "tokens" in text or "input length" in text, (svg.name, text)
        assert ("NVIDIA H200" in text) != ("Test CPU" in text), (svg.name, text)
    cpu_breakdown, gpu_breakdown = (svg_text(svg) for title, (svg,) in report.figures
                                    if title.startswith("Decode latency") and "4k" in svg.name)
    assert "attention on the main thread" in cpu_breakdown and "waiting for the CPU worker" in cpu_breakdown
    assert "GPU" not in cpu_breakdown
    assert "GPU attention" in gpu_breakdown and "GPU idle" in gpu_breakdown


def test_a_setting_that_differs_between_methods_is_stated_per_method():
    """Quest at budget 1k beside ScoutAttention at 2k: the legends name neither budget (each method has one), so the
    subtitle says which method ran at which; two budgets of one method are the legend's to tell apart."""
    from scoutbench.analysis.figures.style import setup_part
    from scoutbench.analysis.points import point_key
    from scoutbench.analysis.report import Point

    def points(*runs):
        return [Point(point_key(r), [r]) for r in runs]

    quest, scout = make_result("quest", 60.0, config={"budget": 1024}), make_result("scout", 80.0, config=SCOUT_CONFIG)
    scout["method_config"]["budget"] = 2048
    assert setup_part("budget", points(quest, scout)) == "budget Quest 1k, ScoutAttention 2k"
    assert setup_part("budget", points(quest, make_result("quest", 70.0, config={"budget": 2048}))) == \
        "budget 1k/2k (legend)"
    assert setup_part("budget", points(make_result("fullkv", 40.0))) == "no budget (dense)"
    assert setup_part("prefill", points(quest, make_result("quest", 50.0, config={"budget": 1024}, prefill="real"))) \
        == "prefill real/synthetic (legend)"
    assert setup_part("steps", points(quest)) == "8 timed steps"

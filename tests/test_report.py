"""`scoutbench report` on a small folder of mixed results: the expected PNG figures and a markdown summary whose
numbers follow from the inputs, and every unused input listed with its reason."""

from __future__ import annotations

import json
import sys

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

    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    expected = {"ablation.png", "batch_scaling.png", "block_size.png", "latency_breakdown.png", "summary.md",
                "throughput_vs_length.png"}
    assert set(names) == expected
    for name in expected - {"summary.md"}:
        assert (tmp_path / "out" / name).read_bytes()[:8] == PNG_MAGIC

    summary = (tmp_path / "out" / "summary.md").read_text()
    # speed-ups over FullKV in the same (model, length, batch): 80/40 at 4k, 70/20 at 8k (median of 19, 20, 25)
    assert "| scout block_size=32 | tiny-qwen3 | float32 | 4k | 1 | 80.00 |" in summary
    assert "| 2.00x |" in summary and "| 3.50x |" in summary and "| 4.00x |" in summary
    # ablation speed-ups relative to the parallel co-attention baseline, step to step as in the paper
    assert "| co-attention | 50.00 | 1.00x | - |" in summary
    assert "| +PC | 69.50 | 1.39x | 1.39x |" in summary
    assert "| +PC+PR | 83.40 | 1.67x | 1.20x |" in summary
    assert "| scout | smollm2-135m | qasper.score | 41.50 |" in summary
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
    assert "latency_breakdown.png" in out
    assert "skipped throughput_vs_length.png: no model/batch has results at two or more lengths" in out
    assert "skipped ablation.png" in out
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
    assert [path.name for _, path in report.figures] == ["throughput_vs_length.png", "latency_breakdown.png"]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| scout | tiny-qwen3 | float32 | 8k | auto (16) | 150.00 |" in summary
    assert "| 7.50x (0.94x/seq) |" in summary  # 150 / 20 at 8k, each at its own batch; per sequence 9.4 vs 10


def test_vs_fullkv_pairs_a_method_that_keeps_dense_layers_with_fullkv(tmp_path):
    """Results record `dense_layers`: null for FullKV (dense everywhere), 2 for a sparse method. The summary's
    speed-up over FullKV was "-" for every sparse method once they did."""
    fullkv, scout = make_result("fullkv", 20.0, length=8192), make_result("scout", 70.0, length=8192,
                                                                           config=SCOUT_CONFIG)
    fullkv["dense_layers"], scout["dense_layers"] = None, 2
    build_report([write_results(tmp_path / "runs", [fullkv, scout])], tmp_path / "out")
    assert "| 3.50x |" in (tmp_path / "out" / "summary.md").read_text()

"""Reliability (issue 20): every command's answer to inputs a new user or a tester gives it. One section per item of
the issue; each test is the item's reproducer, and failed before its fix. The property-based tests at the end
throw random result files (non-finite, missing and foreign-schema fields) at report, gate, score and project."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from cli_runner import run_cli
from result_factory import SCOUT_CONFIG, make_accuracy, make_result, write_results

from scoutbench.counter_gate import counter_gate
from scoutbench.gate import compare, parse_ratio, parse_tolerances, run_gate
from scoutbench.results import load_results

BASELINE = Path(__file__).resolve().parent.parent / "results" / "baselines" / "cpu-ci"
TINY = ("--model", "tiny-qwen3", "--len", "1k", "--steps", "2", "--warmup", "0")


def _never(*args, **kwargs):
    raise AssertionError("this must fail before it loads the model or runs")


def _gate(monkeypatch, capsys, base, cur, *extra) -> tuple[int, str]:
    code, out, err = run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", cur, *extra)
    return code, out + err


# ---- item 3: the gate judges only what is comparable -----------------------------------------------------------

def test_gate_refuses_nan_and_zero_throughput_instead_of_passing(tmp_path, monkeypatch, capsys):
    """A NaN throughput passed ("ok"); zeros gave "improved" (step 0 ms) next to "REGRESSED" (0 tok/s)."""
    base = write_results(tmp_path / "base", [make_result("fullkv", 100.0)])
    nan = make_result("fullkv", 100.0)
    nan["decode_throughput_tok_s"] = float("nan")
    nan_text = json.dumps(nan)  # json writes the literal NaN, which json.loads reads back as a float
    assert "NaN" in nan_text
    (tmp_path / "nan").mkdir()
    (tmp_path / "nan" / "r.json").write_text(nan_text)
    code, out = _gate(monkeypatch, capsys, base, tmp_path / "nan")
    assert code == 1 and "INVALID" in out and "not a measurement" in out and "gate passed" not in out, out
    as_written = make_result("fullkv", 100.0)
    as_written["decode_throughput_tok_s"] = "nan"  # how scoutbench itself writes a non-finite float
    write_results(tmp_path / "nan_text", [as_written])
    code, out = _gate(monkeypatch, capsys, base, tmp_path / "nan_text")
    assert code == 1 and "INVALID" in out, out
    zero = make_result("fullkv", 100.0)
    zero["decode_throughput_tok_s"] = 0.0
    zero["decode_step_ms"]["median"] = 0.0
    report = compare([make_result("fullkv", 100.0)], [zero], parse_tolerances([]))
    assert {row.verdict for row in report.rows} == {"INVALID"} and not report.passed
    report = compare([zero], [make_result("fullkv", 100.0)], parse_tolerances([]))  # a zero baseline too
    assert {row.verdict for row in report.rows} == {"INVALID"} and "refresh the baseline" in report.rows[0].note


def test_gate_refuses_a_nan_accuracy_and_a_nan_ratio():
    report = compare([make_accuracy("scout", {"qasper": 40.0})], [make_accuracy("scout", {"qasper": float("nan")})],
                     parse_tolerances([]))
    assert [row.verdict for row in report.rows] == ["INVALID"] and not report.passed
    zero_score = compare([make_accuracy("scout", {"qasper": 0.0})], [make_accuracy("scout", {"qasper": 0.0})],
                         parse_tolerances([]))
    assert [row.verdict for row in zero_score.rows] == ["ok"]  # 0 is a real accuracy score, unlike 0 tok/s
    scout = make_result("scout", 200.0, config=SCOUT_CONFIG)
    scout["decode_throughput_tok_s"] = float("nan")
    report = run_gate(None, [make_result("fullkv", 50.0), scout], parse_tolerances([]),
                      [parse_ratio("scout/fullkv>=2")])
    assert [row.verdict for row in report.ratio_rows] == ["INVALID"] and not report.passed


def _with(result: dict, **workload) -> dict:
    out = copy.deepcopy(result)
    out["workload"].update(workload)
    return out


@pytest.mark.parametrize("setting, base_value, cur_value", [
    ("steps", 8, 16), ("warmup", 2, 0), ("seed", 0, 1), ("kv_skew", 0.3, 0.075), ("prefill", "real", "synthetic")])
def test_gate_refuses_points_run_with_other_settings_naming_the_setting(setting, base_value, cur_value):
    """The baseline ran with other steps / warm-up / seed / kv_skew / prefill: compared without a note before."""
    baseline = [_with(make_result("fullkv", 100.0), **{setting: base_value})]
    current = [_with(make_result("fullkv", 60.0), **{setting: cur_value})]
    report = compare(baseline, current, parse_tolerances([]))
    (row,) = report.rows
    assert row.verdict == "MISMATCH" and not report.passed
    assert f"{setting} {base_value} in the baseline vs {cur_value} now" in row.note


def test_gate_refuses_a_run_level_setting_and_a_dtype_difference():
    dense = make_result("fullkv", 100.0)
    dense["dense_layers"] = 2  # a run-level option (issue: --dense-layers) is part of the point too
    (row,) = compare([make_result("fullkv", 100.0)], [dense], parse_tolerances([])).rows
    assert row.verdict == "MISMATCH" and "dense_layers unset in the baseline vs 2 now" in row.note
    bf16 = make_result("fullkv", 100.0)
    bf16["model"]["dtype"] = "bfloat16"
    (row,) = compare([make_result("fullkv", 100.0)], [bf16], parse_tolerances([])).rows
    assert row.verdict == "MISMATCH" and "dtype float32 in the baseline vs bfloat16 now" in row.note


def test_counter_gate_refuses_other_settings_instead_of_regressed_or_improved():
    """Same counters, other steps: "improved 0.625"; other kv_skew: "REGRESSED". Now MISMATCH, naming it."""
    baseline = load_results([BASELINE / "run1"])
    for setting, value in (("steps", 16), ("kv_skew", 0.3)):
        current = [_with(r, **{setting: value}) for r in baseline]
        report = counter_gate(baseline, current)
        verdicts = {row.verdict for row in report.rows}
        assert verdicts == {"MISMATCH"} and not report.passed, (setting, verdicts)
        assert all(f"{setting} " in row.note for row in report.rows)


def test_ratio_gate_does_not_divide_points_run_with_other_settings():
    scout = _with(make_result("scout", 400.0, config=SCOUT_CONFIG), steps=32)
    report = run_gate(None, [make_result("fullkv", 50.0), scout], parse_tolerances([]),
                      [parse_ratio("scout/fullkv>=2")])
    assert [row.verdict for row in report.ratio_rows] == ["MISSING"]


def test_gate_that_compared_nothing_fails(tmp_path, monkeypatch, capsys):
    """`--allow-missing` with nothing matched said "gate passed (3 comparisons)"."""
    base, cur = (write_results(tmp_path / "base", [make_result("fullkv", 100.0, length=4096 * i) for i in (1, 2, 4)]),
                 write_results(tmp_path / "cur", [make_result("fullkv", 100.0, length=3000)]))
    code, out = _gate(monkeypatch, capsys, base, cur, "--allow-missing")
    assert code == 1 and "compared nothing" in out and "gate passed" not in out, out
    baseline = load_results([BASELINE / "run1"])
    report = counter_gate(baseline, [], allow_missing=True)
    assert not report.passed and report.comparisons == 0
    code, out, err = run_cli(monkeypatch, capsys, "gate", "--counters", "--baseline", BASELINE / "run1",
                             "--current", cur, "--allow-missing")
    assert code == 1 and "compared nothing" in err, out + err


def test_gate_passes_with_the_count_of_real_comparisons(tmp_path, monkeypatch, capsys):
    base = write_results(tmp_path / "base", [make_result("fullkv", 100.0), make_result("fullkv", 50.0, length=8192)])
    cur = write_results(tmp_path / "cur", [make_result("fullkv", 100.0)])
    code, out = _gate(monkeypatch, capsys, base, cur, "--allow-missing")
    assert code == 0 and "gate passed (2 comparisons; 1 skipped)" in out, out


def test_gate_labels_carry_the_dtype(tmp_path, monkeypatch, capsys):
    """A failed float32 baseline point and a bfloat16 current one showed as one label, "skipped" and "new"."""
    failed = make_result("fullkv", status="failed", error="boom")
    bf16 = make_result("fullkv", 100.0)
    bf16["model"]["dtype"] = "bfloat16"
    report = compare([failed, make_result("quest", 90.0)], [bf16, make_result("quest", 90.0)], parse_tolerances([]))
    labels = {row.verdict: row.point for row in report.rows}
    assert labels["skipped"] != labels["new"] and "float32" in labels["skipped"] and "bfloat16" in labels["new"]

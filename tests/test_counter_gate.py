"""The work-counter gate: deterministic counters of the committed CPU baseline pass against themselves on any
hardware, and a method that reads more (a larger CPU share, more recall, more fetched tokens) fails it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from cli_runner import run_cli

from scoutbench.analysis.counter_gate import counter_gate, work_counters
from scoutbench.results import load_results, write_json_atomic

BASELINE = Path(__file__).resolve().parent.parent / "results" / "baselines" / "cpu-ci"


@pytest.fixture(scope="module")
def baseline() -> list[dict]:
    return load_results([BASELINE / "run1"])


def _scout(results: list[dict]) -> dict:
    return next(r for r in results if r["method"] == "scout")


def test_repeats_of_the_baseline_have_identical_counters():
    runs = [{r["method"]: work_counters(r) for r in load_results([BASELINE / f"run{i}"])} for i in (1, 2, 3)]
    assert runs[0] == runs[1] == runs[2]


def test_same_counters_pass_on_other_hardware(baseline):
    elsewhere = copy.deepcopy(baseline)
    for r in elsewhere:
        r["device"]["class"] = "cuda:NVIDIA H200"
        r["decode_step_ms"]["median"] *= 0.01  # timings are not looked at
    report = counter_gate(baseline, elsewhere)
    assert report.passed and report.rows and {row.verdict for row in report.rows} == {"ok"}


def test_reading_more_fails_and_reading_less_is_reported(baseline):
    worse = copy.deepcopy(baseline)
    stats = _scout(worse)["method_stats"]
    stats["cpu_compute_ratio"]["mean"] *= 1.05
    stats["recall"]["blocks"] *= 2
    report = counter_gate(baseline, worse)
    regressed = {row.metric for row in report.failures}
    assert regressed == {"host_kv_bytes_per_step", "cpu_attended_tokens_per_step", "h2d_bytes_per_step",
                         "recall_bytes_per_step"}
    better = copy.deepcopy(baseline)
    _scout(better)["method_stats"]["recall"]["blocks"] //= 2
    report = counter_gate(baseline, better)
    assert report.passed and any(row.verdict == "improved" for row in report.rows)


def test_missing_point_fails_unless_allowed(baseline):
    current = [r for r in baseline if r["method"] != "scout"]
    assert not counter_gate(baseline, current).passed
    assert counter_gate(baseline, current, allow_missing=True).passed


def test_gate_cli_counters(baseline, tmp_path, monkeypatch, capsys):
    worse = copy.deepcopy(_scout(baseline))
    worse["method_stats"]["cpu_compute_ratio"]["mean"] *= 1.5
    write_json_atomic(tmp_path / "scout.json", worse)
    code, out, err = run_cli(monkeypatch, capsys, "gate", "--counters", "--baseline", BASELINE / "run1",
                             "--current", BASELINE / "run2")
    assert code == 0 and "counter gate passed" in out
    code, out, err = run_cli(monkeypatch, capsys, "gate", "--counters", "--baseline", BASELINE / "run1",
                             "--current", tmp_path, "--allow-missing")
    assert code == 1 and "REGRESSED" in out and "gate failed" in err
    code, _, err = run_cli(monkeypatch, capsys, "gate", "--counters", "--current", tmp_path)
    assert code == 2 and "--baseline" in err
    code, _, err = run_cli(monkeypatch, capsys, "gate", "--counters", "--baseline", BASELINE / "run1", "--current",
                           tmp_path, "--ratio", "scout/fullkv>=2")
    assert code == 2 and "--counters gates work counters only" in err

"""The work-counter gate: deterministic counters of the committed CPU baseline pass against themselves on any
hardware, and a method that reads more (a larger CPU share, more recall, more fetched tokens) fails it."""

from __future__ import annotations

import copy

import pytest
from cli_runner import run_cli
from repo_paths import REPO_ROOT

from scoutbench.analysis.counter_gate import counter_gate, work_counters
from scoutbench.results import load_results, write_json_atomic

BASELINE = REPO_ROOT / "results" / "baselines" / "cpu-ci"


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
                         "recall_bytes_per_step", "measured.cpu_compute_ratio.mean", "measured.recall.blocks"}
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


@pytest.mark.parametrize("field, edit", [
    (("h2d_bytes_per_step",), lambda value: 10 * value),
    (("recall", "bytes"), lambda value: 1e9),
    (("cpu_compute_ratio", "per_layer"), lambda value: [None, None, *(2 * v for v in value[2:])]),
])
def test_an_edited_measured_counter_fails(baseline, field, edit, tmp_path, monkeypatch, capsys):
    """A result edited to 10x `h2d_bytes_per_step` or `recall.bytes = 1e9` passed: the gate recomputed every counter
    from the selection fractions and never looked at what the run measured."""
    edited = copy.deepcopy(baseline)
    parent = _scout(edited)["method_stats"]
    for key in field[:-1]:
        parent = parent[key]
    parent[field[-1]] = edit(parent[field[-1]])
    name = "measured." + ".".join(field) + ("[sum]" if isinstance(parent[field[-1]], list) else "")
    report = counter_gate(baseline, edited)
    assert not report.passed and {row.metric for row in report.failures} == {name}
    for index, result in enumerate(edited):
        write_json_atomic(tmp_path / f"{index}.json", result)
    code, out, err = run_cli(monkeypatch, capsys, "gate", "--counters", "--baseline", BASELINE / "run1",
                             "--current", tmp_path)
    assert code == 1 and "REGRESSED" in out and name[:30] in out, out + err


def test_timings_in_method_stats_are_not_counters(baseline):
    from scoutbench.analysis.counter_gate import measured_counters

    counters = measured_counters(_scout(baseline))
    assert "measured.h2d_bytes_per_step" in counters and "measured.recall.bytes" in counters
    assert not [name for name in counters if "_ms" in name]  # cpu_attention_ms, idle_ms, ..._ms_per_call
    slower = copy.deepcopy(baseline)
    _scout(slower)["method_stats"]["cpu_attention_ms"] *= 10
    assert counter_gate(baseline, slower).passed


def test_more_host_calls_per_step_fail(baseline):
    """The main thread's torch calls per step are a counter: a step that starts issuing more of them fails."""
    with_host = copy.deepcopy(baseline)
    for result in with_host:
        result["host"] = {"torch_calls_per_step": 600.0, "graph_replays_per_step": None}
    more = copy.deepcopy(with_host)
    _scout(more)["host"]["torch_calls_per_step"] = 700.0
    assert counter_gate(with_host, with_host).passed
    report = counter_gate(with_host, more)
    assert not report.passed and {row.metric for row in report.failures} == {"host.torch_calls_per_step"}


def _with(result: dict, **workload) -> dict:
    out = copy.deepcopy(result)
    out["workload"].update(workload)
    return out


def test_counter_gate_refuses_other_settings_instead_of_regressed_or_improved():
    """Same counters, other steps: "improved 0.625"; other kv_skew: "REGRESSED". Now MISMATCH, naming it."""
    baseline = load_results([BASELINE / "run1"])
    for setting, value in (("steps", 16), ("kv_skew", 0.3)):
        current = [_with(r, **{setting: value}) for r in baseline]
        report = counter_gate(baseline, current)
        verdicts = {row.verdict for row in report.rows}
        assert verdicts == {"MISMATCH"} and not report.passed, (setting, verdicts)
        assert all(f"{setting} " in row.note for row in report.rows)


@pytest.mark.parametrize("side", ["current", "baseline"])
@pytest.mark.parametrize("field, edit, why", [
    (("recall", "bytes"), lambda value: -1, "-1 in the {side} run: a count is never negative"),
    (("h2d_bytes_per_step",), lambda value: -0.5 * value, "in the {side} run: a count is never negative"),
    (("h2d_bytes_per_step",), str, "in the {side} run where the other side counts a number"),
    (("recall", "bytes"), lambda value: True, "True in the {side} run where the other side counts a number"),
    (("recall", "per_layer"), lambda value: [*value[:3], "x", *value[4:]], "where the other side counts a number"),
])
def test_an_impossible_counter_is_invalid_and_never_dropped(baseline, side, field, edit, why, tmp_path, monkeypatch,
                                                             capsys):
    """`gate --counters` passed a byte counter of -1 as "improved" and dropped a counter that was a string (26
    comparisons instead of 32), exit 0: each is INVALID now, named, and the gate fails; every counter keeps its row."""
    edited = copy.deepcopy(baseline)
    parent = _scout(edited)["method_stats"]
    for key in field[:-1]:
        parent = parent[key]
    parent[field[-1]] = edit(parent[field[-1]])
    base, current = (baseline, edited) if side == "current" else (edited, baseline)
    report = counter_gate(base, current)
    (invalid,) = [row for row in report.rows if row.verdict == "INVALID"]
    assert invalid.metric.startswith("measured." + ".".join(field)) and why.format(side=side) in invalid.note
    assert len(report.rows) == len(counter_gate(baseline, baseline).rows) and not report.passed
    folder = tmp_path / side
    for index, result in enumerate(edited):
        write_json_atomic(folder / f"{index}.json", result)
    sides = (["--baseline", BASELINE / "run1", "--current", folder] if side == "current"
             else ["--baseline", folder, "--current", BASELINE / "run1"])
    code, out, err = run_cli(monkeypatch, capsys, "gate", "--counters", *sides)
    assert code == 1 and "counter gate failed: 1 invalid" in err and "improved" not in out, out + err


def test_a_counter_the_current_run_does_not_record_is_listed(baseline, monkeypatch, capsys, tmp_path):
    """A baseline counter that the current run leaves out (or records as null) is not compared, and says so."""
    edited = copy.deepcopy(baseline)
    _scout(edited)["method_stats"]["recall"]["bytes"] = None
    report = counter_gate(baseline, edited)
    assert report.passed and len(report.rows) == len(counter_gate(baseline, baseline).rows) - 1
    (warning,) = [w for w in report.warnings if "not recorded" in w]
    assert "1 baseline counter(s) not recorded in the current run, not compared: measured.recall.bytes" in warning

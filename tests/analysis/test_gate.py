"""`scoutbench gate`: matching, tolerances and directions, missing points, hardware refusal, ratio gates, and the
exit codes (0 pass, 1 regression, 2 usage error or unreadable input) through the real entry point."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import cli_runner
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from random_results import BASELINE, PROPERTY_SETTINGS, result_files, run_main, write_documents
from result_factory import SCOUT_CONFIG, make_accuracy, make_result, write_results

from scoutbench.analysis.counter_gate import counter_gate
from scoutbench.analysis.gate import compare, parse_ratio, parse_tolerances, run_gate
from scoutbench.analysis.points import point_key
from scoutbench.errors import UsageError
from scoutbench.results import load_results


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str]:
    """(exit code, stdout + stderr): gate tables and errors are read together."""
    code, out, err = cli_runner.run_cli(monkeypatch, capsys, *args)
    return code, out + err


def pair(tmp_path, baseline, current):
    return write_results(tmp_path / "base", baseline), write_results(tmp_path / "cur", current)


def test_identical_runs_pass(tmp_path, monkeypatch, capsys):
    points = [make_result("fullkv", 50.0), make_result("scout", 200.0, config=SCOUT_CONFIG)]
    base, cur = pair(tmp_path, points, points)
    code, out = run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", cur, "--tolerance", "5%")
    assert code == 0, out
    assert "gate passed (4 comparisons" in out  # 2 points x (throughput, step time)


def test_throughput_drop_beyond_tolerance_fails(tmp_path, monkeypatch, capsys):
    base, cur = pair(tmp_path, [make_result("fullkv", 100.0)], [make_result("fullkv", 90.0)])
    code, out = run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", cur, "--tolerance", "5%")
    assert code == 1
    assert "REGRESSED" in out and "0.900" in out
    # within a looser tolerance the same numbers pass
    code, out = run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", cur, "--tolerance", "15%")
    assert code == 0, out


def test_per_metric_tolerance_and_directions():
    baseline = [make_result("fullkv", 100.0, step_ms=10.0)]
    slower_steps = [make_result("fullkv", 100.0, step_ms=11.5)]  # step time up 15%: lower is better -> worse
    report = compare(baseline, slower_steps, parse_tolerances(["5%", "decode_step_ms=20%"]))
    assert {r.metric: r.verdict for r in report.rows} == {"decode_step_ms": "ok", "decode_throughput_tok_s": "ok"}
    report = compare(baseline, slower_steps, parse_tolerances(["5%"]))
    assert {r.metric: r.verdict for r in report.rows}["decode_step_ms"] == "REGRESSED"
    faster = [make_result("fullkv", 130.0, step_ms=7.0)]
    report = compare(baseline, faster, parse_tolerances(["5%"]))
    assert {r.verdict for r in report.rows} == {"improved"}
    assert report.passed


def test_accuracy_is_higher_is_better():
    baseline = [make_accuracy("scout", {"qasper": 40.0, "samsum": 30.0})]
    current = [make_accuracy("scout", {"qasper": 36.0, "samsum": 31.0})]
    report = compare(baseline, current, parse_tolerances(["5%"]))
    verdicts = {r.metric: r.verdict for r in report.rows}
    assert verdicts == {"qasper.score": "REGRESSED", "samsum.score": "ok"}


def test_repeats_are_summarised_by_their_median():
    baseline = [make_result("fullkv", 100.0)]
    current = [make_result("fullkv", 100.0), make_result("fullkv", 40.0), make_result("fullkv", 102.0)]
    report = compare(baseline, current, parse_tolerances(["5%"]), metrics={"decode_throughput_tok_s"})
    (row,) = report.rows
    assert row.current == 100.0 and row.verdict == "ok" and "median of 1 vs 3 runs" in row.note


def test_points_missing_on_either_side_are_reported(tmp_path, monkeypatch, capsys):
    baseline = [make_result("fullkv", 100.0, length=4096), make_result("fullkv", 60.0, length=8192)]
    current = [make_result("fullkv", 100.0, length=4096), make_result("fullkv", 30.0, length=16384)]
    base, cur = pair(tmp_path, baseline, current)
    code, out = run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", cur)
    assert code == 1
    assert "MISSING" in out and "not in current run" in out  # 8k: baseline only
    assert "new" in out and "no baseline point" in out  # 16k: current only
    code, out = run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", cur, "--allow-missing")
    assert code == 0, out
    assert "not in current run (--allow-missing)" in out


def test_failed_current_point_fails_the_gate():
    baseline = [make_result("scout", 200.0, config=SCOUT_CONFIG)]
    current = [make_result("scout", config=SCOUT_CONFIG, status="failed", error="out of memory")]
    report = compare(baseline, current, parse_tolerances([]))
    (row,) = report.rows
    assert row.verdict == "FAILED" and row.note == "out of memory" and not report.passed


def test_different_method_configs_are_different_points():
    baseline = [make_result("scout", 200.0, config={**SCOUT_CONFIG, "budget": 1024})]
    current = [make_result("scout", 100.0, config={**SCOUT_CONFIG, "budget": 2048})]
    report = compare(baseline, current, parse_tolerances([]))
    assert sorted(r.verdict for r in report.rows) == ["MISSING", "new"]
    assert any("budget=1024" in r.point for r in report.rows)


def test_hardware_mismatch_refused_unless_forced(tmp_path, monkeypatch, capsys):
    baseline = [make_result("fullkv", 100.0, device_class="cpu:Other CPU:2t")]
    base, cur = pair(tmp_path, baseline, [make_result("fullkv", 100.0)])
    code, out = run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", cur)
    assert code == 2
    assert "cpu:Other CPU:2t" in out and "--force" in out
    code, out = run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", cur, "--force")
    assert code == 0, out
    assert "warning: --force" in out


def test_ratio_gate_on_current_run_only(tmp_path, monkeypatch, capsys):
    good = write_results(tmp_path / "good", [make_result("fullkv", 50.0),
                                              make_result("scout", 200.0, config=SCOUT_CONFIG)])
    code, out = run_cli(monkeypatch, capsys, "gate", "--current", good, "--ratio", "scout/fullkv>=3")
    assert code == 0, out
    assert "4" in out and "needs >=3" in out
    lost = write_results(tmp_path / "lost", [make_result("full", 50.0),  # an alias of fullkv
                                              make_result("scout", 100.0, config=SCOUT_CONFIG)])
    code, out = run_cli(monkeypatch, capsys, "gate", "--current", lost, "--ratio", "scout/fullkv>=3")
    assert code == 1
    assert "REGRESSED" in out and "2" in out


def test_ratio_gate_values_and_missing_methods():
    results = [make_result("fullkv", 50.0, length=4096), make_result("scout", 150.0, length=4096, config=SCOUT_CONFIG),
               make_result("fullkv", 20.0, length=8192), make_result("scout", 100.0, length=8192, config=SCOUT_CONFIG)]
    report = run_gate(None, results, parse_tolerances([]), [parse_ratio("scout/fullkv>=3")])
    assert sorted(r.current for r in report.ratio_rows) == [3.0, 5.0] and report.passed
    step = run_gate(None, results, parse_tolerances([]), [parse_ratio("decode_step_ms:scout/fullkv<=0.25")])
    assert [r.verdict for r in step.ratio_rows] == ["REGRESSED", "ok"]  # 4k: 1/3 > 0.25; 8k: 1/5
    missing = run_gate(None, results, parse_tolerances([]), [parse_ratio("hgca/fullkv>=1")])
    assert [r.verdict for r in missing.ratio_rows] == ["MISSING"] and not missing.passed


def test_ratio_pairs_fullkv_with_a_sparse_method_that_keeps_dense_layers():
    """Results record `dense_layers`: null for FullKV, the method's own count for a sparse one. The ratio gate pairs
    them all the same (the CI gate found no pair once results carried it), while a different seed still splits."""
    fullkv, scout = make_result("fullkv", 50.0), make_result("scout", 150.0, config=SCOUT_CONFIG)
    fullkv["dense_layers"], scout["dense_layers"] = None, 2
    (row,) = run_gate(None, [fullkv, scout], parse_tolerances([]), [parse_ratio("scout/fullkv>=2")]).ratio_rows
    assert row.verdict == "ok" and row.current == 3.0
    scout["seed"] = 1
    (row,) = run_gate(None, [fullkv, scout], parse_tolerances([]), [parse_ratio("scout/fullkv>=2")]).ratio_rows
    assert row.verdict == "MISSING"


@pytest.mark.parametrize("args, message", [
    (["--current", "{cur}"], "nothing to check"),
    (["--current", "{cur}", "--ratio", "scout>fullkv"], "bad --ratio"),
    (["--current", "{cur}", "--baseline", "{cur}", "--tolerance", "lots"], "bad --tolerance 'lots'"),
    (["--current", "{cur}", "--baseline", "{cur}", "--tolerance", "5"], "did you mean 5%?"),
    (["--current", "{cur}", "--baseline", "{cur}", "--tolerance", "100%"], "could never fail"),
    (["--current", "{cur}", "--baseline", "{cur}", "--tolerance", "1.5"], "below 100%"),
    (["--current", "{cur}", "--ratio", "scout/fulkv>=2"], "did you mean 'fullkv'?"),
    (["--current", "{cur}", "--ratio", "decode_tok_s:scout/fullkv>=2"], "unknown metric 'decode_tok_s'"),
    (["--current", "{cur}", "--baseline", "{cur}", "--metric", "tok_per_joule"], "unknown metric"),
    (["--current", "{tmp}/nowhere", "--ratio", "scout/fullkv>=1"], "no such result file or folder"),
    (["--current", "{empty}", "--ratio", "scout/fullkv>=1"], "no usable result files found"),
    (["--current", "{corrupt}", "--ratio", "scout/fullkv>=1"], "no usable result files found"),
])
def test_usage_errors_and_unreadable_input_exit_2(tmp_path, monkeypatch, capsys, args, message):
    cur = write_results(tmp_path / "cur", [make_result("fullkv", 50.0), make_result("scout", 80.0)])
    (tmp_path / "empty").mkdir()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "truncated.json").write_text('{"schema_version": 2, "kind": "thr', encoding="utf-8")
    paths = {"cur": cur, "tmp": tmp_path, "empty": tmp_path / "empty", "corrupt": corrupt}
    code, out = run_cli(monkeypatch, capsys, "gate", *[a.format(**paths) for a in args])
    assert code == 2, out
    assert message in out and "Traceback" not in out


def test_malformed_files_are_listed_as_skipped(tmp_path, monkeypatch, capsys):
    """Non-UTF-8 bytes, wrong JSON types and missing fields: each file is named with its reason, the rest gates."""
    cur = write_results(tmp_path / "cur", [make_result("fullkv", 50.0), make_result("scout", 150.0)])
    (cur / "latin1.json").write_bytes(b'{"schema_version": 2, "method": "caf\xe9"}')
    (cur / "model_string.json").write_text(json.dumps({**make_result("scout", 1.0), "model": "tiny-qwen3"}))
    no_method = make_result("scout", 1.0)
    del no_method["method"]
    (cur / "no_method.json").write_text(json.dumps(no_method))
    (cur / "tok_s_text.json").write_text(json.dumps({**make_result("scout", 1.0), "decode_throughput_tok_s": "fast"}))
    code, out = run_cli(monkeypatch, capsys, "gate", "--current", cur, "--ratio", "scout/fullkv>=2.5")
    assert code == 0, out
    assert "Traceback" not in out
    skipped = {line.split()[1].rstrip(":").rsplit("/", 1)[-1]: line for line in out.splitlines()
               if line.startswith("skipped")}
    assert set(skipped) == {"latin1.json", "model_string.json", "no_method.json", "tok_s_text.json"}
    assert "can't decode" in skipped["latin1.json"]
    assert "model is str, expected object" in skipped["model_string.json"]
    assert "missing method" in skipped["no_method.json"]
    assert "decode_throughput_tok_s is str" in skipped["tok_s_text.json"]


def test_parse_ratio_and_tolerances():
    gate = parse_ratio("scout/full>=2.5")
    assert (gate.numerator, gate.denominator, gate.op, gate.bound) == ("scout", "fullkv", ">=", 2.5)
    tolerances = parse_tolerances(["10%", "decode_step_ms=0.2"])
    assert tolerances.of("decode_throughput_tok_s") == pytest.approx(0.10)
    assert tolerances.of("decode_step_ms") == pytest.approx(0.20)
    with pytest.raises(UsageError):
        parse_tolerances(["-5%"])
    assert parse_tolerances(["0.05"]).default == parse_tolerances(["5%"]).default == pytest.approx(0.05)
    for never_fails in ("1", "5", "100%", "250%", "0.05%%", "nan", "inf"):
        with pytest.raises(UsageError):
            parse_tolerances([never_fails])


def test_console_script_exit_code(tmp_path):
    """The installed entry point (python -m scoutbench) maps a regression to exit code 1."""
    base, cur = pair(tmp_path, [make_result("fullkv", 100.0)], [make_result("fullkv", 50.0)])
    proc = subprocess.run([sys.executable, "-m", "scoutbench", "gate", "--baseline", str(base), "--current",
                           str(cur)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: gate failed: 2 regressed" in proc.stderr


def test_auto_batch_points_compare_methods_at_their_own_batch():
    """`--batch auto` runs each method at its planned maximum: the ratio compares those, as paper Figure 8 does."""
    full = {**make_result("fullkv", 40.0, batch=4), "batch_plan": {"mode": "auto", "planned": 4}}
    scout = {**make_result("scout", 200.0, batch=16, config=SCOUT_CONFIG),
             "batch_plan": {"mode": "auto", "planned": 16}}
    report = run_gate(None, [full, scout], parse_tolerances([]), [parse_ratio("scout/fullkv>=4")])
    (row,) = report.ratio_rows
    assert row.current == 5.0 and row.verdict == "ok" and "batch auto" in row.point


def test_point_key_of_malformed_sections_names_what_it_can():
    """A file whose model, workload or batch_plan is not a mapping (hypothesis found `"model": true` in a failed
    projection, which crashed `scoutbench report`'s failed-points table) gets a key with those parts unknown."""
    key = point_key({"kind": "projection", "method": "scout", "model": True, "workload": [32768], "batch_plan": 3,
                     "max_length": 4096})
    assert (key.kind, key.method, key.model, key.dtype, key.length, key.batch) == (
        "projection", "scout", "?", "?", 4096, None)


def test_a_file_a_sweep_made_beside_its_points_matches_by_name_not_by_folder(tmp_path, monkeypatch, capsys):
    """A preset sweep profiles ScoutAttention's recall intervals into its own folder, and the point's config names
    that path: the same sweep in a baseline and a current folder was MISSING + new, never compared. A profile given
    from elsewhere (another file) is still another point."""
    def scout(folder, profile):
        return make_result("scout", 200.0, config={**SCOUT_CONFIG, "recall_profile": str(folder / profile)})

    base, cur = pair(tmp_path, [scout(tmp_path / "base", "recall_profile-ab12.json")],
                     [scout(tmp_path / "cur", "recall_profile-ab12.json")])
    code, out = run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", cur)
    assert code == 0 and "gate passed (2 comparisons" in out and str(tmp_path) not in out, out

    other = write_results(tmp_path / "other", [scout(tmp_path / "elsewhere", "recall_profile-ab12.json")])
    code, out = run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", other)
    assert code == 1 and "MISSING" in out, out


def _gate(monkeypatch, capsys, base, cur, *extra) -> tuple[int, str]:
    return run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", cur, *extra)


def _with(result: dict, **workload) -> dict:
    out = copy.deepcopy(result)
    out["workload"].update(workload)
    return out


def test_gate_refuses_nan_and_zero_throughput_instead_of_passing(tmp_path, monkeypatch, capsys):
    """A NaN or zero throughput (or a zero baseline) is INVALID: never "ok", "improved" or "REGRESSED"."""
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


@pytest.mark.parametrize("setting, base_value, cur_value", [
    ("steps", 8, 16), ("warmup", 2, 0), ("seed", 0, 1), ("kv_skew", 0.3, 0.075), ("prefill", "real", "synthetic")])
def test_gate_refuses_points_run_with_other_settings_naming_the_setting(setting, base_value, cur_value):
    """A baseline run with other steps / warm-up / seed / kv_skew / prefill is a MISMATCH that names the setting."""
    baseline = [_with(make_result("fullkv", 100.0), **{setting: base_value})]
    current = [_with(make_result("fullkv", 60.0), **{setting: cur_value})]
    report = compare(baseline, current, parse_tolerances([]))
    (row,) = report.rows
    assert row.verdict == "MISMATCH" and not report.passed
    assert f"{setting} {base_value} in the baseline vs {cur_value} now" in row.note


def test_gate_refuses_a_run_level_setting_and_a_dtype_difference():
    dense = make_result("fullkv", 100.0)
    dense["dense_layers"] = 2  # a run-level option (--dense-layers) is part of the point too
    (row,) = compare([make_result("fullkv", 100.0)], [dense], parse_tolerances([])).rows
    assert row.verdict == "MISMATCH" and "dense_layers unset in the baseline vs 2 now" in row.note
    bf16 = make_result("fullkv", 100.0)
    bf16["model"]["dtype"] = "bfloat16"
    (row,) = compare([make_result("fullkv", 100.0)], [bf16], parse_tolerances([])).rows
    assert row.verdict == "MISMATCH" and "dtype float32 in the baseline vs bfloat16 now" in row.note


def test_ratio_gate_does_not_divide_points_run_with_other_settings():
    scout = _with(make_result("scout", 400.0, config=SCOUT_CONFIG), steps=32)
    report = run_gate(None, [make_result("fullkv", 50.0), scout], parse_tolerances([]),
                      [parse_ratio("scout/fullkv>=2")])
    assert [row.verdict for row in report.ratio_rows] == ["MISSING"]


def test_gate_that_compared_nothing_fails(tmp_path, monkeypatch, capsys):
    """`--allow-missing` with nothing matched fails ("compared nothing"), for the timing and the counter gate."""
    base, cur = (write_results(tmp_path / "base", [make_result("fullkv", 100.0, length=4096 * i) for i in (1, 2, 4)]),
                 write_results(tmp_path / "cur", [make_result("fullkv", 100.0, length=3000)]))
    code, out = _gate(monkeypatch, capsys, base, cur, "--allow-missing")
    assert code == 1 and "compared nothing" in out and "gate passed" not in out, out
    baseline = load_results([BASELINE / "run1"])
    report = counter_gate(baseline, [], allow_missing=True)
    assert not report.passed and report.comparisons == 0
    code, out = run_cli(monkeypatch, capsys, "gate", "--counters", "--baseline", BASELINE / "run1",
                        "--current", cur, "--allow-missing")
    assert code == 1 and "compared nothing" in out, out


def test_gate_passes_with_the_count_of_real_comparisons(tmp_path, monkeypatch, capsys):
    base = write_results(tmp_path / "base", [make_result("fullkv", 100.0), make_result("fullkv", 50.0, length=8192)])
    cur = write_results(tmp_path / "cur", [make_result("fullkv", 100.0)])
    code, out = _gate(monkeypatch, capsys, base, cur, "--allow-missing")
    assert code == 0 and "gate passed (2 comparisons; 1 skipped)" in out, out


def test_gate_labels_carry_the_dtype(tmp_path, monkeypatch, capsys):
    """A float32 baseline point and a bfloat16 current one get labels that tell them apart."""
    failed = make_result("fullkv", status="failed", error="boom")
    bf16 = make_result("fullkv", 100.0)
    bf16["model"]["dtype"] = "bfloat16"
    report = compare([failed, make_result("quest", 90.0)], [bf16, make_result("quest", 90.0)], parse_tolerances([]))
    labels = {row.verdict: row.point for row in report.rows}
    assert labels["skipped"] != labels["new"] and "float32" in labels["skipped"] and "bfloat16" in labels["new"]


def test_a_failed_sweep_point_is_failed_in_the_gate_not_run_with_other_settings():
    """Guards the point identity (the gate judges only what is comparable): a failed sweep point's file lacked the
    workload's kv_skew, so with the settings in the key it would have read as "run with other settings" (MISMATCH)
    instead of FAILED."""
    from scoutbench.bench.throughput import ThroughputConfig, failed_result

    cfg = ThroughputConfig(method="fullkv", model="tiny-qwen3", length=4096, steps=8, warmup=2, prefill="synthetic")
    failed = failed_result(cfg, "out of memory", {"type": "cpu", "class": "cpu:Test CPU:2t"}, "float32")
    ok = make_result("fullkv", 100.0)
    ok["workload"]["kv_skew"] = cfg.kv_skew
    (row,) = compare([ok], [failed], parse_tolerances([])).rows
    assert row.verdict == "FAILED" and row.note == "out of memory"


def test_gate_says_when_batch_auto_chose_other_batches():
    def auto(batch):
        result = make_result("scout", 100.0 * batch, batch=batch, config=SCOUT_CONFIG)
        result["batch_plan"] = {"mode": "auto", "planned": batch}
        return result

    (tok_s, step) = sorted(compare([auto(16)], [auto(12)], parse_tolerances([])).rows, key=lambda r: r.metric)
    assert "--batch auto ran at 16 in the baseline vs 12 now" in step.note


@settings(max_examples=150, **PROPERTY_SETTINGS)
@given(baseline=result_files(), current=result_files(), allow_missing=st.booleans())
def test_gate_never_crashes_and_never_passes_on_a_point_it_did_not_compare(baseline, current, allow_missing):
    from scoutbench.analysis.gate import COMPARED, GATED_KINDS, fail_if_regressed, load_side
    from scoutbench.analysis.points import THROUGHPUT_METRICS, group_points, point_labels
    from scoutbench.errors import ScoutbenchError

    with tempfile.TemporaryDirectory() as tmp:
        base, cur = write_documents(Path(tmp) / "base", baseline), write_documents(Path(tmp) / "cur", current)
        extra = ["--allow-missing"] if allow_missing else []
        code, out, err = run_main("gate", "--baseline", base, "--current", cur, *extra)
        assert code in (0, 1, 2) and "Traceback" not in err, err
        code, out, err = run_main("gate", "--counters", "--baseline", base, "--current", cur, *extra)
        assert code in (0, 1, 2) and "Traceback" not in err, err
        try:
            base_results = load_side([str(base)], "baseline", lambda path, why: None)
            cur_results = load_side([str(cur)], "current", lambda path, why: None)
            report = run_gate(base_results, cur_results, parse_tolerances([]), [], allow_missing=allow_missing)
        except ScoutbenchError:
            return  # refused as a whole (no usable results, other hardware): never a pass
    for row in report.rows:
        if row.verdict in COMPARED:  # a comparison is of two measured values
            assert math.isfinite(row.baseline) and math.isfinite(row.current), row
            if row.metric in THROUGHPUT_METRICS:
                assert row.baseline > 0 and row.current > 0, row
    if not report.passed:
        with pytest.raises(ScoutbenchError):
            fail_if_regressed(report)
        return
    fail_if_regressed(report)
    assert report.comparisons > 0
    gated = [r for r in [*base_results, *cur_results] if r.get("kind") in GATED_KINDS]
    labels = point_labels(gated)
    for key, point in group_points([r for r in base_results if r.get("kind") in GATED_KINDS]).items():
        if not point.ok:
            continue
        rows = [r for r in report.rows if r.point == key.describe(labels.get(key))]
        # every baseline point was compared, or is listed as skipped with its reason (missing and allowed to be,
        # or without a gated metric): never passed over in silence
        assert any(r.compared for r in rows) or any(r.verdict == "skipped" and r.note for r in rows), (key, rows)
        assert allow_missing or not any("not in current run" in r.note for r in rows)

"""Reliability: every command's answer to inputs a new user or a tester gives it. One section per problem found;
each test is its reproducer, and failed before its fix. The property-based tests at the end
throw random result files (non-finite, missing and foreign-schema fields) at report, gate, score and project."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from cli_runner import run_cli, signal_once_started, throughput_hanging_on_second_method
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from result_factory import SCOUT_CONFIG, make_accuracy, make_result, write_results

from scoutbench.analysis.counter_gate import counter_gate
from scoutbench.analysis.gate import compare, parse_ratio, parse_tolerances, run_gate
from scoutbench.results import load_results

BASELINE = Path(__file__).resolve().parent.parent / "results" / "baselines" / "cpu-ci"
TINY = ("--model", "tiny-qwen3", "--len", "1k", "--steps", "2", "--warmup", "0")


def _never(*args, **kwargs):
    raise AssertionError("this must fail before it loads the model or runs")


def _gate(monkeypatch, capsys, base, cur, *extra) -> tuple[int, str]:
    code, out, err = run_cli(monkeypatch, capsys, "gate", "--baseline", base, "--current", cur, *extra)
    return code, out + err


# ---- the gate judges only what is comparable -------------------------------------------------------------------

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
    dense["dense_layers"] = 2  # a run-level option (--dense-layers) is part of the point too
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


# ---- a batch the tool chooses is checked against free memory like one the user gives --------------------------

GIB = 1024**3


def test_batch_auto_is_checked_against_free_memory_without_allocating(monkeypatch, capsys, tmp_path):
    """`--batch auto --gpu-mem 1TiB` on CPU grew to 23 GB and was OOM-killed (exit 137): the planned batch
    (179557) skipped the free-memory check. Free memory is faked here and the run itself is never reached."""
    import scoutbench.bench.throughput as throughput

    monkeypatch.setattr("scoutbench.planning.available_host_bytes", lambda: 8 * GIB)
    monkeypatch.setattr(throughput, "_run_at_batch", _never)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--model", "tiny-qwen3", "--len", "2k", "--steps",
                             "2", "--method", "fullkv", "--batch", "auto", "--gpu-mem", "1TiB", "-o", tmp_path / "o")
    assert code == 1, err
    assert "--batch auto's planned batch" in err and "host memory" in err and "6.40 GiB is usable" in err
    assert len(err.strip().splitlines()) == 1 and not list((tmp_path / "o").glob("*.json"))
    # the library path (sweeps run points through it) refuses the same batch before running it
    from scoutbench.errors import ScoutbenchError

    cfg = throughput.ThroughputConfig(method="fullkv", model="tiny-qwen3", length=2048, batch="auto", gpu_mem=1 << 40,
                                      steps=2, warmup=0, device="cpu")
    with pytest.raises(ScoutbenchError, match="planned batch"):
        throughput.run_throughput(cfg)


def test_batch_auto_that_fits_free_memory_still_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("scoutbench.planning.available_host_bytes", lambda: 8 * GIB)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--model", "tiny-qwen3", "--len", "256", "--steps",
                             "1", "--warmup", "0", "--method", "fullkv", "--batch", "auto", "--gpu-mem", "1.15GiB",
                             "-o", tmp_path / "o", "--json")
    assert code == 0, err
    (summary,) = json.loads(out)
    assert summary["batch"] >= 1


# ---- `report` without matplotlib ---------------------------------------------------------------------------------

def test_report_without_matplotlib_names_the_extra_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(monkeypatch, capsys, "report", tmp_path / "empty", "-o", tmp_path / "out")
    assert code == 1 and err.strip() == ("error: scoutbench report (its figures) needs matplotlib, which is not "
                                         "installed: pip install 'scoutbench[report]'"), err


def test_readme_install_line_installs_the_report_extra():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    install = next(line for line in readme.splitlines() if "pip install torch" in line)
    assert '".[report]"' in install


# ---- tables that agree with their data -----------------------------------------------------------------------

def _rendered(table) -> str:
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(table)
    return console.export_text()


def _words(text: str) -> str:
    """The text with its line wraps and padding collapsed (a caption wraps at the table's width)."""
    return " ".join(text.split())


def test_throughput_table_at_auto_batches_says_each_batch_and_labels_the_comparison():
    """The header said "batch 151" while ScoutAttention ran at 109, and "vs full" compared two batches."""
    from scoutbench.cli.throughput import _table

    def result(method, tok_s, batch):
        r = make_result(method, tok_s, batch=batch, config=SCOUT_CONFIG if method == "scout" else None)
        r["device"]["type"], r["main_thread_wait_frac"] = "cpu", 0.1
        return r

    text = _rendered(_table([result("fullkv", 151.0, 151), result("scout", 218.0, 109)]))
    assert "batch per method (--batch auto)" in text and "batch 151" not in text
    scout_row = next(line for line in text.splitlines() if line.strip().startswith("scout"))
    assert " 109 " in scout_row and "1.44x (2.00x/seq)" in scout_row
    assert "tok/s: batch x timed steps / timed decode time (the mean step); step: the median step" in _words(text)
    same = _rendered(_table([result("fullkv", 10.0, 2), result("scout", 20.0, 2)]))
    assert "batch 2 " in same and "2.00x" in same and "/seq" not in same


def test_sweep_table_shows_the_cpu_wait_share():
    """The sweep's final table showed idle 0.0 for HGCA on CPU while its JSON said 17.4%."""
    from scoutbench.cli.sweep import _sweep_table

    manifest = {"settings": {"model": "tiny-qwen3", "prefill": "synthetic", "steps": 8}, "points": [
        {"method": "hgca", "method_args": {}, "len": 4096, "batch": 1, "status": "ok", "batch_used": 1,
         "decode_throughput_tok_s": 10.0, "decode_step_ms_median": 100.0, "gpu_idle_frac": None,
         "main_thread_wait_frac": 0.174}]}
    text = _rendered(_sweep_table(manifest))
    row = next(line for line in text.splitlines() if "hgca" in line)
    assert "17.4" in row and "(the mean step); step ms: the median step" in _words(text)


def test_report_shows_the_median_of_two_runs_not_the_lower_one(tmp_path):
    from scoutbench.analysis.report import build_report

    folder = write_results(tmp_path / "runs", [make_result("fullkv", 19.0), make_result("fullkv", 25.0)])
    report = build_report([folder], tmp_path / "out")
    (point,) = report.points
    assert point.tok_s == 22.0
    summary = report.summary.read_text()
    assert "| 22.00 |" in summary and "| 19.00 |" not in summary and "median of 2 runs" in summary


def _projection_inputs(tmp_path) -> Path:
    """The committed CI baseline (bench-attn16 32k) and the same runs at 16k: two source points per method."""
    from scoutbench.results import write_json_atomic

    for index, result in enumerate(load_results([BASELINE / "run1"])):
        write_json_atomic(tmp_path / "runs" / f"{index}.json", result)
        shorter = copy.deepcopy(result)
        assert result["workload"]["len"] == 32768
        shorter["workload"]["len"] = 16384
        write_json_atomic(tmp_path / "runs" / f"{index}-16k.json", shorter)
    return tmp_path / "runs"


def test_project_table_names_each_source_point_and_the_prompt_length(tmp_path, monkeypatch, capsys):
    """`project` printed identical rows for different source points, and `len 32773` for a 32k run."""
    runs = _projection_inputs(tmp_path)
    code, out, err = run_cli(monkeypatch, capsys, "project", runs, "--hardware", "h200")
    assert code == 0, err
    assert " 32k " in out and " 16k " in out and "32773" not in out and "from" not in out
    code, out, err = run_cli(monkeypatch, capsys, "project", runs, "--hardware", "h200", "--len", "8k", "--batch", "4")
    assert code == 0, err
    rows = [line for line in out.splitlines() if " fullkv " in line]
    assert len(rows) == 2 and len(set(rows)) == 2 and "from" in out
    assert any("len 32k" in row for row in rows) and any("len 16k" in row for row in rows)


# ---- inputs that used to be accepted -----------------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["accuracy", "--dataset", "passkey", "--model", "smollm2-135m", "--len", "10k"],
    ["accuracy", "--dataset", "passkey-multi", "--model", "qwen2.5-0.5b", "--len", "40k"],
    ["accuracy", "--dataset", "passkey", "--model", "qwen2.5-0.5b", "--len", "1m"],
    ["fidelity", "--model", "smollm2-135m", "--len", "10k"],
    ["throughput", "--model", "smollm2-135m", "--len", "10k", "--method", "fullkv"],
    ["cosine", "--model", "smollm2-135m", "--len", "10k"],
])
def test_prompts_longer_than_the_models_context_are_refused_before_loading(command, monkeypatch, capsys, tmp_path):
    """smollm2 at --len 10k scored 0 silently; qwen2.5-0.5b took --len 40k and 1m."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    monkeypatch.setattr("scoutbench.gguf_models.load_gguf_model", _never)
    out_flag = [] if command[0] == "cosine" else ["-o", str(tmp_path / ("o.json" if command[0] == "fidelity" else "o"))]
    code, out, err = run_cli(monkeypatch, capsys, *command, *out_flag)
    assert code == 2 and "context window is" in err and len(err.strip().splitlines()) == 1, err


def test_longbench_max_length_beyond_the_context_is_refused(monkeypatch, capsys, tmp_path):
    records = Path("/work/shared/longbench/records")
    data_dir = records if (records / "qasper.jsonl").exists() else None
    if data_dir is None:
        pytest.skip("needs the LongBench records")
    monkeypatch.setattr("scoutbench.gguf_models.load_gguf_model", _never)
    code, out, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "qasper", "--model", "qwen2.5-0.5b",
                             "--max-length", "40k", "--data-dir", data_dir, "--limit", "1", "-o", tmp_path)
    assert code == 2 and "--max-length 40960" in err and "32768 tokens" in err, err


def test_a_real_prefill_past_the_window_of_a_loaded_model_is_refused(smollm2):
    from scoutbench.bench.resolve import ThroughputConfig, check_context_fits
    from scoutbench.errors import UsageError
    from scoutbench.models import LoadedModel

    loaded = LoadedModel(smollm2.model, "my-folder", "local", False)  # a folder's window comes from its config
    with pytest.raises(UsageError, match="context window is 8192"):
        check_context_fits(ThroughputConfig(model="my-folder", length=9000, prefill="real"), loaded)
    check_context_fits(ThroughputConfig(model="my-folder", length=9000, prefill="synthetic"), loaded)  # timing only


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_kv_skew_must_be_finite(value, monkeypatch, capsys, tmp_path):
    """`--kv-skew nan` was accepted and stored as the string "nan"."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", *TINY, "--method", "fullkv", "--kv-skew", value,
                             "-o", tmp_path)
    assert code == 2 and "--kv-skew must be a finite number" in err, err


def test_other_float_inputs_refuse_nan(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    code, _, err = run_cli(monkeypatch, capsys, "throughput", *TINY, "--method", "hgca", "--method-arg",
                           "window_share=nan", "-o", tmp_path)
    assert code == 2 and "window_share='nan' is not a valid float" in err, err
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--method", "fullkv", "--len", "64", "--executor", "ray",
                           "--cpus-per-point", "nan", "-o", tmp_path / "s")
    assert code == 2 and "--cpus-per-point" in err, err


def test_score_refuses_a_nan_length(tmp_path, monkeypatch, capsys):
    """`"length": NaN` was put in the 8k+ bucket."""
    path = tmp_path / "qasper_e.jsonl"
    path.write_text('{"pred": "a", "answers": ["a"], "length": NaN}\n')
    code, out, err = run_cli(monkeypatch, capsys, "score", "--dataset", "qasper_e", path, "--json")
    assert code == 2 and "length must be a finite number" in err, out + err


def test_score_prints_a_longbench_e_files_buckets(tmp_path, monkeypatch, capsys):
    """A sibling found on the way: the table form of `score --dataset qasper_e` crashed (a dict formatted as a
    number), only --json worked."""
    path = tmp_path / "qasper_e.jsonl"
    path.write_text('{"pred": "Paris", "answers": ["Paris"], "length": 100}\n')
    code, out, err = run_cli(monkeypatch, capsys, "score", "--dataset", "qasper_e", path)
    assert code == 0 and out.splitlines() == ["qasper_e:", "  0-4k: 100.0", "  4-8k: nan", "  8k+: nan"], out + err


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


def test_aliases_given_twice_are_refused(monkeypatch, capsys, tmp_path):
    """`--method full --method fullkv` ran FullKV twice and reported one at 0.50x of the other."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    for command in (["throughput", *TINY], ["sweep", "--len", "64"]):
        code, _, err = run_cli(monkeypatch, capsys, *command, "--method", "full", "--method", "fullkv",
                               "-o", tmp_path / command[0])
        assert code == 2 and "are the same method (fullkv)" in err, err


def test_block_size_without_a_method_that_has_one_is_refused_like_budget(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    for command in (["throughput", *TINY], ["sweep", "--len", "64"], ["plan", "--len", "1k", "--gpu-mem", "1GiB",
                                                                      "--model", "tiny-qwen3"]):
        output = [] if command[0] == "plan" else ["-o", str(tmp_path / command[0])]
        code, _, err = run_cli(monkeypatch, capsys, *command, "--method", "fullkv", "--method", "hgca",
                               "--block-size", "16", *output)
        assert code == 2 and "--block-size: no selected method has a block size" in err, (command, err)


def test_a_presets_own_budget_is_not_a_usage_error(monkeypatch, capsys, tmp_path):
    """`sweep --preset lengths --method fullkv` blamed a --budget the user never passed."""
    from scoutbench.errors import ScoutbenchError

    seen = {}

    def record(points, *args, **kwargs):
        seen["points"] = points
        raise ScoutbenchError("stop before running")

    monkeypatch.setattr("scoutbench.bench.sweep.run_sweep", record)
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--preset", "lengths", "--scale", "cpu", "--method", "fullkv",
                           "-o", tmp_path / "s")
    assert code == 1 and "stop before running" in err, err
    assert {p.method for p in seen["points"]} == {"fullkv"} and all(p.args == {} for p in seen["points"])


def test_project_budget_and_block_size_without_a_method_that_has_them_are_refused(tmp_path, monkeypatch, capsys):
    from scoutbench.results import write_json_atomic

    fullkv = next(r for r in load_results([BASELINE / "run1"]) if r["method"] == "fullkv")
    write_json_atomic(tmp_path / "runs" / "fullkv.json", fullkv)
    for flag in ("--budget", "--block-size"):
        code, _, err = run_cli(monkeypatch, capsys, "project", tmp_path / "runs", "--hardware", "h200", flag, "64")
        assert code == 2 and f"{flag}: no projected result's method has" in err, err


# ---- errors --------------------------------------------------------------------------------------------------------

def test_plan_refuses_an_unsupported_architecture_in_one_line(tmp_path, monkeypatch, capsys):
    """`plan --model DIR` with a gpt2 config gave an AttributeError traceback."""
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2,
                                                               "n_head": 2, "vocab_size": 100, "bos_token_id": 0,
                                                               "eos_token_id": 0}))
    code, out, err = run_cli(monkeypatch, capsys, "plan", "--model", tmp_path / "gpt2", "--len", "1k", "--gpu-mem",
                             "1GiB")
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "architecture 'gpt2'" in error_lines[0] and "Traceback" not in err, err


def test_symlink_loops_and_broken_links_are_named(tmp_path, monkeypatch, capsys):
    """A symlink loop as -o was reported as "File exists"."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    for output, message in (("loop", "is a symlink loop"), ("loop/x.json", "is a symlink loop"),
                            ("broken", "is a broken symlink")):
        code, _, err = run_cli(monkeypatch, capsys, "throughput", *TINY, "--method", "fullkv", "-o",
                               tmp_path / output)
        assert code == 1 and message in err and "File exists" not in err, err
    code, _, err = run_cli(monkeypatch, capsys, "report", tmp_path / "loop", "-o", tmp_path / "out")
    assert code == 2 and "is a symlink loop" in err, err


def test_messages_are_not_garbled(tmp_path):
    """"expected number or number" (a number field's type) and "config.json.. Pass" (a model folder)."""
    from scoutbench.errors import UsageError
    from scoutbench.models import load_model
    from scoutbench.results import result_problem

    problem = result_problem({**make_result("fullkv", 1.0), "decode_throughput_tok_s": [1]})
    assert problem.endswith("expected number") and "number or number" not in problem
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError) as caught:
        load_model(str(tmp_path / "empty"))
    assert ".." not in str(caught.value) and ". Pass a local folder" in str(caught.value)


def test_the_same_fault_has_the_same_exit_code_in_every_command(tmp_path, monkeypatch, capsys):
    """Unwritable output was 2 in `report` and 1 in `throughput`; a bad model folder 2 in `plan`, 1 in
    `throughput`."""
    monkeypatch.setattr("scoutbench.bench.calibration.calibrate", _never)
    runs = write_results(tmp_path / "runs", [make_result("fullkv", 40.0)])
    unwritable = "/proc/forbidden/out"
    for command in (["throughput", *TINY, "--method", "fullkv", "-o", unwritable],
                    ["report", runs, "-o", unwritable], ["sweep", "--method", "fullkv", "--len", "64", "-o", unwritable],
                    ["calibrate", "-o", unwritable + ".json"], ["fidelity", "--model", "tiny-qwen3", "-o",
                                                                unwritable + ".json"]):
        monkeypatch.setattr("scoutbench.models.load_model", _never)
        code, _, err = run_cli(monkeypatch, capsys, *command)
        assert code == 1 and "cannot write results" in err, (command, err)
    (tmp_path / "no_model").mkdir()
    monkeypatch.undo()
    for command in (["plan", "--model", tmp_path / "no_model", "--len", "1k", "--gpu-mem", "1GiB"],
                    ["throughput", "--model", tmp_path / "no_model", "--len", "64", "--method", "fullkv", "-o",
                     tmp_path / "o"]):
        code, _, err = run_cli(monkeypatch, capsys, *command)
        assert code == 2 and "error:" in err, (command, err)


def test_the_exit_code_table_in_the_docs_is_the_one_the_code_applies():
    import click

    from scoutbench.errors import EXIT_CODES, ScoutbenchError, Terminated, UsageError, exit_code

    docs = (Path(__file__).resolve().parent.parent / "docs" / "exit_codes.md").read_text()
    rows = [line.split("|")[1:4] for line in docs.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert {int(code): (meaning.strip(), when.strip()) for code, meaning, when in rows} == EXIT_CODES
    aborted_by_sigterm = click.exceptions.Abort()
    aborted_by_sigterm.__cause__ = Terminated()  # what click makes of a KeyboardInterrupt
    assert [exit_code(e) for e in (ScoutbenchError("x"), UsageError("x"), KeyboardInterrupt(), Terminated(),
                                   aborted_by_sigterm, OSError("x"), click.UsageError("x"))] == [1, 2, 130, 143, 143,
                                                                                                 1, 2]


# ---- SIGTERM like SIGINT -----------------------------------------------------------------------------------------

def test_sigterm_keeps_and_lists_the_finished_results_like_sigint(tmp_path):
    """SIGTERM exited 143 without the "kept N finished results" line that Ctrl-C gives."""
    import signal

    out = tmp_path / "runs"
    proc, started = throughput_hanging_on_second_method(tmp_path, out, TINY)
    try:
        signal_once_started(proc, started, 120, "the second method never started", signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    err = err.decode()
    assert proc.returncode == 143, err
    assert "kept 1 finished result(s)" in err and err.strip().endswith("terminated"), err
    (kept,) = out.glob("*.json")
    assert json.loads(kept.read_text())["method"] == "fullkv"


def test_sigterm_in_a_sweep_keeps_the_finished_points_and_says_so(tmp_path, monkeypatch, capsys):
    from scoutbench.errors import Terminated

    def terminated(*args, **kwargs):
        raise Terminated()

    monkeypatch.setattr("scoutbench.bench.sweep.run_sweep", terminated)
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--method", "fullkv", "--len", "64", "-o", tmp_path / "s")
    assert code == 143 and "kept the finished points" in err and err.strip().endswith("terminated"), err


# ---- no silent overwrites ------------------------------------------------------------------------------------------

def test_calibrate_and_project_never_overwrite_silently(tmp_path, monkeypatch, capsys):
    """`calibrate -o` and `project -o` replaced existing files, unlike every other command."""
    monkeypatch.setattr("scoutbench.bench.calibration.calibrate", _never)  # refused before half a minute of measuring
    existing = tmp_path / "mine.json"
    existing.write_text("{}")
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", "-o", existing)
    assert code == 2 and "exists; pass --overwrite" in err and existing.read_text() == "{}", err
    runs = _projection_inputs(tmp_path)
    code, _, err = run_cli(monkeypatch, capsys, "project", runs, "--hardware", "h200", "-o", existing)
    assert code == 2 and "exists; pass --overwrite" in err and existing.read_text() == "{}", err
    code, _, err = run_cli(monkeypatch, capsys, "project", runs, "--hardware", "h200", "-o", existing, "--overwrite")
    assert code == 0 and json.loads(existing.read_text())["kind"] == "projection", err


# ---- where results go --------------------------------------------------------------------------------------------

def _fake_profile(*args, **kwargs) -> dict:
    return json.loads((Path(__file__).resolve().parent.parent / "scoutbench" / "data" / "hardware" /
                       "h200.json").read_text())


def test_calibrate_prints_its_result_on_stdout_with_o(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("scoutbench.bench.calibration.calibrate", _fake_profile)
    code, out, err = run_cli(monkeypatch, capsys, "calibrate", "-o", tmp_path / "p.json")
    assert code == 0 and "device.memory_bw_bytes_s" in out and "profile written" in err, out + err


def test_accuracy_takes_its_lock_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """A second accuracy run into the same folder found the lock only after the model had loaded."""
    from scoutbench.results import output_lock

    monkeypatch.setattr("scoutbench.models.load_model", _never)
    with output_lock(tmp_path / "acc"):
        code, _, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "passkey", "--model", "smollm2-135m",
                               "--len", "256", "--limit", "1", "-o", tmp_path / "acc")
    assert code == 1 and "another scoutbench run is writing" in err, err


def test_accuracy_prints_its_result_on_stdout(smollm2, tmp_path, monkeypatch, capsys):
    """The table went to stderr (stdout empty). The run itself is canned: what is tested is where the result goes."""
    def canned_run(tasks, loaded, spec, out_dir, *args, **kwargs):
        path = Path(out_dir) / "result.json"
        result = {**make_accuracy("fullkv", {}), "method_repr": "FullKV()",
                  "results": {tasks[0].name: {"metric": "passkey", "n": 1, "score": 100.0}}}
        path.write_text(json.dumps(result))
        return result, path

    monkeypatch.setattr("scoutbench.models.load_model", lambda *args, **kwargs: smollm2)
    monkeypatch.setattr("scoutbench.eval.accuracy.run_accuracy", canned_run)
    code, out, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "passkey", "--model", "smollm2-135m",
                             "--len", "256", "--limit", "1", "-o", tmp_path / "acc")
    assert code == 0, err
    assert "passkey" in out and "score" in out and "result:" in err
    from scoutbench.results import output_lock

    with output_lock(tmp_path / "acc"):  # released when the command ended: the next run into the folder may start
        pass


# ---- property-based tests over the result schema and the gate -----------------------------------------------------

PROPERTY_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CI_RUNS = load_results([BASELINE / "run1"])  # real throughput results, method_stats and all (fullkv, scout)
# what a field may be replaced with: every JSON type, non-finite floats (as literals and as scoutbench writes them),
# zeros, negatives, huge numbers, empty and odd strings
ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(min_value=2**40, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["nan", "inf", "-inf", "", "auto", "x", "1"]),
    st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.sampled_from(["a", "median", "len"]),
                                                              st.integers(0, 3), max_size=2))
FIELDS = [("schema_version",), ("kind",), ("method",), ("status",), ("error",), ("method_config",),
          ("method_config", "budget"), ("method_config", "block_size"), ("method_config", "dense_layers"),
          ("model",), ("model", "name"), ("model", "dtype"), ("model", "num_layers"), ("model", "num_kv_heads"),
          ("workload",), ("workload", "len"), ("workload", "batch"), ("workload", "steps"), ("workload", "warmup"),
          ("workload", "seed"), ("workload", "kv_skew"), ("device",), ("device", "class"), ("env",),
          ("decode_throughput_tok_s",), ("decode_step_ms",), ("decode_step_ms", "median"), ("gpu_idle_frac",),
          ("main_thread_wait_frac",), ("latency_breakdown_ms",), ("latency_breakdown_ms", "idle"), ("batch_plan",),
          ("batch_plan", "mode"), ("method_stats",), ("method_stats", "cpu_compute_ratio"),
          ("method_stats", "recall"), ("results",), ("results", "qasper"), ("results", "qasper", "score"),
          ("projections",), ("projections", 0), ("projections", 0, "len"), ("projections", 0, "method"),
          ("projections", 0, "decode_throughput_tok_s"), ("hardware",), ("dense_layers",)]


def _templates() -> list[dict]:
    from scoutbench.analysis.hardware import load_hardware
    from scoutbench.analysis.projection import Target, projection_document

    projection = projection_document(copy.deepcopy(CI_RUNS), load_hardware("h200"), Target())
    return [*CI_RUNS, make_result("fullkv", 100.0), make_result("scout", 300.0, config=SCOUT_CONFIG, idle_frac=0.1),
            make_result("quest", 120.0, length=8192, batch=2), make_result("hgca", status="failed", error="oom"),
            make_accuracy("scout", {"qasper": 40.0, "samsum": 0.0}), projection]


TEMPLATES = _templates()


def _mutate(result: dict, path: tuple, value, delete: bool) -> dict:
    out = copy.deepcopy(result)
    parent = out
    for step in path[:-1]:
        if isinstance(parent, dict) and step in parent:
            parent = parent[step]
        elif isinstance(parent, list) and isinstance(step, int) and step < len(parent):
            parent = parent[step]
        else:
            return out
    last = path[-1]
    if isinstance(parent, dict) or (isinstance(parent, list) and isinstance(last, int) and last < len(parent)):
        if delete and isinstance(parent, dict):
            parent.pop(last, None)
        elif isinstance(parent, dict) or last < len(parent):
            parent[last] = value
    return out


@st.composite
def result_files(draw) -> list:
    """A few result documents, each a template with up to three random mutations, or a raw JSON value."""
    files = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 9)) == 0:
            files.append(draw(ODD_VALUES))  # not a result at all
            continue
        result = draw(st.sampled_from(TEMPLATES))
        for _ in range(draw(st.integers(0, 3))):
            result = _mutate(result, draw(st.sampled_from(FIELDS)), draw(ODD_VALUES), draw(st.booleans()))
        files.append(result)
    return files


def _write(folder: Path, documents: list) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index, document in enumerate(documents):
        (folder / f"{index}.json").write_text(json.dumps(document, default=str), encoding="utf-8")  # NaN literals
    return folder


def _main(*args) -> tuple[int, str, str]:
    """`scoutbench ARGS` in-process (no pytest fixtures: hypothesis reruns the body many times). A fault the tool
    does not classify (a bug, one `internal error` line with exit 1) fails the test whatever the exit code."""
    from scoutbench.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with mock.patch.object(sys, "argv", ["scoutbench", *map(str, args)]), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as exc:
            code = exc.code or 0
    assert "internal error" not in err.getvalue(), err.getvalue()
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=150, **PROPERTY_SETTINGS)
@given(baseline=result_files(), current=result_files(), allow_missing=st.booleans())
def test_gate_never_crashes_and_never_passes_on_a_point_it_did_not_compare(baseline, current, allow_missing):
    from scoutbench.analysis.gate import COMPARED, GATED_KINDS, fail_if_regressed, load_side
    from scoutbench.analysis.points import THROUGHPUT_METRICS, group_points, point_labels
    from scoutbench.errors import ScoutbenchError

    with tempfile.TemporaryDirectory() as tmp:
        base, cur = _write(Path(tmp) / "base", baseline), _write(Path(tmp) / "cur", current)
        extra = ["--allow-missing"] if allow_missing else []
        code, out, err = _main("gate", "--baseline", base, "--current", cur, *extra)
        assert code in (0, 1, 2) and "Traceback" not in err, err
        code, out, err = _main("gate", "--counters", "--baseline", base, "--current", cur, *extra)
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


@settings(max_examples=25, **PROPERTY_SETTINGS)
@given(documents=result_files())
def test_report_never_crashes_on_random_result_files(documents):
    from scoutbench.analysis.report import build_report
    from scoutbench.errors import ScoutbenchError

    with tempfile.TemporaryDirectory() as tmp:
        folder = _write(Path(tmp) / "runs", documents)
        try:
            report = build_report([folder], Path(tmp) / "out", formats=("svg",))  # the cheapest to render
        except ScoutbenchError:
            return
        assert report.summary.exists()
        for point in report.points:  # only measurements are plotted and tabulated
            assert math.isfinite(point.tok_s) and point.tok_s > 0 and math.isfinite(point.step_ms)


@settings(max_examples=60, **PROPERTY_SETTINGS)
@given(documents=result_files(), target=st.sampled_from([(), ("--len", "16k", "--batch", "4"), ("--batch", "auto"),
                                                          ("--model", "qwen3-8b", "--budget", "2k")]))
def test_project_never_crashes_on_random_result_files(documents, target):
    with tempfile.TemporaryDirectory() as tmp:
        folder = _write(Path(tmp) / "runs", documents)
        code, out, err = _main("project", folder, "--hardware", "h200", *target)
        assert code in (0, 2) and "Traceback" not in err, err


PREDICTION_VALUES = st.one_of(ODD_VALUES, st.text(max_size=8), st.lists(st.text(max_size=5), max_size=3))


@settings(max_examples=100, **PROPERTY_SETTINGS)
@given(rows=st.lists(st.fixed_dictionaries({}, optional={"pred": PREDICTION_VALUES, "answers": PREDICTION_VALUES,
                                                         "length": PREDICTION_VALUES,
                                                         "all_classes": PREDICTION_VALUES}), max_size=4),
       dataset=st.sampled_from(["qasper", "qasper_e", "trec", "passage_count", "lcc"]))
def test_score_never_crashes_and_buckets_only_finite_lengths(rows, dataset):
    from scoutbench.errors import UsageError
    from scoutbench.eval import score

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{dataset}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        code, out, err = _main("score", "--dataset", dataset, path)
        assert code in (0, 2) and "Traceback" not in err, err
        try:
            buckets = score.score_file(dataset, path, longbench_e=True)
        except UsageError:
            return
    lengths = [row["length"] for row in rows]
    assert all(isinstance(n, (int, float)) and math.isfinite(n) and n >= 0 for n in lengths)
    counts = {"0-4k": sum(n < 4000 for n in lengths), "4-8k": sum(4000 <= n < 8000 for n in lengths),
              "8k+": sum(n >= 8000 for n in lengths)}
    assert {k for k, v in buckets.items() if not math.isnan(v)} == {k for k, n in counts.items() if n}


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

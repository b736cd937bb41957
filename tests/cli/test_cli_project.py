"""`scoutbench project` and `scoutbench calibrate` (scoutbench/cli/project.py): the projection table, the
options that need a method, no silent overwrites, where the result goes, and random result files."""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

from cli_runner import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from random_results import BASELINE, PROPERTY_SETTINGS, result_files, run_main, write_documents
from repo_paths import REPO_ROOT

from scoutbench.results import load_results


def _never(*args, **kwargs):
    raise AssertionError("this must fail before it loads the model or runs")


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


def _fake_profile(*args, **kwargs) -> dict:
    return json.loads((REPO_ROOT / "scoutbench" / "data" / "hardware" /
                       "h200.json").read_text())


def test_project_table_names_each_source_point_and_the_prompt_length(tmp_path, monkeypatch, capsys):
    """`project` names the source point of each row where two rows share a target, and shows a 32k run's prompt
    length as 32k."""
    runs = _projection_inputs(tmp_path)
    code, out, err = run_cli(monkeypatch, capsys, "project", runs, "--hardware", "h200")
    assert code == 0, err
    assert " 32k " in out and " 16k " in out and "32773" not in out and "from" not in out
    caption = " ".join(out.split())  # each method's setting once, the paper's beside it, though two rows share it
    assert caption.count("(paper: pool 1)") == 1 and "settings: " in caption
    # the caption says what each column is
    assert "tok/s: batch / the projected step; idle %: the device's wait in the step" in caption
    assert "bound by: what the step waits for most" in caption
    code, out, err = run_cli(monkeypatch, capsys, "project", runs, "--hardware", "h200", "--len", "8k", "--batch", "4",
                             "--budget", "2k")
    assert code == 0, err
    rows = [line for line in out.splitlines() if " fullkv " in line]
    assert len(rows) == 2 and len(set(rows)) == 2 and "from" in out
    assert any("len 32k" in row for row in rows) and any("len 16k" in row for row in rows)


def test_project_budget_and_block_size_without_a_method_that_has_them_are_refused(tmp_path, monkeypatch, capsys):
    from scoutbench.results import write_json_atomic

    fullkv = next(r for r in load_results([BASELINE / "run1"]) if r["method"] == "fullkv")
    write_json_atomic(tmp_path / "runs" / "fullkv.json", fullkv)
    for flag in ("--budget", "--block-size"):
        code, _, err = run_cli(monkeypatch, capsys, "project", tmp_path / "runs", "--hardware", "h200", flag, "64")
        assert code == 2 and f"{flag}: no projected result's method has" in err, err


def test_calibrate_and_project_never_overwrite_silently(tmp_path, monkeypatch, capsys):
    """`calibrate -o` and `project -o` refuse an existing file without --overwrite, as every other command does."""
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


def test_calibrate_prints_its_result_on_stdout_with_o(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("scoutbench.bench.calibration.calibrate", _fake_profile)
    code, out, err = run_cli(monkeypatch, capsys, "calibrate", "-o", tmp_path / "p.json")
    assert code == 0 and "device.memory_bw_bytes_s" in out and "profile written" in err, out + err


@settings(max_examples=60, **PROPERTY_SETTINGS)
@given(documents=result_files(), target=st.sampled_from([(), ("--len", "16k", "--batch", "4"), ("--batch", "auto"),
                                                          ("--model", "qwen3-8b", "--budget", "2k")]))
def test_project_never_crashes_on_random_result_files(documents, target):
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_documents(Path(tmp) / "runs", documents)
        code, out, err = run_main("project", folder, "--hardware", "h200", *target)
        assert code in (0, 2) and "Traceback" not in err, err

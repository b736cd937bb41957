"""Inputs that gave a traceback, a silent wrong result or an inconsistent exit code (issue 37's reports and their
siblings): each test is a reproducer and failed before its fix. Every error is one line on stderr with the exit
code of docs/exit_codes.md."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from cli_runner import run_cli

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "results" / "baselines" / "cpu-ci" / "run1"
H200 = json.loads((ROOT / "scoutbench" / "data" / "hardware" / "h200.json").read_text())


def _strict_json(text: str):
    """JSON as a strict reader takes it: `NaN`, `Infinity` and `-Infinity` are not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# ---- project: hardware numbers ---------------------------------------------------------------------------------

def _profile(tmp_path: Path, edit) -> Path:
    profile = copy.deepcopy(H200)
    edit(profile)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(profile), encoding="utf-8")  # Python writes Infinity/NaN literals, as a user may
    return path


@pytest.mark.parametrize("value, shown", [(float("inf"), "Infinity"), (True, "true"), (float("nan"), "NaN"),
                                          (0, "0"), (-1.0, "-1.0"), ("4.8e12", '"4.8e12"')])
def test_project_refuses_a_hardware_number_that_is_not_a_positive_finite_number(value, shown, tmp_path,
                                                                                 monkeypatch, capsys):
    """`Infinity` and `true` were accepted as hardware numbers (true as 1 byte/s)."""
    def edit(profile):
        profile["device"]["memory_bw_bytes_s"]["value"] = value

    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", _profile(tmp_path, edit),
                             "--json")
    line = _one_line(err)
    assert code == 2 and "device.memory_bw_bytes_s needs" in line and f"got {shown}" in line and out == "", err


def test_project_refuses_numbers_that_give_no_finite_step(tmp_path, monkeypatch, capsys):
    """A positive, finite but absurd rate overflowed the step to infinity (NaN idle), printed as `Infinity`/`NaN`
    by --json (not JSON) and tabulated as a projection."""
    def edit(profile):
        profile["device"]["memory_bw_bytes_s"]["value"] = 1e-320

    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", _profile(tmp_path, edit),
                             "--json")
    assert code == 2 and "its numbers give fullkv a step of nan ms" in _one_line(err) and out == "", err


def test_json_on_stdout_is_strict_json():
    """Every `--json` prints through one writer, which writes a non-finite float as the result files do."""
    from scoutbench.results import json_text

    assert _strict_json(json_text({"a": float("nan"), "b": [float("inf"), -float("inf")], "c": 1.5})) == {
        "a": "nan", "b": ["inf", "-inf"], "c": 1.5}


def test_project_refuses_a_gpu_that_cannot_hold_one_sequence(tmp_path, monkeypatch, capsys):
    """A 1-byte GPU was projected with exit 0."""
    def edit(profile):
        profile["device"]["memory_bytes"]["value"] = 1

    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", _profile(tmp_path, edit))
    assert code == 2 and "not one sequence of" in _one_line(err) and "fits on h200 (weights memory)" in err, err


def test_project_marks_a_batch_the_hardware_cannot_hold(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", "a100-80gb-pcie", "--model",
                             "qwen3-14b", "--len", "32k", "--dtype", "bf16", "--batch", "64", "--json")
    assert code == 0, err
    fullkv = next(p for p in _strict_json(out)["projections"] if p["method"] == "fullkv")
    assert fullkv["fits_memory"] is False and 1 <= fullkv["max_batch"] < 64
    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", "a100-80gb-pcie", "--model",
                             "qwen3-14b", "--len", "32k", "--dtype", "bf16", "--batch", "64")
    assert code == 0 and f"64 (> max {fullkv['max_batch']})" in out and "cannot hold" in err, out + err


@pytest.mark.parametrize("document", [[1, 2], "h200", 3])
def test_a_hardware_profile_that_is_not_an_object_is_one_line(document, tmp_path, monkeypatch, capsys):
    """A hardware profile that is a JSON list was a traceback (AttributeError)."""
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", path)
    assert code == 2 and "a hardware profile is a JSON object of sections" in _one_line(err), err

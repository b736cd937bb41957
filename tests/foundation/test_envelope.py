"""One result envelope: every kind a command writes starts with the same provenance fields, built in one place
(scoutbench.results.envelope), under one schema version; a file of another schema is refused in one line."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from cli_runner import run_cli
from repo_paths import REPO_ROOT

from scoutbench.result_schema import SCHEMA_VERSION
from scoutbench.results import ENVELOPE_FIELDS, env_info

ROOT = REPO_ROOT
TINY = ("--model", "tiny-qwen3", "--device", "cpu")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One file of each kind, written by its command (tiny-qwen3, a few steps: seconds on 2 cores)."""
    out = tmp_path_factory.mktemp("kinds")
    mp = pytest.MonkeyPatch()

    class Capture:  # run_cli needs capsys; a module fixture has none, so stdout/stderr are dropped here
        def readouterr(self):
            class Captured:
                out = err = ""
            return Captured()

    def cli(*args):
        code, _, err = run_cli(mp, Capture(), *args)
        assert code == 0, (args, err)

    try:
        cli("throughput", *TINY, "--method", "quest", "--len", "64", "--steps", "2", "--warmup", "0",
            "-o", out / "throughput.json")
        cli("sweep", *TINY, "--method", "fullkv", "--len", "64", "--steps", "2", "--warmup", "0", "-o", out / "sweep")
        cli("project", out / "throughput.json", "--hardware", "h200", "-o", out / "projection.json")
        cli("fidelity", "--model", "tiny-llama", "--method", "quest", "--budget", "4096", "--len", "64", "--steps",
            "2", "--prompts", "1", "--device", "cpu", "-o", out / "fidelity.json")
        cli("profile-recall", *TINY, "--len", "64", "--steps", "3", "--budget", "32", "--block-size", "8",
            "-o", out / "recall.json")
        cli("cosine", *TINY, "--len", "64", "--steps", "2", "-o", out / "cosine.json")
    finally:
        mp.undo()
    files = {"throughput": out / "throughput.json", "sweep": out / "sweep" / "sweep.json",
             "projection": out / "projection.json", "fidelity": out / "fidelity.json",
             "scout_recall_profile": out / "recall.json", "scout_query_cosine": out / "cosine.json"}
    return {kind: json.loads(path.read_text(encoding="utf-8")) for kind, path in files.items()}


def test_every_kind_written_by_the_cli_has_the_same_envelope(written):
    base_env = set(env_info())
    for kind, data in written.items():
        assert data["kind"] == kind and data["schema_version"] == SCHEMA_VERSION
        assert [key for key in data if key in ENVELOPE_FIELDS] == list(ENVELOPE_FIELDS), kind  # same keys, same order
        assert data["command"][0] == "scoutbench" and isinstance(data["created_at"], str), kind
        assert set(data["env"]) == base_env, kind


def test_accuracy_results_carry_the_envelope_with_their_scoring_versions(smollm2, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("scoutbench.models.load_model", lambda *args, **kwargs: smollm2)
    code, out, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "passkey", "--len", "256", "--limit", "1",
                             "--device", "cpu", "-o", str(tmp_path), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert [key for key in result if key in ENVELOPE_FIELDS] == list(ENVELOPE_FIELDS)
    assert set(result["env"]) == set(env_info()) | {"scoring"}


def test_one_envelope_builder():
    """No module but scoutbench/results.py writes a result header: a writer that built its own would drift. (export.py
    copies `scoutbench_version` into another tool's format, so the two fields only a header has are searched.)"""
    header = re.compile(r'"(schema_version|created_at)"\s*:')
    offenders = [str(path.relative_to(ROOT)) for folder in ("scoutbench", "methods", "workloads")
                 for path in sorted((ROOT / folder).rglob("*.py"))
                 if path.name != "results.py" and header.search(path.read_text(encoding="utf-8"))]
    assert offenders == []


def test_a_result_of_another_schema_is_one_line_naming_both(tmp_path, monkeypatch, capsys):
    base = json.loads((ROOT / "results/baselines/cpu-ci/run1/fullkv_bench-attn16_len32k_b1.json").read_text())
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**base, "schema_version": 1}), encoding="utf-8")
    for args in (("project", old, "--hardware", "h200"), ("gate", "--counters", "--baseline", old, "--current", old)):
        code, out, err = run_cli(monkeypatch, capsys, *args)
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, (args, out, err)
        assert "schema_version 1, but this scoutbench reads schema_version 2" in lines[0], lines


def _committed_json_files() -> list[Path]:
    """The JSON files git tracks under results/ and tests/ (not a developer's own ignored runs in results/runs/);
    every JSON file there outside a checkout."""
    listed = subprocess.run(["git", "ls-files", "--", "results/*.json", "tests/*.json"], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    if listed.returncode == 0 and listed.stdout.strip():
        return [ROOT / line for line in listed.stdout.splitlines()]
    return [p for folder in ("results", "tests") for p in (ROOT / folder).rglob("*.json")]


def test_committed_results_are_of_this_schema():
    files = _committed_json_files()
    assert files
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "schema_version" in data:
            assert data["schema_version"] == SCHEMA_VERSION, path

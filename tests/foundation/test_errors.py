"""Errors and exit codes (scoutbench/errors.py): one exit code per fault in every command, and the table in
docs/exit_codes.md."""

from __future__ import annotations

from cli_runner import run_cli
from repo_paths import REPO_ROOT
from result_factory import make_result, write_results

TINY_1K = ("--model", "tiny-qwen3", "--len", "1k", "--steps", "2", "--warmup", "0")


def _never(*args, **kwargs):
    raise AssertionError("this must fail before it loads the model or runs")


def test_the_same_fault_has_the_same_exit_code_in_every_command(tmp_path, monkeypatch, capsys):
    """An unwritable output is exit 1 and a bad model folder exit 2, in every command that takes them."""
    monkeypatch.setattr("scoutbench.bench.calibration.calibrate", _never)
    runs = write_results(tmp_path / "runs", [make_result("fullkv", 40.0)])
    unwritable = "/proc/forbidden/out"
    for command in (["throughput", *TINY_1K, "--method", "fullkv", "-o", unwritable],
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

    docs = (REPO_ROOT / "docs" / "exit_codes.md").read_text()
    rows = [line.split("|")[1:4] for line in docs.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert {int(code): (meaning.strip(), when.strip()) for code, meaning, when in rows} == EXIT_CODES
    aborted_by_sigterm = click.exceptions.Abort()
    aborted_by_sigterm.__cause__ = Terminated()  # what click makes of a KeyboardInterrupt
    assert [exit_code(e) for e in (ScoutbenchError("x"), UsageError("x"), KeyboardInterrupt(), Terminated(),
                                   aborted_by_sigterm, OSError("x"), click.UsageError("x"))] == [1, 2, 130, 143, 143,
                                                                                                 1, 2]


def test_a_missing_optional_package_names_its_extra_in_one_line(tmp_path, monkeypatch, capsys):
    """Scoring gov_report without `rouge` installed was "internal error, a bug in scoutbench (ModuleNotFoundError:
    No module named 'rouge')"."""
    import sys

    path = tmp_path / "gov_report.jsonl"
    path.write_text('{"pred": "a summary", "answers": ["the summary"]}\n')
    monkeypatch.setitem(sys.modules, "rouge", None)  # as if it were not installed
    code, out, err = run_cli(monkeypatch, capsys, "score", "--dataset", "gov_report", path)
    assert code == 1 and err.strip() == ("error: scoutbench score needs rouge, which is not installed: pip install "
                                         "'scoutbench[accuracy]'"), out + err


def test_every_extra_of_the_package_has_its_install_hint():
    """OPTIONAL_MODULES names the extra of every optional dependency pyproject.toml declares (by import name)."""
    import tomllib

    from scoutbench.errors import OPTIONAL_MODULES

    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    import_names = {"flashinfer-python": "flashinfer", "mlflow-skinny": "mlflow"}
    declared = {}
    for extra, requirements in pyproject["project"]["optional-dependencies"].items():
        if extra in ("test", "dev"):  # what the test suite itself needs, not a feature's extra
            continue
        for requirement in requirements:
            name = requirement.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
            declared[import_names.get(name, name.replace("-", "_"))] = extra
    assert declared == OPTIONAL_MODULES

"""The options every command shares (scoutbench/cli/options.py): method names and aliases."""

from __future__ import annotations

from cli_runner import run_cli

TINY_1K = ("--model", "tiny-qwen3", "--len", "1k", "--steps", "2", "--warmup", "0")


def _never(*args, **kwargs):
    raise AssertionError("this must fail before it loads the model or runs")


def test_aliases_given_twice_are_refused(monkeypatch, capsys, tmp_path):
    """`--method full --method fullkv` names one method twice: a usage error, not two runs of FullKV."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    for command in (["throughput", *TINY_1K], ["sweep", "--len", "64"]):
        code, _, err = run_cli(monkeypatch, capsys, *command, "--method", "full", "--method", "fullkv",
                               "-o", tmp_path / command[0])
        assert code == 2 and "are the same method (fullkv)" in err, err

"""Run `scoutbench ARGS` in-process through the same `main` as the console script (exit codes included)."""

import sys


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Returns (exit code, stdout, stderr)."""
    from scoutbench.cli import main

    monkeypatch.setattr(sys, "argv", ["scoutbench", *map(str, args)])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err

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


def sigkill_once_started(proc, marker, timeout_s: float, what: str) -> None:
    """SIGKILL `proc` as soon as it creates `marker` (a file it writes mid-run): the kill tests' shared wait."""
    import os
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1].decode()
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)

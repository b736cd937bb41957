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


def rendered_table(table) -> str:
    """A rich table as plain text, 250 columns wide (no wrap of a figure)."""
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(table)
    return console.export_text()


def collapsed_words(text: str) -> str:
    """The text with its line wraps and padding collapsed (a caption wraps at the table's width)."""
    return " ".join(text.split())


def signal_once_started(proc, marker, timeout_s: float, what: str, signum: int | None = None) -> None:
    """Send `signum` (default SIGKILL) to `proc` as soon as it creates `marker` (a file it writes mid-run): the
    signal tests' shared wait."""
    import os
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1].decode()
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL if signum is None else signum)


def throughput_hanging_on_second_method(tmp_path, out, run_args):
    """A real `scoutbench throughput --method fullkv --method quest RUN_ARGS -o OUT` process whose second method
    touches a marker file and then hangs: FullKV's result is finished on disk when the marker appears. Returns
    (process with stderr piped, marker)."""
    import subprocess
    import textwrap

    started = tmp_path / "started"
    script = tmp_path / "hang_on_second.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        import scoutbench.bench.throughput as throughput
        from scoutbench.cli import main

        real = throughput.run_throughput

        def hang_on_second(cfg, *args, **kwargs):
            if cfg.method == "quest":
                Path({str(started)!r}).touch()
                time.sleep(120)
            return real(cfg, *args, **kwargs)

        throughput.run_throughput = hang_on_second
        sys.argv = ["scoutbench", "throughput", "--method", "fullkv", "--method", "quest", *{list(run_args)!r},
                    "-o", {str(out)!r}]
        main()
    """), encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, started

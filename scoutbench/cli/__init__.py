"""The `scoutbench` command. Thin: each subcommand is a module of its own, imported only when it runs, so
`scoutbench --help` stays fast and never touches torch.cuda. Errors the user can fix print one line."""

from __future__ import annotations

import difflib
import importlib
import math
import os
import sys

import click

from scoutbench import __version__

TRACEBACK_ENV = "SCOUTBENCH_TRACEBACK"  # =1: an internal error raises with its traceback instead of one line

# name -> "module:function"; each module defines one click command.
COMMANDS: dict[str, tuple[str, str]] = {
    "throughput": ("scoutbench.cli.throughput:command", "Decode throughput and per-stage latency of methods."),
    "env": ("scoutbench.cli.env:command", "Print the environment (torch, CUDA, NVML, flashinfer, CPU)."),
    "methods": ("scoutbench.cli.env:methods_command", "List the registered attention methods and their fields."),
    "plan": ("scoutbench.cli.plan:command", "Per-method memory per sequence and maximum batch, without running."),
    "profile-recall": ("scoutbench.cli.scout_tools:profile_recall_command",
                       "Profile per-layer recall intervals for ScoutAttention."),
    "cosine": ("scoutbench.cli.scout_tools:cosine_command",
               "Cosine similarity of predicted vs true next-layer queries (paper Table 1)."),
    "accuracy": ("scoutbench.cli.accuracy:command", "LongBench / passkey accuracy of a method."),
    "score": ("scoutbench.cli.score:score_command",
              "Official LongBench score of a prediction file or folder (eval.py), without torch."),
    "fidelity": ("scoutbench.cli.accuracy:fidelity_command", "A method against FullKV, teacher-forced."),
    "sweep": ("scoutbench.cli.sweep:command", "Grid of throughput points and the paper's figure presets."),
    "report": ("scoutbench.cli.sweep:report_command", "Figures (PNG, PDF, SVG) and a markdown summary of results."),
    "gate": ("scoutbench.cli.sweep:gate_command", "Fail on performance regressions against a baseline."),
    "project": ("scoutbench.cli.project:command", "Project measured runs onto other hardware and shapes (timeline)."),
    "calibrate": ("scoutbench.cli.project:calibrate_command", "Measure this machine's hardware profile."),
    "export": ("scoutbench.cli.export:command",
               "Results to CSV, SGLang result.jsonl, vLLM/PyTorch benchmark JSON, MLflow or W&B."),
    "data-check": ("scoutbench.cli.data:check_command",
                   "Cross-check a LongBench mirror (parquet or folder) record by record against the official files."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0] if args else ""
        if name and name not in COMMANDS and not name.startswith("-"):
            close = difflib.get_close_matches(name, list(COMMANDS), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise click.UsageError(f"no such command {name!r}{hint} (commands: {', '.join(COMMANDS)})", ctx)
        return super().resolve_command(ctx, args)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module_name, attr = COMMANDS[name][0].split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise

            @click.command(name=name, help=COMMANDS[name][1])
            def unavailable() -> None:
                raise click.ClickException(f"'{name}' is not available in this build")

            return unavailable
        return _checked(getattr(module, attr))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_text) for name, (_, help_text) in COMMANDS.items()])


def _checked(command: click.Command) -> click.Command:
    """`command` with the checks every command's options get from their declarations, in one line before it runs:
    every option whose value is a number (an int, a float, a length, a size) refuses nan, an infinity and a
    magnitude past int64 (click's FLOAT takes `nan` and `inf`; an integer past int64 overflowed the first tensor it
    sized), and an option that takes one value refuses two (click keeps the last silently: `--budget 512 --budget
    1k` ran 1k, as a repeated `--method-arg` key did)."""
    if getattr(command, "options_checked", False):
        return command
    for param in command.params:
        param.callback = _finite(param.callback)
    parse_args = command.parse_args

    def parse_args_once(ctx: click.Context, args: list[str]) -> list[str]:
        _refuse_repeated_options(command, args)
        return parse_args(ctx, args)

    command.parse_args = parse_args_once  # type: ignore[method-assign]
    command.options_checked = True  # type: ignore[attr-defined]
    return command


def _refuse_repeated_options(command: click.Command, args: list[str]) -> None:
    """A single-value option given twice with two values is a usage error; the same value twice is that value."""
    from scoutbench.errors import UsageError

    single = {name: param for param in command.params if isinstance(param, click.Option) and not param.multiple
              and not param.is_flag and not param.count for name in param.opts}
    given: dict[click.Option, str] = {}
    tokens = iter(args)
    for token in tokens:
        if token == "--":
            break
        name, equals, value = token.partition("=") if token.startswith("--") else (token, "", "")
        param = single.get(name)
        if param is None:
            continue
        if not equals:
            value = next(tokens, None)
            if value is None:
                break
        if given.get(param, value) != value:
            raise UsageError(f"{name} is given twice ({given[param]!r} and {value!r}): it takes one value; give it "
                             "once")
        given[param] = value


def _finite(previous):
    def check(ctx: click.Context, param: click.Parameter, value):
        if previous is not None:
            value = previous(ctx, param, value)
        from scoutbench.errors import UsageError
        from scoutbench.units import INT64_MAX

        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                continue
            if not math.isfinite(item) or abs(item) > INT64_MAX:
                raise UsageError(f"{param.opts[0] if param.opts else param.name} must be a finite number of magnitude "
                                 f"at most {INT64_MAX} (got {item})")
        return value

    return check


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="scoutbench")
def cli() -> None:
    """Benchmark and evaluate KV-cache offloading attention for long-context LLM decode."""


def main() -> None:
    """Entry point: user-fixable errors become one line on stderr and the exit code of the one table
    (scoutbench.errors.EXIT_CODES, docs/exit_codes.md)."""
    # OpenMP threads that spin while waiting steal the cores a concurrent CPU attention worker (or a loaded
    # machine) needs (docs/platform.md, "OpenMP wait policy"). Must be set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 prints as `\udce9`, not a traceback
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    previous_handlers = _interrupt_once()
    previous_show = _one_line_warnings()
    try:
        _run()
    finally:
        import signal
        import warnings

        warnings.showwarning = previous_show
        if previous_handlers and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # not interrupted
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)


def _run() -> None:
    from scoutbench.environment import check_environment, value
    from scoutbench.errors import FAILED, ScoutbenchError, exit_code, is_terminated, missing_extra

    try:
        check_environment()  # a bad SCOUTBENCH_* value is bad input: one line, exit 2, before anything runs
        if value("SCOUTBENCH_EMULATE_CUDA"):  # CUDA code paths on a CPU (the GPU check's dry run)
            from scoutbench.testing.emulated_cuda import activate_from_environment

            activate_from_environment()
        cli.main(standalone_mode=False, prog_name="scoutbench")
    except ScoutbenchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exit_code(exc))
    except click.exceptions.NoArgsIsHelpError as exc:  # a bare `scoutbench`: the help itself
        exc.show()
        sys.exit(exit_code(exc))
    except click.UsageError as exc:  # one line, like every other usage error, with where to look for help
        command = exc.ctx.command_path if exc.ctx is not None else "scoutbench"
        click.echo(f"error: {exc.format_message()} (see `{command} -h`)", err=True)
        sys.exit(exit_code(exc))
    except click.ClickException as exc:
        exc.show()
        sys.exit(exit_code(exc))
    except (KeyboardInterrupt, click.exceptions.Abort) as exc:  # Ctrl-C, and SIGTERM (Terminated)
        click.echo("terminated" if is_terminated(exc) else "interrupted", err=True)
        sys.exit(exit_code(exc))
    except OSError as exc:  # an OS failure nobody anticipated (disk full, permissions): still one line
        from scoutbench.results import describe_os_error

        click.echo(f"error: {describe_os_error(exc)}", err=True)
        sys.exit(exit_code(exc))
    except click.exceptions.Exit as exc:
        sys.exit(exit_code(exc))
    except Exception as exc:  # a fault nothing above classifies is a bug: one line that says so, as every error
        missing = missing_extra(exc, f"scoutbench {sys.argv[1]}" if len(sys.argv) > 1 else "scoutbench")
        if missing is not None:  # an optional dependency imported where it is used: name the extra to install
            click.echo(f"error: {missing}", err=True)
            sys.exit(exit_code(missing))
        if _traceback_wanted():
            raise
        if _out_of_memory(exc):  # past the free-memory checks (a transient they do not plan): exit 1, as they do
            text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            click.echo(f"error: out of memory ({text}); lower --len or --batch (see `scoutbench plan`)", err=True)
            sys.exit(FAILED)
        text = (str(exc).strip().splitlines() or [""])[0][:300]
        click.echo(f"error: internal error, a bug in scoutbench ({type(exc).__name__}{': ' + text if text else ''});"
                   f" rerun with {TRACEBACK_ENV}=1 for the traceback and report it", err=True)
        sys.exit(exit_code(exc))


def _out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    if "torch" not in sys.modules:  # no tensor was allocated
        return False
    from scoutbench.planning import is_out_of_memory

    return is_out_of_memory(exc)


def _traceback_wanted() -> bool:
    from scoutbench.environment import value
    from scoutbench.errors import UsageError

    try:
        return value(TRACEBACK_ENV)
    except UsageError:  # a bad value was refused at the start; here it only means no traceback
        return False


def _one_line_warnings():
    """scoutbench's own warnings (a message starting `scoutbench: `: a fallback to torch's kernels, a cache entry
    rebuilt) as one line on stderr, `warning: ...`, like the errors; Python prints a warning as its file, line and
    source line. Others print as Python prints them. Returns the previous printer, restored when main returns."""
    import warnings

    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        if text.startswith("scoutbench: "):
            click.echo(f"warning: {text.removeprefix('scoutbench: ')}", err=True)
        else:
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    return previous


def _interrupt_once() -> dict:
    """Ctrl-C (SIGINT) and SIGTERM (a job scheduler, `kill`, `timeout`) end a run once, the same way: finished
    results are kept and listed, locks released, exit 130 or 143. The first of them raises (KeyboardInterrupt, or
    Terminated); from then on both are ignored, so a second one while the run winds down (listing what it kept,
    torch's and threading's exit hooks) neither cuts that short nor prints a traceback, and the exit code stays
    the first one's. Returns the previous handlers, restored when main returns uninterrupted (an interrupted main
    leaves both ignored: its process is ending); only the main thread can install a handler (in-process test runners
    may not be on it)."""
    import signal
    import threading

    from scoutbench.errors import Terminated

    def end_once(signum, frame) -> None:
        for other in (signal.SIGINT, signal.SIGTERM):
            signal.signal(other, signal.SIG_IGN)  # kept through the interpreter's exit (it resets only its own)
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, end_once) for signum in (signal.SIGINT, signal.SIGTERM)}

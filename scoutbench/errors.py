"""Errors that the CLI turns into one line and a non-zero exit code, never a traceback, and the one table of exit
codes every command follows. `exit_code` applies the table; docs/exit_codes.md shows it (a test keeps the two
equal). The same fault gets the same code in every command because each fault has one error class and one place
that raises it (an unwritable output: scoutbench.results; an unusable model folder: scoutbench.models)."""

from __future__ import annotations

import click

OK = 0
FAILED = 1
USAGE = 2
INTERRUPTED = 130  # 128 + SIGINT
TERMINATED = 143  # 128 + SIGTERM

# code -> (meaning, examples); docs/exit_codes.md renders exactly these rows
EXIT_CODES: dict[int, tuple[str, str]] = {
    OK: ("success", "the run finished; a gate compared its points and passed"),
    FAILED: ("the work failed",
             "a gate regressed, failed a point, or compared nothing; a sweep point or a run failed; out of memory "
             "(or refused by the free-memory check); an output that cannot be written (permissions, disk full, a "
             "folder where a file should be); the output folder is locked by another run; a missing optional "
             "extra; an internal error (a bug: the line says so)"),
    USAGE: ("bad input",
            "an unknown option, name or value; an impossible combination; an input that cannot be used (a missing, "
            "unreadable or malformed result file, a model folder without a usable config, an unsupported "
            "architecture, a prompt longer than the model's context); an existing output without --overwrite"),
    INTERRUPTED: ("interrupted (SIGINT, Ctrl-C)", "finished results are kept and listed"),
    TERMINATED: ("terminated (SIGTERM)", "as SIGINT: finished results are kept and listed"),
}


class ScoutbenchError(Exception):
    """A failure the user can fix; the message says what to do. Exit code 1."""

    exit_code = FAILED


class UsageError(ScoutbenchError):
    """Bad input (unknown name, malformed value, impossible combination, unusable input file). Exit code 2."""

    exit_code = USAGE


class MissingExtraError(ScoutbenchError):
    """A command needs an optional dependency that is not installed. Exit code 1 (the input was fine)."""

    def __init__(self, what: str, module: str, extra: str) -> None:
        super().__init__(f"{what} needs {module}, which is not installed: pip install 'scoutbench[{extra}]'")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by the handler `scoutbench.cli.main` installs. A KeyboardInterrupt, so
    every interrupt path (keep and list finished results, release locks, stop workers) treats it as Ctrl-C."""


def error_text(exc: BaseException) -> str:
    """A recorded failure's error (a sweep point's, a method's in a comparison): a scoutbench error's own message,
    otherwise the exception's type and text."""
    return str(exc) if isinstance(exc, ScoutbenchError) else f"{type(exc).__name__}: {exc}"


# The optional dependencies a command imports, by the module's import name -> the extra that installs it
# (pyproject.toml's [project.optional-dependencies]; tests/foundation/test_errors.py keeps the two equal).
OPTIONAL_MODULES = {"flashinfer": "gpu", "rouge": "accuracy", "jieba": "accuracy", "fuzzywuzzy": "accuracy",
                    "huggingface_hub": "accuracy", "gguf": "smollm", "accelerate": "smollm", "matplotlib": "report",
                    "mlflow": "mlflow", "wandb": "wandb", "datasets": "datasets", "ray": "ray"}


def missing_extra(exc: BaseException, what: str) -> MissingExtraError | None:
    """The one-line error for an import of an optional dependency that failed because it is not installed (a
    module of OPTIONAL_MODULES, or one inside it), else None: such a failure is the user's to fix, not a bug."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    module = exc.name.split(".")[0]
    return MissingExtraError(what, module, OPTIONAL_MODULES[module]) if module in OPTIONAL_MODULES else None


def require_module(module: str, extra: str, what: str) -> None:
    """One line naming the extra to install when an optional dependency is missing, instead of a traceback."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(what, module, extra)


def is_terminated(exc: BaseException) -> bool:
    """SIGTERM, also after click turned the KeyboardInterrupt it is into an Abort (its cause)."""
    return isinstance(exc, Terminated) or (isinstance(exc, click.exceptions.Abort)
                                            and isinstance(exc.__cause__, Terminated))


def exit_code(exc: BaseException) -> int:
    """The exit code of the table above for an exception that ends a command."""
    if is_terminated(exc):
        return TERMINATED
    if isinstance(exc, (KeyboardInterrupt, click.exceptions.Abort)):
        return INTERRUPTED
    if isinstance(exc, ScoutbenchError):
        return exc.exit_code
    if isinstance(exc, click.UsageError):  # click's own: bad option, missing argument, no such command
        return USAGE
    if isinstance(exc, click.exceptions.Exit):
        return exc.exit_code
    if isinstance(exc, click.ClickException):
        return exc.exit_code
    return FAILED  # an OS failure nobody anticipated (disk full, permissions), or anything else

"""Option parsing shared by the commands: method lists, `--method-arg key=value`, the `--seed` range; and what their
tables share (the console, the settings caption). What the method options mean for each selected method is
scoutbench/method_args.py's, the same in every command."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import click

from scoutbench.errors import UsageError

# A log that is not a terminal (CI, `| tee`, a file) has no width of its own: rich would assume 80 columns and cut
# numbers in wide tables to "320.…". Such logs get this fixed width; a table still prints only as wide as it is.
LOG_WIDTH = 200


def rich_console(stderr: bool = False):
    """The commands' rich console on stdout (results) or stderr (progress, warnings): a terminal's own width, or
    LOG_WIDTH for a log."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else LOG_WIDTH)


def table_caption(*parts: str | None) -> str:
    """A table's caption: its parts that are there (a note such as `settings_note`'s may be None), joined by "; "."""
    return "; ".join(part for part in parts if part)


def settings_note(rows: Iterable[dict[str, Any]]) -> str | None:
    """A table caption's `settings: scout pool 3 (paper: pool 1), ...`: each row's setting (`methods.setting_text`
    of a result's, projection's or plan's `method` and `method_config`), each method and setting once; None when
    no row's method has a grid."""
    from scoutbench.methods import setting_text

    texts = [f"{row['method']} {text}" for row in rows
             if (text := setting_text(row["method"], row.get("method_config") or {})) is not None]
    return "settings: " + ", ".join(dict.fromkeys(texts)) if texts else None


REVISION_HELP = ("A commit, branch or tag of a Hugging Face --model: runs and results name the model ID@REVISION "
                 "(model.revision records it, model.commit_hash what it resolved to). Pin a commit for work you "
                 "publish.")


def revision_option(func):
    """`--revision REV` for a command with a `--model`: the command receives `model` as the reference `ID@REV`
    (models.model_reference), so every run, sweep point and result of it names the revision."""
    import functools

    @functools.wraps(func)
    def with_revision(*args, revision: str | None = None, **kwargs):
        if revision is not None:
            from scoutbench.models import model_reference

            if kwargs.get("model") is None:
                raise UsageError("--revision pins the weights of a Hugging Face --model; pass --model ID too")
            kwargs["model"] = model_reference(kwargs["model"], revision)
        return func(*args, **kwargs)

    return click.option("--revision", default=None, metavar="REV", help=REVISION_HELP)(with_revision)


FORCE_HELP = "Run even when the planned memory exceeds the free memory."

# torch.Generator.manual_seed takes a signed 64-bit integer: a larger --seed would overflow deep inside a run
SEED = click.IntRange(0, 2**63 - 1)


class LengthType(click.ParamType):
    """Tokens with an optional k/m suffix (k = 1024): `4096`, `4k`, `64k`, `1m` -> int. Errors are the one-line
    `bad --len ...` of units.parse_length."""

    name = "length"

    def convert(self, value, param, ctx):
        from scoutbench.units import parse_length

        return parse_length(value, param.opts[0] if param is not None else "length")


class BytesType(click.ParamType):
    """Memory with a unit: `80GiB`, `141GB` (decimal), `512MiB` -> bytes."""

    name = "size"

    def convert(self, value, param, ctx):
        from scoutbench.units import parse_bytes

        return parse_bytes(value)


class DtypeChoice(click.Choice):
    """--dtype: a click Choice (listed in --help, completed by the shell) with the aliases torch users type."""

    def __init__(self) -> None:
        super().__init__(DTYPE_NAMES, case_sensitive=False)

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            raise UsageError(f"unknown dtype {value!r}: use float32, bfloat16 or float16 (fp32, bf16, fp16)") from None


class AtLeast(click.IntRange):
    """An integer count with a floor (`--steps` >= 1, `--warmup` >= 0), refused in one line naming the flag."""

    def __init__(self, minimum: int) -> None:
        super().__init__(min=minimum)

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            number = click.INT.convert(value, param, ctx)  # not an integer at all: click's own message
            flag = param.opts[0] if param is not None else "value"
            raise UsageError(f"{flag} must be at least {self.min} (got {number})") from None


# models.DTYPES' names (tests/cli/test_listing.py keeps them equal); spelled out here so --help needs no torch
DTYPE_NAMES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
LENGTH = LengthType()
BYTES = BytesType()
DTYPE = DtypeChoice()
STEPS = AtLeast(1)
WARMUP = AtLeast(0)


def parse_method_args(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`--method-arg key=value` pairs of a command that runs one configuration per method. A key given twice with
    two values is refused (throughput kept the last one silently, where `sweep` sweeps both: a repeated key is an
    axis there); the same value twice is that value, as in a sweep."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"bad --method-arg {pair!r}: use key=value, e.g. --method-arg recall_interval=4")
        key, value = key.strip(), value.strip()
        if out.get(key, value) != value:
            raise UsageError(f"--method-arg {key} is given twice ({out[key]!r} and {value!r}): this command runs one "
                             f"value; give it once, or run both with `scoutbench sweep --method-arg {key}={out[key]} "
                             f"--method-arg {key}={value}`")
        out[key] = value
    return out


def expand_methods(names: tuple[str, ...] | list[str]) -> list[str]:
    """`all` (or nothing) means every registered method, ablation variants included; names are checked against
    the registry. Two names of one method (`full` and `fullkv`) are refused: the method would run twice."""
    from scoutbench.methods import METHODS

    if not names or "all" in names:
        return METHODS.names()
    seen: dict[str, str] = {}
    for name in dict.fromkeys(names):
        canonical = METHODS.canonical(name)  # raises with a did-you-mean hint
        if canonical in seen:
            raise UsageError(f"--method {seen[canonical]} and --method {name} are the same method ({canonical}); "
                             "give it once")
        seen[canonical] = name
    return list(dict.fromkeys(names))

"""Option parsing shared by the commands: method lists, `--method-arg key=value`, the `--seed` range."""

from __future__ import annotations

from typing import Any

import click

from scoutbench.errors import UsageError

# torch.Generator.manual_seed takes a signed 64-bit integer: a larger --seed would overflow deep inside a run
SEED = click.IntRange(0, 2**63 - 1)


def parse_method_args(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"bad --method-arg {pair!r}: use key=value, e.g. --method-arg recall_interval=4")
        out[key.strip()] = value.strip()
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


def method_args_for(method: str, common: dict[str, Any], budget: int | None, block_size: int | None,
                    used: set[str]) -> dict[str, Any]:
    """The args that apply to `method`: shared `--method-arg`s it has a field for, plus --budget/--block-size.

    `used` collects the keys some method accepted, so a key no method knows can be reported as an error; a
    --budget or --block-size that no selected method has a field for is reported too (check_all_used).
    """
    from scoutbench.throughput import BUDGET_FIELDS, method_field_names

    fields = method_field_names(method)
    args = {k: v for k, v in common.items() if k in fields}
    used.update(args)
    if budget is not None:
        used.add("--budget given")
        for name in BUDGET_FIELDS:
            if name in fields:
                args[name] = budget
                used.add("--budget")
                break
    if block_size is not None:
        used.add("--block-size given")
        if "block_size" in fields:
            args["block_size"] = block_size
            used.add("--block-size")
    return args


def check_all_used(common: dict[str, Any], used: set[str], methods: list[str],
                   given: tuple[str, ...] = ("--budget", "--block-size")) -> None:
    """Refuse a --budget / --block-size (those in `given`: the flags the user passed) or a --method-arg key that
    no selected method has a field for: silently ignoring it would report a run the user did not ask for."""
    wanted = {"--budget": "a token budget", "--block-size": "a block size"}
    for flag, what in wanted.items():
        if flag in given and f"{flag} given" in used and flag not in used:
            raise UsageError(f"{flag}: no selected method has {what} ({', '.join(methods)}); drop {flag} "
                             "or select a method that has one (see `scoutbench methods`)")
    unknown = [k for k in common if k not in used]
    if unknown:
        raise UsageError(f"--method-arg {unknown[0]!r} is not a field of any selected method ({', '.join(methods)}); "
                         "see `scoutbench methods`")

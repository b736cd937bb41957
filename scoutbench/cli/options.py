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
    the registry."""
    from scoutbench.methods import METHODS

    if not names or "all" in names:
        return METHODS.names()
    for name in names:
        METHODS.canonical(name)  # raises with a did-you-mean hint
    return list(dict.fromkeys(names))


def method_args_for(method: str, common: dict[str, Any], budget: int | None, block_size: int | None,
                    used: set[str], dense_layers: int | None = None) -> dict[str, Any]:
    """The args that apply to `method`: shared `--method-arg`s it has a field for, plus --budget/--block-size
    and --dense-layers (every method that keeps its first layers dense has the one field they set).

    `used` collects the keys some method accepted, so a key no method knows can be reported as an error.
    """
    from scoutbench.methods.base import DENSE_LAYERS_FIELD
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
    if block_size is not None and "block_size" in fields:
        args["block_size"] = block_size
        used.add("--block-size")
    if dense_layers is not None:
        used.add("--dense-layers given")
        if DENSE_LAYERS_FIELD in fields:
            if DENSE_LAYERS_FIELD in common:
                raise UsageError(f"--dense-layers and --method-arg {DENSE_LAYERS_FIELD}= both set {method}'s dense "
                                 "layers; use --dense-layers alone (it applies to every selected method)")
            args[DENSE_LAYERS_FIELD] = dense_layers
            used.add("--dense-layers")
    return args


def check_all_used(common: dict[str, Any], used: set[str], methods: list[str]) -> None:
    if "--budget given" in used and "--budget" not in used:
        raise UsageError(f"--budget: no selected method has a token budget ({', '.join(methods)}); drop --budget "
                         "or select a sparse method (see `scoutbench methods`)")
    if "--dense-layers given" in used and "--dense-layers" not in used:
        raise UsageError(f"--dense-layers: no selected method keeps dense layers ({', '.join(methods)} attend every "
                         "layer densely); drop --dense-layers or select a sparse method")
    unknown = [k for k in common if k not in used]
    if unknown:
        raise UsageError(f"--method-arg {unknown[0]!r} is not a field of any selected method ({', '.join(methods)}); "
                         "see `scoutbench methods`")

"""The one resolver from the command line to each selected method's fields, used by every command that builds a
method (throughput, sweep, plan, accuracy, fidelity, profile-recall).

Two kinds of source set a method field: a shared flag (`--budget`, `--block-size`, `--dense-layers`: each names one
field every sparse method that has it shares) and `--method-arg key=value`. One set of rules holds everywhere:

- a value goes to every selected method that has its field, and to no other;
- a flag or `--method-arg` key that no selected method has a field for is a usage error (ignoring it would report a
  run the user did not ask for); a preset's own sizes are defaults, applied where they fit and never an error;
- a flag and a `--method-arg` that set the same field are a conflict: a usage error naming both, never a silent
  override (a preset's default yields to the user's `--method-arg`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scoutbench.errors import UsageError
from scoutbench.methods import method_field_names

if TYPE_CHECKING:
    from scoutbench.methods.base import AttentionMethod


@dataclass(frozen=True)
class SharedFlag:
    """A flag that sets one field of every selected method that has it."""

    option: str  # as the user types it: "--budget"
    field: str  # the method field it sets
    missing: str  # what no selected method does, for the error: "has a token budget"
    help: str  # the flag's --help text, the same in every command


BUDGET = SharedFlag("--budget", "budget", "has a token budget",
                    "Sparse token budget of the selected methods that have one (e.g. 2048, 2k).")
BLOCK_SIZE = SharedFlag("--block-size", "block_size", "has a block size",
                        "Block size of the selected block-sparse methods (e.g. 32).")
DENSE_LAYERS = SharedFlag("--dense-layers", "dense_layers", "keeps dense layers",  # methods.base.DENSE_LAYERS_FIELD
                          "First layers every selected sparse method keeps dense (default: their shared 2).")


@dataclass(frozen=True)
class MethodSettings:
    """What a command was told about its methods: the shared flags' values (a flag left out is absent), the
    `--method-arg` pairs, and `defaults`: flag values that came from a preset rather than from the user."""

    flags: Mapping[SharedFlag, Any] = field(default_factory=dict)
    method_args: Mapping[str, Any] = field(default_factory=dict)
    defaults: frozenset[SharedFlag] = frozenset()

    @classmethod
    def of(cls, method_args: Mapping[str, Any] | None = None, *, budget: int | None = None,
           block_size: int | None = None, dense_layers: int | None = None,
           defaults: frozenset[SharedFlag] = frozenset()) -> MethodSettings:
        given = {BUDGET: budget, BLOCK_SIZE: block_size, DENSE_LAYERS: dense_layers}
        return cls({flag: value for flag, value in given.items() if value is not None}, dict(method_args or {}),
                   defaults)


def has_field(name: str, flag: SharedFlag) -> bool:
    return flag.field in method_field_names(name)


def resolve_method_args(methods: Sequence[str], settings: MethodSettings) -> dict[str, dict[str, Any]]:
    """Each method's field overrides (method name -> {field: value}), by the module's rules; raises UsageError."""
    conflicts = [flag for flag in settings.flags if flag.field in settings.method_args and flag not in settings.defaults]
    if conflicts:
        flag = conflicts[0]
        raise UsageError(f"{flag.option} and --method-arg {flag.field}= both set {flag.field}; give one of them")
    fields = {name: method_field_names(name) for name in methods}
    resolved: dict[str, dict[str, Any]] = {}
    for name in methods:
        args = {key: value for key, value in settings.method_args.items() if key in fields[name]}
        for flag, value in settings.flags.items():
            if flag.field in fields[name] and flag.field not in args:  # a preset default yields to --method-arg
                args[flag.field] = value
        resolved[name] = args
    listed = ", ".join(methods)
    for flag in settings.flags:
        if flag not in settings.defaults and not any(flag.field in f for f in fields.values()):
            raise UsageError(f"{flag.option}: no selected method {flag.missing} ({listed}); drop {flag.option} "
                             "or select a method that does (see `scoutbench methods`)")
    unknown = [key for key in settings.method_args if not any(key in f for f in fields.values())]
    if unknown:
        raise UsageError(f"--method-arg {unknown[0]!r} is not a field of any selected method ({listed}); "
                         "see `scoutbench methods`")
    return resolved


def check_methods_fit(methods: Iterable[AttentionMethod], model: str) -> None:
    """Each configured method (built for this check, closed here) runs on `model` (`check_model` with the shape of
    its config: no weights load), or a UsageError (exit 2) before anything loads or runs: a recall profile of a
    4-layer model given to a 16-layer one, or more dense layers than the model has, failed only once the run had
    started (a failed result, exit 1)."""
    from scoutbench.methods.base import ModelShape
    from scoutbench.models import model_config

    methods = list(methods)
    try:
        if methods:
            shape = ModelShape.from_config(model_config(model))
            for method in methods:
                method.check_model(shape)
    finally:
        for method in methods:
            method.close()

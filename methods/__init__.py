"""Attention methods (installed as `scoutbench.methods`). One file per method; this registry is lazy, so listing
names never imports a method's code. Add a method: docs/adding_a_method.md.

Every other module asks the registry (and the method classes it loads) what it needs to know about a method, its
family, display name, whether it is the dense reference, its ablation variant, its work model, instead of
listing method names: a method registered here (or, in a test, inside `METHODS.scoped()`) runs through
throughput, sweep, report, `gate --counters` and `project` without a change anywhere else."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

from scoutbench.registry import Registry

if TYPE_CHECKING:
    from scoutbench.methods.base import AttentionMethod

METHODS = Registry("method")
METHODS.register("fullkv", "scoutbench.methods.fullkv:FullKV", "full")
METHODS.register("quest", "scoutbench.methods.quest:Quest")
# Quest as its own code runs it (mit-han-lab/Quest): 16-token pages, one selection per query head.
METHODS.register("quest-official", "scoutbench.methods.quest:Quest", preset={"block_size": 16, "per_query_head": True})
METHODS.register("infinigen", "scoutbench.methods.infinigen:InfiniGen")
# InfiniGen with its authors' fetch counts (tokens within alpha of the max), where `infinigen` fetches budget - 1
# tokens: their accuracy code's (alpha 5, at most 20% of the context: the class's count settings) and their speedup
# code's (alpha 4, at most 400 tokens).
METHODS.register("infinigen-dynamic", "scoutbench.methods.infinigen:InfiniGen", preset={"dynamic_count": True})
METHODS.register("infinigen-speedup", "scoutbench.methods.infinigen:InfiniGen",
                 preset={"dynamic_count": True, "alpha": 4.0, "count_cap": 400, "count_cap_frac": None})
METHODS.register("hgca", "scoutbench.methods.hgca:HGCA")
# HGCA reading every host token's score average each step (`score_read=all`), where `hgca` keeps its selection and
# reads the selected tokens' (the same tokens: methods/hgca_selection.py).
METHODS.register("hgca-full-read", "scoutbench.methods.hgca:HGCA", preset={"score_read": "all"})
METHODS.register("scout", "scoutbench.methods.scout:ScoutAttention", "scoutattention")


class AblationVariant(NamedTuple):
    name: str  # the registered name
    label: str  # how the ablation figure labels it
    values: tuple[bool, ...]  # the values of the method's `ablation_fields`
    in_paper: bool  # one of the bars of the paper's figure


# ScoutAttention's ablation, declared once: PC (layer-ahead pre-computation) and PR (periodic recall) switched off
# one by one, in the order the figure shows them. The registry's presets below, ABLATION_METHODS, the sweep's
# `ablation` preset (PAPER_ABLATION_METHODS: the paper's Figure 12 has no PR-only bar) and ScoutAttention's
# `ablation_fields`/`ablation_variants` all come from here.
SCOUT_ABLATION_FIELDS = ("pc", "pr")
SCOUT_ABLATION = (AblationVariant("scout-base", "co-attention", (False, False), True),
                  AblationVariant("scout-pc", "+PC", (True, False), True),
                  AblationVariant("scout-pr", "+PR", (False, True), False),
                  AblationVariant("scout", "+PC+PR", (True, True), True))
for _variant in SCOUT_ABLATION:
    if _variant.name != "scout":
        METHODS.register(_variant.name, "scoutbench.methods.scout:ScoutAttention",
                         preset=dict(zip(SCOUT_ABLATION_FIELDS, _variant.values, strict=True)))
del _variant

# The distinct algorithms (tests, benchmarks and `scoutbench throughput` without --method run these; `--method all`
# adds the ablation variants).
ALL_METHODS = ["fullkv", "quest", "infinigen", "hgca", "scout"]
# What speed comparisons run by default (`scoutbench throughput` without --method): every algorithm, and InfiniGen
# both ways, its fixed fetch (budget - 1 tokens a step: its slowest, its most accurate) and its own dynamic count.
SPEED_METHODS = ["fullkv", "quest", "infinigen", "infinigen-dynamic", "hgca", "scout"]
# What the paper's figures compare (Figures 8, 9 and 11: Quest keeps every token on the device, it is not one of the
# offloading systems compared; InfiniGen both ways), the method they are about (Figure 10) and its ablation: every
# variant, and those of the paper's Figure 12.
COMPARED_METHODS = ["fullkv", "infinigen", "infinigen-dynamic", "hgca", "scout"]
PROPOSED_METHOD = "scout"
ABLATION_METHODS = [variant.name for variant in SCOUT_ABLATION]
PAPER_ABLATION_METHODS = [variant.name for variant in SCOUT_ABLATION if variant.in_paper]


def build_method(name: str, args: dict[str, Any]) -> AttentionMethod:
    """Instantiate a registered method; fields come from its preset, then `args` (strings are converted)."""
    return METHODS.load(name).from_args(args, METHODS.preset(name))


def recorded_method(name: str, config: dict[str, Any], budget: int | None = None,
                    block_size: int | None = None) -> AttentionMethod:
    """The method a result of `name` ran, built (not bound: nothing allocated) from its `method_config` with each
    field it lacks at the value its run had (`WorkModel.recorded_config`), and with `budget` / `block_size` replaced
    where given and where the method has them (HGCA's budget=None, its fraction policy, stays): the method whose work
    model `project` and `gate --counters` count (the measured fractions are relative to the budget, so they carry)."""
    args = METHODS.load(name).recorded_config(config)
    resolved = resolved_method_config(name, args)
    if budget is not None and resolved.get("budget") is not None:
        args["budget"] = budget
    if block_size is not None and "block_size" in resolved:
        args["block_size"] = block_size
    return build_method(name, args)


def method_field_names(name: str) -> set[str]:
    """The fields a registered method is configured by (what `--method-arg` and the shared flags may set)."""
    return {f.name for f in dataclasses.fields(METHODS.load(name))}


def method_file_fields(name: str) -> tuple[str, ...]:
    """The fields of a registered method whose value names a file it reads (`MethodArgs.file_fields`)."""
    return tuple(METHODS.load(name).file_fields)


def resolved_method_config(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """Every field of a registered method as `build_method(name, args)` sets it (defaults, preset, then `args`),
    before the method's own validation (`MethodArgs.resolved_config`)."""
    return METHODS.load(name).resolved_config(args, METHODS.preset(name))


def method_class(name: str) -> Any | None:
    """The class behind a registered name or alias (None for a name the registry does not know, e.g. a
    third-party method's results)."""
    return METHODS.load(name) if name in METHODS else None


def method_family(name: str) -> str | None:
    """The algorithm behind a registered name (scout-pc -> scout: the class's own name); None when unknown."""
    cls = method_class(name)
    return None if cls is None else cls.name


def is_reference(name: str) -> bool:
    """Whether `name` is the dense reference that tables compare every method with (`vs fullkv`)."""
    cls = method_class(name)
    return cls is not None and cls.reference


def display_rank(name: str) -> int:
    """Where a method goes in tables and figures: registration order by family, a family's variants before the
    full method (FullKV, Quest, InfiniGen, HGCA, scout-base, scout-pc, scout-pr, scout); unknown names last."""
    names = METHODS.names()
    if name not in METHODS:
        return len(names)

    def key(registered: str) -> tuple[int, bool, int]:
        family = method_family(registered)
        home = names.index(family) if family in names else names.index(registered)
        return home, registered == family, names.index(registered)

    return sorted(names, key=key).index(METHODS.canonical(name))


def ablation_variant(name: str, config: dict[str, Any]) -> str | None:
    """The ablation variant a run of `name` with `config` is (e.g. "+PC"), from its fields, the registry preset and
    the class defaults, in that order; None for a method without ablation variants or an unknown name."""
    cls = method_class(name)
    if cls is None or not cls.ablation_variants:
        return None
    return cls.ablation_variant({**cls.defaults(), **METHODS.preset(name), **config})


def artefact_fields(name: str) -> tuple[str, ...]:
    """The config fields of `name`'s method that name a per-point file (`AttentionMethod.artefact_fields`); empty
    for an unknown name."""
    cls = method_class(name)
    return () if cls is None else tuple(cls.artefact_fields)


def setting_label(name: str, config: dict[str, Any]) -> str | None:
    """The grid point of the one rule for defaults (docs/methods.md) that a run of `name` with `config` is, e.g.
    "pool 3" (its `settings_grid` label: what tables name a row's setting by); None for a method without a grid, an
    unknown name, or a config on none of its points."""
    cls = method_class(name)
    if cls is None or not cls.settings_grid:
        return None
    full = {**cls.defaults(), **METHODS.preset(name), **config}
    return next((label for label, fields in cls.settings_grid.items()
                 if all(full.get(key) == value for key, value in fields.items())), None)


def setting_text(name: str | None, config: dict[str, Any]) -> str | None:
    """The setting of a result of `name` with `method_config` `config`, as every table names a row's: its grid
    label with the paper-literal point beside it, e.g. "pool 3 (paper: pool 1)", or "fixed fetch (the paper's)"
    where they are one; "off the grid (paper: ...)" for a config on none of its points; None for a method without a
    grid (FullKV) or an unknown (or absent) name. A field the result lacks is at the value its run had
    (`recorded_config`)."""
    cls = method_class(name)
    if cls is None or not cls.settings_grid:
        return None
    label = setting_label(name, cls.recorded_config(config)) or "off the grid"
    if cls.paper_setting is None:
        return label
    paper = cls.paper_setting[0]
    return f"{label} (the paper's)" if label == paper else f"{label} (paper: {paper})"


def ablation_order(name: str) -> list[str]:
    """The variants of `name`'s method in the order its ablation figure shows them (empty when it has none)."""
    cls = method_class(name)
    return [] if cls is None else list(cls.ablation_variants.values())

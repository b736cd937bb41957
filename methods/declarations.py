"""What the rest of scoutbench knows about a method besides its runtime (methods/base.py): five small classes, one
per concern, each with its defaults, which `AttentionMethod` inherits (a method overrides what it declares, nothing
else has to know the runtime):

    MethodLabels   how reports name and group it: display name, the dense reference, ablation variants, per-point
                   files (analysis/report.py, analysis/figures/, the registry's helpers in methods/__init__.py)
    MethodArgs     its configuration: dataclass fields, defaults, `--method-arg key=value` strings converted to them
                   (scoutbench/method_args.py, the registry's `build_method`)
    MemoryPlan     its bytes per sequence at a shape and length, from its config alone (`scoutbench plan`,
                   `--batch auto`: scoutbench/planning.py, bench/throughput.py, cli/sweep.py)
    WorkModel      what one decode step reads, copies and attends, from measured shape-free fractions
                   (`project`, `gate --counters`: analysis/work.py, analysis/projection.py; vocabulary:
                   methods/work_model.py)
    DefaultsSearch the grid of open settings its defaults are chosen over by the one rule of docs/methods.md, and
                   the setting the papers describe literally (benchmarks/tune_defaults.py)

A method may keep its memory plan and work model in a companion mixin beside its runtime, `methods/<method>_work.py`
(a `WorkModel` subclass first among the method's bases: scout_work.py, infinigen_work.py, hgca_work.py), so that its
runtime file holds the runtime only. Nothing here imports the runtime: base.py builds on this module.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from scoutbench.errors import UsageError

if typing.TYPE_CHECKING:
    from scoutbench.methods.work_model import LayerTerms, LayerWork, RunRecord

# Every sparse method keeps its first layers dense (FullKV storage, `FullKV.for_layers`) through this one field,
# with one default: a comparison then compares the same sparse layers (`--dense-layers` sets it for every method
# at once). 2, after Quest §3.4: the first two layers are under 10% sparse in the models it measured.
DENSE_LAYERS_FIELD = "dense_layers"
DEFAULT_DENSE_LAYERS = 2


def dense_layers_of(method: Any) -> int | None:
    """The layers a method keeps dense (None: it has no such field, e.g. FullKV, which is dense everywhere)."""
    return getattr(method, DENSE_LAYERS_FIELD, None)


def sparse_layer_range(name: str, dense_layers: int, num_layers: int) -> range:
    """The layers of a `num_layers` model that a method keeping its first `dense_layers` dense runs sparse. None
    of them is refused (exit 2): the run would be FullKV's work recorded under the sparse method's name, budget
    and `sparse: true`."""
    if dense_layers >= num_layers:
        raise UsageError(f"{name}: dense_layers {dense_layers} keeps all {num_layers} layers of the model dense, so "
                         f"nothing would run sparse; use --dense-layers below {num_layers}, or --method fullkv")
    return range(dense_layers, num_layers)


@dataclass(frozen=True)
class ModelShape:
    """The config numbers that memory planning needs (from a transformers config, no model built)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                   cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)

    def kv_bytes_per_token_layer(self, elem_bytes: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * elem_bytes


@dataclass(frozen=True)
class Footprint:
    """Per-sequence memory of a method at a context length: what must sit on the device, what lives on the host."""

    device_bytes_per_seq: int
    host_bytes_per_seq: int
    # device transient of ingest_prefill per sequence, on top of the prompt's K/V the engine hands over (what a
    # method's chunked copies and fp32 temporaries hold at once): the planner's prefill workspace adds it
    prefill_bytes_per_seq: int = 0


class MethodLabels:
    """How reports and figures name a method and group its runs."""

    name: ClassVar[str] = ""  # the family: every registered name of this class (scout-pc, ...) is one algorithm
    display_name: ClassVar[str] = ""  # how figures name the algorithm (empty: `name`)
    # True for the dense reference that tables compare every method with (`vs fullkv`): FullKV.
    reference: ClassVar[bool] = False
    # Ablation variants (report's ablation figure): values of `ablation_fields` -> the variant's label, in the order
    # the figure shows them; empty for a method without variants.
    ablation_fields: ClassVar[tuple[str, ...]] = ()
    ablation_variants: ClassVar[dict[tuple[Any, ...], str]] = {}
    # Fields that name a file made for one point from its other fields (ScoutAttention's `recall_profile`, which a
    # sweep profiles into its folder): the point's other fields already say what ran, so reports neither label
    # nor split series by them.
    artefact_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def ablation_variant(cls, config: dict[str, Any]) -> str | None:
        """The label of the ablation variant that `config` (every field given) is, or None."""
        if not cls.ablation_variants:
            return None
        return cls.ablation_variants.get(tuple(bool(config.get(name)) for name in cls.ablation_fields))


class MethodArgs:
    """A method's configuration: the fields of its dataclass. `repr(method)` is the full constructor call and goes
    into every result, as kvpress does."""

    name: ClassVar[str] = ""
    # Fields whose value names a file the method reads (ScoutAttention's `recall_profile`): its content, not its
    # name, decides a run, so a sweep point's identity is the file's sha256 (bench/sweep_grid.py).
    file_fields: ClassVar[tuple[str, ...]] = ()
    # Float fields where infinity is a value with a meaning (InfiniGen's `alpha=inf`: every token counts); every
    # other number must be finite and at most MAX_MAGNITUDE, before anything runs.
    infinite_fields: ClassVar[tuple[str, ...]] = ()
    # Fields added after results in results/ were made, each with the value that reproduces the behaviour from before
    # it existed: at that value `identity()` leaves the field out, so a rerun of those runs finds their folders and
    # resumes them instead of starting a new configuration that predicts the same.
    added_fields: ClassVar[dict[str, Any]] = {}

    def config(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def identity(self) -> str:
        """The constructor call of what decides this configuration's predictions (the folder hash of an accuracy
        run): `repr`, less each `added_fields` entry that holds its earlier behaviour's value."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr
                 and not (f.name in self.added_fields and getattr(self, f.name) == self.added_fields[f.name])]
        return f"{type(self).__qualname__}({', '.join(shown)})"

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The fields' default values (a field without a default is left out)."""
        out = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out

    def check_model(self, shape: ModelShape) -> None:
        """Refuse (UsageError, exit 2) a model this configuration cannot run on, before anything loads or runs:
        every command that builds a method calls it with the model's shape from its config. Here: the layers it
        keeps dense leave a sparse one; a method that reads a per-layer file checks its layers too."""
        dense = dense_layers_of(self)
        if dense is not None:
            sparse_layer_range(self.name, dense, shape.num_layers)

    @classmethod
    def converted_args(cls, overrides: dict[str, Any], preset: dict[str, Any] | None = None) -> dict[str, Any]:
        """The preset's fields, then `overrides` (`--method-arg key=value` strings, or values) converted to each
        field's type; every number finite (but an `infinite_fields` one) and at most MAX_MAGNITUDE. Raises a
        UsageError naming the field; the method's own ranges are its `__post_init__`'s."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = _type_hints(cls)
        kwargs: dict[str, Any] = dict(preset or {})
        for key, raw in overrides.items():
            if key not in fields:
                raise UsageError(f"{cls.name}: unknown --method-arg {key!r} (fields: {', '.join(fields) or 'none'})")
            kwargs[key] = _convert(cls.name, key, raw, hints[key])
        for key, value in kwargs.items():
            _check_number(cls.name, key, value, overrides.get(key, value), key in cls.infinite_fields)
        return kwargs

    @classmethod
    def resolved_config(cls, overrides: dict[str, Any], preset: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every field as `from_args` sets it (the defaults, the preset, then `overrides`), before the method's own
        validation: what a run with these arguments is configured with (a sweep point's identity)."""
        return {**cls.defaults(), **cls.converted_args(overrides, preset)}

    @classmethod
    def from_args(cls, overrides: dict[str, Any], preset: dict[str, Any] | None = None) -> Any:
        """Build from `--method-arg key=value` strings, converting each to its field's type."""
        kwargs = cls.converted_args(overrides, preset)
        try:
            return cls(**kwargs)
        except (ValueError, TypeError, OverflowError) as exc:
            raise UsageError(f"{cls.name}: {exc}") from None


class MemoryPlan:
    """A method's memory at a model shape and context length, for `scoutbench plan` and `--batch auto`."""

    def memory_footprint(self, shape: ModelShape, context_len: int, elem_bytes: int) -> Footprint:
        """Bytes per sequence (KV, digests, resident blocks, method buffers; not weights or activations),
        for `scoutbench plan` and `--batch auto`. Must follow from the config, the budget and the block size."""
        raise NotImplementedError


class WorkModel:
    """What `project` and `gate --counters` count for a method (methods/work_model.py has the vocabulary): the
    shape-free fractions it measures and what one sparse layer of a step does at a shape, given them. Instance
    methods of the method a run was configured as (`recorded_method` in methods/__init__.py builds it from a result's
    config, without binding it: nothing is allocated), so that the work model reads the same fields and derived
    quantities as the runtime. A method without one runs everywhere else; `project` skips its results and says why."""

    name: ClassVar[str] = ""
    added_fields: ClassVar[dict[str, Any]]  # MethodArgs's: the value each field added later had before it
    # The shape-free fractions the work model measures (`measure_work`), with the value each takes when a result
    # does not say (MeasuredWork accepts exactly these).
    work_fractions: ClassVar[dict[str, float]] = {}

    @classmethod
    def recorded_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """A result's `method_config` with each field it lacks at the value its run had: a result written before a
        field existed ran its `added_fields` value, and before the first layers were kept dense, none dense."""
        earlier = dict(cls.added_fields)
        if DENSE_LAYERS_FIELD in {f.name for f in dataclasses.fields(cls)}:
            earlier[DENSE_LAYERS_FIELD] = 0
        return {**earlier, **config}

    def measure_work(self, run: RunRecord) -> dict[str, float]:
        """The shape-free fractions (`work_fractions`) of one measured run of this method, from its method stats:
        what carries to another model, length, batch and budget (e.g. "the CPU attends 9% of the budget")."""
        return {}

    def work_dense_layers(self, num_layers: int) -> int:
        """Layers of a step that run dense on the device."""
        dense = dense_layers_of(self)
        return 0 if dense is None else sparse_layer_range(self.name, dense, num_layers).start

    def sparse_layer_work(self, fractions: dict[str, float], terms: LayerTerms) -> LayerWork:
        """One sparse layer of a decode step for the batch at `terms.shape`, given the measured `fractions`."""
        raise UsageError(f"method {self.name!r} declares no work model (AttentionMethod.sparse_layer_work): "
                         "`project` and `gate --counters` cannot count its work")


class DefaultsSearch:
    """The settings a method's defaults are chosen over (docs/methods.md, "One rule for every method's defaults";
    benchmarks/tune_defaults.py runs the rule): each grid point sets the same fields, the default is the winning
    point's values, and the point the papers describe literally is shown beside it."""

    # label -> the fields of one grid point (every point sets the same fields); empty: nothing left open
    settings_grid: ClassVar[dict[str, dict[str, Any]]] = {}
    # (label of the grid point the papers describe literally, where they say so); None without a grid
    paper_setting: ClassVar[tuple[str, str] | None] = None


# The largest magnitude of a numeric field: the largest integer a float holds exactly, so that a field's arithmetic
# with the shape (pool slots = pool_factor x selection, bytes = budget x heads x ...) stays finite and exact; no
# budget, count or ratio comes near it.
MAX_MAGNITUDE = 2**53


def _check_number(method: str, key: str, value: Any, given: Any, infinite_allowed: bool) -> None:
    """A numeric field's value is finite (nan passed every `>=` check unnoticed; `pool_factor=inf` or `1e309`
    overflowed the planner's rounding) and at most MAX_MAGNITUDE; `given` is the value as the user wrote it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if math.isinf(value) and infinite_allowed:
        return
    if not math.isfinite(value):
        raise UsageError(f"{method}: --method-arg {key}={given!r} is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise UsageError(f"{method}: --method-arg {key}={given!r} is out of range (at most {MAX_MAGNITUDE:.3g} in "
                         "magnitude)")


def _convert(method: str, key: str, raw: Any, hint: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    base = _unwrap_optional(hint)
    text = raw.strip()
    if base is not str and text.lower() in ("none", "null") and base is not hint:
        return None
    try:
        if base is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            from scoutbench.units import parse_length

            return parse_length(text) if text[-1:].lower() in "km" else int(text)
        if base is float:
            return float(text)  # nan and inf: _check_number
        return text
    except (ValueError, UsageError):
        raise UsageError(f"{method}: --method-arg {key}={raw!r} is not a valid {getattr(base, '__name__', base)}") from None


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A method class's field types, resolved once (typing.get_type_hints compiles every annotation anew: a sweep
    resolves a configuration per point)."""
    return typing.get_type_hints(cls)


def _unwrap_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)) else hint

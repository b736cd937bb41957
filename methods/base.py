"""The method contract: a small dataclass that owns its KV storage and returns decode attention.

The engine (scoutbench/engine.py) runs the layer loop and calls, per run and per step:

    bind(ctx)                                   once: allocate storage for ctx.batch x ctx.max_len tokens
    ingest_prefill(layer, q_obs, k, v, lengths) once per layer: the prompt's post-RoPE K/V (and recent queries)
    begin_step(step)                            per decode step: positions of the new tokens (the step's plan)
      before_layer(layer, hidden, normed)       per layer, before its attention (layer-ahead hook)
      decode(layer, q, k, v) -> o               per layer: append k/v, return attention output [B, Hq, D]
    end_step()                                  per decode step
    stats() -> dict, reset_stats()              method statistics for the result JSON (reset after warm-up)
    close()                                     release workers and buffers (always called)

Hyper-parameters are dataclass fields, validated in __post_init__; `repr(method)` is the full constructor call
and goes into every result, as kvpress does.

CUDA graphs (scoutbench/graphs.py). `begin_step` and `end_step` always run eagerly: they are the step's plan, where
host arithmetic (positions, block boundaries, what is due) becomes device metadata written in place. The per-layer
hooks (`before_layer`, `decode`) are what a graph captures: their Python runs once, at capture, and only the device
work it issued is replayed, so per step they may read only device tensors (no Python int that changes per step, no
host read) and keep no Python bookkeeping. Host work among them (a hand-off to the CPU worker, a wait for its result,
a recall, a statistic) goes through `ctx.host(fn, *args)`: run at once when eager, and at every replay between the
captured pieces with graphs; `fn` communicates with the device code through buffers, never by return value.
`graph_key()` names the variant of the step's device work this step needs (None: one for every step).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from scoutbench.errors import UsageError
from scoutbench.timing import StageTimer

if typing.TYPE_CHECKING:
    from scoutbench.methods.work_model import LayerTerms, LayerWork, RunRecord

# The prompt queries the engine hands every method at prefill (initial selection, InfiniGen's SVD, HGCA's scores).
OBS_WINDOW = 256

# Every sparse method keeps its first layers dense (FullKV storage, `FullKV.for_layers`) through this one field,
# with one default: a comparison then compares the same sparse layers (`--dense-layers` sets it for every method
# at once). 2, after Quest §3.4: the first two layers are under 10% sparse in the models it measured.
DENSE_LAYERS_FIELD = "dense_layers"
DEFAULT_DENSE_LAYERS = 2


def dense_layers_of(method: AttentionMethod) -> int | None:
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


@dataclass
class StepInfo:
    """Where the new token of each sequence goes. `positions` lives on the compute device; the host copy
    avoids device syncs in the decode loop."""

    positions: torch.Tensor  # [B] int64: tokens already cached = position of the new token
    positions_host: list[int]
    index: int  # decode step number, 0-based, warm-up included

    @property
    def uniform(self) -> bool:
        return min(self.positions_host) == max(self.positions_host)


@dataclass
class MethodContext:
    """What a method may know about the model and the run."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    batch: int
    max_len: int  # prompt + decode tokens that the storage must hold, per sequence
    device: torch.device
    dtype: torch.dtype
    timer: StageTimer
    # predict_query(target_layer, hidden, normed) -> rotated query [B, Hq, D] of `target_layer` for the current
    # token, computed from another layer's input (the layer-ahead prediction of ScoutAttention and InfiniGen).
    predict_query: Callable[..., torch.Tensor]
    # host(fn, *args): host work inside a layer's hooks (module docstring: CUDA graphs); runs fn(*args) now when eager
    host: Callable[..., None] = lambda fn, *args: fn(*args)
    # the step is replayed from CUDA graphs: per-layer hooks read only device tensors (no host lengths for a backend)
    graphs: bool = False

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize


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


@dataclass
class AttentionMethod:
    """The contract (module docstring). What the rest of scoutbench knows about a method comes from here: its
    fields (the dataclass), its statistics (`stats`), its memory (`memory_footprint`), its work model
    (`work_fractions`, `measure_work`, `sparse_layer_work`: what `project` and `gate --counters` count) and the
    metadata below."""

    name: ClassVar[str] = ""  # the family: every registered name of this class (scout-pc, ...) is one algorithm
    display_name: ClassVar[str] = ""  # how figures name the algorithm (empty: `name`)
    # True when the method needs before_layer (the engine skips the call otherwise).
    layer_ahead: ClassVar[bool] = False
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
    # The shape-free fractions the work model measures (`measure_work`), with the value each takes when a result
    # does not say (MeasuredWork accepts exactly these).
    work_fractions: ClassVar[dict[str, float]] = {}

    def bind(self, ctx: MethodContext) -> None:
        self.ctx = ctx

    def ingest_prefill(self, layer: int, q_obs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       lengths: torch.Tensor) -> None:
        """q_obs `[B, Hq, W, D]`: queries of each prompt's last W tokens; k/v `[B, Hkv, N, D]`, right-padded to N,
        valid up to lengths[b]. The engine may reuse these tensors for the next layer: copy what you keep."""
        raise NotImplementedError

    def begin_step(self, step: StepInfo) -> None:
        self.step = step

    def before_layer(self, layer: int, hidden: torch.Tensor, normed: torch.Tensor) -> None:
        """Layer-ahead hook: `hidden` is layer `layer`'s residual input `[B, hidden]`, `normed` its normalised form."""

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q `[B, Hq, D]`, k/v `[B, Hkv, D]` (post-RoPE) -> attention output `[B, Hq, D]` in q's dtype."""
        raise NotImplementedError

    def end_step(self) -> None:
        pass

    def graph_key(self) -> Any:
        """Which captured variant of the step's device work this step replays (called after `begin_step`); steps
        with equal keys issue the same device work from the same buffers. None: every step is alike."""
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def reset_stats(self) -> None:
        """Zero the counters behind `stats()`: the throughput runner calls it after warm-up, so statistics cover
        exactly the timed steps."""

    def close(self) -> None:
        pass

    def memory_footprint(self, shape: ModelShape, context_len: int, elem_bytes: int) -> Footprint:
        """Bytes per sequence (KV, digests, resident blocks, method buffers; not weights or activations),
        for `scoutbench plan` and `--batch auto`. Must follow from the config, the budget and the block size."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

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

    @classmethod
    def ablation_variant(cls, config: dict[str, Any]) -> str | None:
        """The label of the ablation variant that `config` (every field given) is, or None."""
        if not cls.ablation_variants:
            return None
        return cls.ablation_variants.get(tuple(bool(config.get(name)) for name in cls.ablation_fields))

    # ---- work model (`project`, `gate --counters`; methods/work_model.py has the vocabulary) ------------------
    @classmethod
    def measure_work(cls, run: RunRecord) -> dict[str, float]:
        """The shape-free fractions (`work_fractions`) of one measured run, from its method stats: what carries to
        another model, length, batch and budget (e.g. "the CPU attends 9% of the budget")."""
        return {}

    @classmethod
    def work_config(cls, config: dict[str, Any], budget: int | None, block_size: int | None) -> dict[str, Any]:
        """A run's config with `budget` / `block_size` replaced where given and where the method has them (the
        measured fractions are relative to the budget, so they carry)."""
        cfg = dict(config)
        if budget is not None and cfg.get("budget") is not None:  # HGCA's budget=None (fraction policy) stays
            cfg["budget"] = budget
        if block_size is not None and "block_size" in cfg:
            cfg["block_size"] = block_size
        return cfg

    @classmethod
    def work_dense_layers(cls, config: dict[str, Any], num_layers: int) -> int:
        """Layers of a step that run dense on the device."""
        return sparse_layer_range(cls.name, int(config.get(DENSE_LAYERS_FIELD, 0)), num_layers).start

    @classmethod
    def sparse_layer_work(cls, fractions: dict[str, float], config: dict[str, Any], terms: LayerTerms) -> LayerWork:
        """One sparse layer of a decode step for the batch at `terms.shape`, given the measured `fractions` and the
        (possibly re-budgeted) `config`."""
        raise UsageError(f"method {cls.name!r} declares no work model (AttentionMethod.sparse_layer_work): "
                         "`project` and `gate --counters` cannot count its work")

    @classmethod
    def from_args(cls, overrides: dict[str, str], preset: dict[str, Any] | None = None) -> AttentionMethod:
        """Build from `--method-arg key=value` strings, converting each to its field's type."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = dict(preset or {})
        for key, raw in overrides.items():
            if key not in fields:
                raise UsageError(f"{cls.name}: unknown --method-arg {key!r} (fields: {', '.join(fields) or 'none'})")
            kwargs[key] = _convert(cls.name, key, raw, hints[key])
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"{cls.name}: {exc}") from None


def transfer_stats(h2d_bytes: int, d2h_bytes: int, steps: int) -> dict[str, float]:
    """Bytes copied host-to-device and device-to-host per decode step, every layer: the same two keys in every
    method's stats, counting what the CUDA path really copies (index tensors included)."""
    steps = max(steps, 1)
    return {"h2d_bytes_per_step": h2d_bytes / steps, "d2h_bytes_per_step": d2h_bytes / steps}


class AttendedTokens:
    """Tokens attended per (sequence, KV head) in a method's sparse layers, over every (layer, step): the one
    number `--budget` bounds in every method and ablation, reported as mean and max in every method's stats.

    Counts come as a device tensor `[B, Hkv]` (`add`: accumulated on the device, no host sync until `stats`) or
    as host per-sequence counts shared by every KV head (`add_host`). Made with a `device`, it also accumulates
    in place into two device scalars that `reset` zeroes in place (`accumulate`, which a captured CUDA graph
    replays: it adds no Python state; the rows it stands for are counted by the host, `count_rows`)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._static = None if device is None else (torch.zeros((), device=device), torch.zeros((), device=device))
        self.reset()

    def reset(self) -> None:
        self._host_sum = 0.0
        self._host_max = 0
        self._rows = 0
        self._device_sum: torch.Tensor | None = None
        self._device_max: torch.Tensor | None = None
        if self._static is not None:
            for total in self._static:
                total.zero_()

    def accumulate(self, counts: torch.Tensor) -> None:
        """Device work only: counts `[B, H]` of one layer into the static sum and max (`count_rows` the rows)."""
        static_sum, static_max = self._static
        static_sum.add_(counts.sum())
        torch.maximum(static_max, counts.max(), out=static_max)

    def count_rows(self, rows: int) -> None:
        self._rows += rows

    def add(self, counts: torch.Tensor, layers: int = 1) -> None:
        """Counts `[B, H]` of one layer, or of each of `layers` layers that attended the same in this step."""
        total, most = counts.sum() * layers, counts.max()
        self._device_sum = total if self._device_sum is None else self._device_sum + total
        self._device_max = most if self._device_max is None else torch.maximum(self._device_max, most)
        self._rows += counts.numel() * layers

    def add_host(self, per_sequence: list[int], kv_heads: int, layers: int = 1) -> None:
        if not layers:
            return
        self._host_sum += sum(per_sequence) * kv_heads * layers
        self._host_max = max(self._host_max, max(per_sequence))
        self._rows += len(per_sequence) * kv_heads * layers

    def stats(self, budget: int | None) -> dict[str, Any]:
        """`attended_tokens_per_head` of a method's stats: mean, max, the budget, and whether max <= budget."""
        total, most = self._host_sum, self._host_max
        for device_sum, device_max in ((self._device_sum, self._device_max), self._static or (None, None)):
            if device_sum is not None:
                total += float(device_sum)
                most = max(most, int(round(float(device_max))))
        mean = total / self._rows if self._rows else None
        within = None if budget is None or not self._rows else most <= budget
        return {"mean": mean, "max": most if self._rows else None, "budget": budget, "within_budget": within}


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
            value = float(text)  # accepts inf; nan would pass every `>=`/`<=` field check unnoticed
            if value != value:
                raise ValueError
            return value
        return text
    except (ValueError, UsageError):
        raise UsageError(f"{method}: --method-arg {key}={raw!r} is not a valid {getattr(base, '__name__', base)}") from None


def _unwrap_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)) else hint


def require(condition: bool, message: str) -> None:
    """Field validation helper for __post_init__."""
    if not condition:
        raise ValueError(message)

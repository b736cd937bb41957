"""The vocabulary of a method's work model: what one decode step reads, moves and computes at a shape.

Each method declares its own model (`WorkModel` in methods/declarations.py: `work_fractions` on its class,
`measure_work` and `sparse_layer_work` on the method a run was configured as); `scoutbench/analysis/work.py` holds
only the generic machinery around these types (a result's shape, the dense layers, the lm_head, the per-step
totals) that `project` and `gate --counters` use.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from scoutbench.methods.base import ModelShape, dense_layers_of

FP32_BYTES = 4
INDEX_BYTES = 8  # int64 block / token ids


@dataclass(frozen=True)
class Shape:
    """Where a step runs: model shape, tokens in context, sequences, element bytes of weights and KV."""

    model: ModelShape
    context_len: int
    batch: int
    elem_bytes: int
    tied_embeddings: bool = False

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in one layer (all KV heads)."""
        return self.model.kv_bytes_per_token_layer(self.elem_bytes)


@dataclass(frozen=True)
class Transfer:
    """Copies over the host-device bus in one layer: total bytes in `copies` separate copies."""

    bytes: float = 0.0
    copies: float = 0.0

    def __add__(self, other: Transfer) -> Transfer:
        return Transfer(self.bytes + other.bytes, self.copies + other.copies)


@dataclass(frozen=True)
class LayerWork:
    """One layer of one decode step for the whole batch. `overlap` says what the device waits for:
    none (device only), same_layer (CPU part of this layer, in parallel with device attention), layer_ahead (CPU
    part launched one layer earlier), prefetch (H2D fetch launched one layer earlier)."""

    overlap: str
    weight_bytes: float  # q/k/v/o projections and MLP
    linear_flops: float
    linear_split: tuple[float, float, float]  # shares of q/k/v, o_proj and MLP in the linear weights
    predict_weight_bytes: float = 0.0  # layer-ahead query prediction (next layer's q_proj)
    select_bytes: float = 0.0  # block digests or speculation keys read on the device to choose tokens
    device_kv_bytes: float = 0.0  # KV read by device attention
    device_page_tokens: int = 0  # how device attention reads it: 0 contiguous (a dense kernel), n selected n-token pages
    device_tokens: float = 0.0  # (sequence, KV head, token) triples attended on the device
    host_kv_bytes: float = 0.0  # KV (and score state) read by CPU attention
    cpu_tokens: float = 0.0  # (sequence, KV head, token) triples attended on the CPU
    host_gather_bytes: float = 0.0  # gathered on the host into a staging buffer before a bulk copy
    merge_bytes: float = 0.0  # partial states merged on the device
    d2h: Transfer = field(default_factory=Transfer)  # on the critical path
    h2d: Transfer = field(default_factory=Transfer)  # on the critical path (results, prefetches)
    h2d_async: Transfer = field(default_factory=Transfer)  # off the critical path (periodic recall)


@dataclass(frozen=True)
class LayerTerms:
    """The pieces every layer model is built from at one shape (so a method's `sparse_layer_work` only says what
    it does differently from a dense layer)."""

    shape: Shape
    weight_bytes: float  # linear weights of one layer
    linear_flops: float
    linear_split: tuple[float, float, float]
    dense: LayerWork  # a dense layer: every cached token attended on the device
    query_bytes: float  # the batch's queries of one layer
    new_kv: Transfer  # the new token's K and V of one layer, one copy
    result_back: Transfer  # an fp32 partial output + LSE per query head, one copy
    merge_bytes: float  # two partial states in, one out
    predict_weight_bytes: float  # the next layer's q_proj, read once per layer (layer-ahead prediction)
    fetch_granularity: str  # how a host-to-device fetch of selected tokens crosses the bus ("gathered", "token")

    def layer(self, overlap: str, **counts: Any) -> LayerWork:
        """A layer with this shape's linear work and the given attention counters."""
        return LayerWork(overlap, self.weight_bytes, self.linear_flops, self.linear_split, **counts)


@dataclass(frozen=True)
class RunRecord:
    """What a method's `measure_work` reads from one throughput result, beside the method it ran (which it is)."""

    stats: dict[str, Any]  # the result's method_stats
    method: Any  # the method it ran, built from its method_config (`recorded_method`)
    shape: Shape  # the shape it ran at (mean context)
    steps: int  # timed decode steps

    def dense_layers(self) -> int:
        return min(dense_layers_of(self.method) or 0, self.shape.model.num_layers)

    def sparse_layer_mean(self, per_layer_stat: str) -> float | None:
        """The mean over the sparse layers of a per-layer statistic (None when it has no sparse entries)."""
        values = (self.stats.get(per_layer_stat) or [])[self.dense_layers():]
        return statistics.fmean(values) if values else None

    def attended_budget_frac(self, which: str) -> float | None:
        """`attended_tokens_per_head[which]` ("mean" or "max") as a fraction of the budget (None where the result
        lacks it or the method has no budget)."""
        attended = self.stats.get("attended_tokens_per_head") or {}
        budget = getattr(self.method, "budget", None)
        return attended[which] / budget if budget and attended.get(which) is not None else None

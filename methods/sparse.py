"""What builds on FullKV's storage for the sparse methods: `SparseLayerMethod`, the base of the methods whose
first `dense_layers` layers stay dense (FullKV rows on the device), and the budget plan that runs a method dense
when its budget covers the context (`dense_if_budget_covers`). Apart from base.py so that base.py does not import
FullKV (which is built on it): methods/ has no import circle (tests/project/test_layers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from scoutbench.methods.base import (
    AttentionMethod,
    MethodContext,
    ModelShape,
    StepInfo,
    dense_layers_of,
    require,
    sparse_layer_range,
)
from scoutbench.methods.fullkv import FullKV


class SparseLayerMethod(AttentionMethod):
    """Base of the methods with sparse layers (InfiniGen, HGCA, ScoutAttention): the first `dense_layers` layers
    keep FullKV storage on the device (`self.dense`, bound to those layers) and run dense; only
    `self.sparse_layers` reach the method's own `ingest_sparse_prefill` and `decode_sparse`.

    Each subclass declares the `dense_layers` field itself (default DEFAULT_DENSE_LAYERS), where it belongs among
    its hyper-parameters: a field declared here would come first in every `repr(method)` and config. The
    block-selection methods (Quest, methods/selection.py) keep every layer on the device: they share the field, not
    this storage."""

    # dense_layers: int, the dataclass field of each subclass (see above)

    def check_dense_layers(self) -> None:
        """Field validation (for __post_init__)."""
        require(self.dense_layers >= 0, f"dense_layers must be >= 0, got {self.dense_layers}")

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        self.sparse_layers = sparse_layer_range(self.name, self.dense_layers, ctx.num_layers)
        self.dense = FullKV.for_layers(ctx, self.sparse_layers.start)

    def ingest_prefill(self, layer: int, q_obs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       lengths: torch.Tensor) -> None:
        if layer in self.sparse_layers:
            self.ingest_sparse_prefill(layer, q_obs, k, v, lengths)
        else:
            self.dense.ingest_prefill(layer, q_obs, k, v, lengths)

    def ingest_sparse_prefill(self, layer: int, q_obs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              lengths: torch.Tensor) -> None:
        """`ingest_prefill` of a sparse layer."""
        raise NotImplementedError

    def begin_step(self, step: StepInfo) -> None:
        super().begin_step(step)
        self.dense.begin_step(step)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in self.sparse_layers:
            return self.decode_sparse(layer, q, k, v)
        return self.dense.decode(layer, q, k, v)

    def decode_sparse(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`decode` of a sparse layer."""
        raise NotImplementedError

    def layer_split(self, shape: ModelShape) -> tuple[int, int]:
        """(dense, sparse) layers of `shape` (memory planning)."""
        sparse = sparse_layer_range(self.name, self.dense_layers, shape.num_layers)
        return sparse.start, len(sparse)


@dataclass(frozen=True)
class BudgetPlan:
    """How a run uses a method's token budget . A budget that covers every token the run will
    hold attends everything: the run proceeds dense (FullKV) instead of reporting a sparse method's numbers for
    what is really dense attention, and the result says so."""

    budget: int | None  # the method's `budget` field (None: the method has none, e.g. FullKV)
    context_tokens: int  # the most tokens one sequence holds during the run (prompt + decoded)
    effective_budget: int | None  # tokens attended at most per (sequence, KV head): min(budget, context)
    sparse: bool

    def result_fields(self) -> dict[str, Any]:
        return {"budget": self.budget, "effective_budget": self.effective_budget, "sparse": self.sparse}


_WARNED: set[tuple[str, int, int]] = set()


def plan_budget(method: AttentionMethod, context_tokens: int) -> BudgetPlan:
    budget = getattr(method, "budget", None)
    if budget is None:  # FullKV (dense), or a sparse method without a token budget (HGCA's fraction policy)
        return BudgetPlan(None, context_tokens, None, dense_layers_of(method) is not None)
    return BudgetPlan(budget, context_tokens, min(budget, context_tokens), budget < context_tokens)


def dense_if_budget_covers(method: AttentionMethod, context_tokens: int) -> tuple[AttentionMethod, BudgetPlan]:
    """The method a run should decode with: `method` itself, or FullKV when its budget covers all
    `context_tokens` (with a one-line warning on stderr, once per method, budget and context). Every runner
    (throughput, sweep, accuracy, fidelity, profile-recall) goes through here, so they agree."""
    plan = plan_budget(method, context_tokens)
    if plan.budget is None or plan.sparse:
        return method, plan
    key = (method.name, plan.budget, context_tokens)
    if key not in _WARNED:
        _WARNED.add(key)
        import sys

        print(f"scoutbench: warning: {method.name} budget {plan.budget} covers the whole context "
              f"({context_tokens} tokens): running dense (FullKV); the result says sparse: false",
              file=sys.stderr)
    return FullKV(), plan

"""Work counters: what a method reads, moves and computes in one decode step, derived from a measured run.

A run's `method_stats` count what the method actually selected (ScoutAttention's CPU share of its budget and the
blocks it recalled, InfiniGen's fetched tokens, HGCA's CPU (head, token) pairs, Quest's attended tokens). These
are turned into *shape-free fractions* (`MeasuredWork`: e.g. "the CPU attends 9% of the budget"), which carry
to another model, length, batch and budget; `step_work` multiplies them out for a shape into bytes per tier, bus
bytes each way, CPU-attended tokens, recall bytes, linear-layer FLOPs and the tokens attended per (sequence, KV
head) in a sparse layer, mean and max (what `--budget` bounds) (`StepWork`).

Each method declares its own work model (methods/*.py: `work_fractions`, and `measure_work` and `sparse_layer_work` on
the method a run was configured as, which `recorded_method` builds from its config; the vocabulary is
methods/work_model.py); this module holds only the generic part (a result's shape, the dense layers and the lm_head,
the per-step totals) and knows no method by name.

Two users, one arithmetic: the projection (scoutbench/analysis/projection.py) times a `StepWork` on a hardware profile,
and the counter gate (scoutbench/analysis/counter_gate.py) compares the `StepWork` of a run at its own shape with a
baseline's: those numbers do not depend on the machine's speed, only on what the method chose to read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scoutbench.errors import UsageError
from scoutbench.methods.base import ModelShape
from scoutbench.methods.work_model import (  # noqa: F401 (the vocabulary, re-exported for projection and tests)
    FP32_BYTES,
    INDEX_BYTES,
    LayerTerms,
    LayerWork,
    RunRecord,
    Shape,
    Transfer,
)


class MeasuredWork:
    """One run's selection behaviour as fractions that do not depend on the shape it ran at: the ones its
    method declares (`work_fractions`, each defaulting to the method's value), plus the most tokens one (sequence,
    KV head, layer, step) attended as a fraction of the budget (every method's stats have it)."""

    def __init__(self, method: str, family: str, config: dict[str, Any], *,
                 attended_max_budget_frac: float | None = None, source: str = "", **fractions: float) -> None:
        self.method = method  # the name run (scout-pc, not the class's scout)
        self.family = family  # the class's name
        self.config = config
        self.method_class = method_class(method)
        declared = self.method_class.work_fractions
        unknown = sorted(set(fractions) - set(declared))
        if unknown:
            raise TypeError(f"{family}'s work model has no fraction {unknown[0]!r} (it has: "
                            f"{', '.join(declared) or 'none'})")
        self.fractions: dict[str, float] = {**declared, **fractions}
        self.attended_max_budget_frac = attended_max_budget_frac
        self.source = source  # the result file

    def __getattr__(self, name: str) -> float:
        fractions = self.__dict__.get("fractions", {})
        if name in fractions:
            return fractions[name]
        raise AttributeError(name)

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "family": self.family, "config": self.config, **self.fractions,
                "attended_max_budget_frac": self.attended_max_budget_frac, "source": self.source}

    def replace(self, **fractions: float) -> MeasuredWork:
        return MeasuredWork(self.method, self.family, self.config, attended_max_budget_frac=self.attended_max_budget_frac,
                            source=self.source, **{**self.fractions, **fractions})

    def method_at(self, budget: int | None = None, block_size: int | None = None) -> Any:
        """The method the run was configured as (`recorded_method`: built, not bound), with `budget` / `block_size`
        replaced where given: what its work is counted with at a target, and planned with (`--batch auto`)."""
        from scoutbench.methods import recorded_method

        return recorded_method(self.method, self.config, budget, block_size)


@dataclass(frozen=True)
class StepWork:
    """A whole decode step: `dense` layers (kept dense on the device) and `sparse` layers of the method."""

    dense: LayerWork
    sparse: LayerWork
    num_dense: int
    num_sparse: int
    head_weight_bytes: float  # lm_head (and the embedding row gather, negligible)
    head_flops: float
    rows: int  # (sequence, KV head) pairs of one layer, over which device_tokens and cpu_tokens count
    attended_max: float  # the most tokens one (sequence, KV head) attends in a sparse layer (dense: the context)

    def totals(self) -> dict[str, float]:
        """Per-step counters (the counter gate's metrics; all lower-is-better)."""
        def total(name: str) -> float:
            return self.num_dense * _get(self.dense, name) + self.num_sparse * _get(self.sparse, name)

        layer = self.sparse if self.num_sparse else self.dense
        return {
            # what --budget bounds: tokens per (sequence, KV head) in a sparse layer, both tiers
            "attended_tokens_per_head_mean": (layer.device_tokens + layer.cpu_tokens) / self.rows,
            "attended_tokens_per_head_max": self.attended_max,
            "device_kv_bytes_per_step": total("device_kv_bytes"),
            "select_bytes_per_step": total("select_bytes"),
            "host_kv_bytes_per_step": total("host_kv_bytes"),
            "cpu_attended_tokens_per_step": total("cpu_tokens"),
            "device_attended_tokens_per_step": total("device_tokens"),
            "h2d_bytes_per_step": total("h2d.bytes") + total("h2d_async.bytes"),
            "d2h_bytes_per_step": total("d2h.bytes"),
            "recall_bytes_per_step": total("h2d_async.bytes"),
            "linear_flops_per_step": total("linear_flops") + self.head_flops,
            "weight_bytes_per_step": total("weight_bytes") + total("predict_weight_bytes") + self.head_weight_bytes,
        }



def _get(layer: LayerWork, dotted: str) -> float:
    value: Any = layer
    for part in dotted.split("."):
        value = getattr(value, part)
    return float(value)


# ---- from a result --------------------------------------------------------------------------------------------

def method_class(method: str) -> Any:
    """The class that declares `method`'s work model (any registered name: the registry is the only list)."""
    from scoutbench.methods import METHODS

    return METHODS.load(method)  # an unknown name: a usage error with a did-you-mean


def method_family(method: str) -> str:
    """The algorithm behind a registered name (scout-pc -> scout: the class's own name)."""
    return method_class(method).name


def result_shape(result: dict[str, Any]) -> Shape:
    """The shape a throughput result ran at (its mean context: prompt + warm-up + half the timed steps)."""
    model, workload = result.get("model") or {}, result.get("workload") or {}
    sizes = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size", "vocab_size")
    counts = {name: model.get(name) for name in sizes} | {name: workload.get(name) for name in ("len", "batch")}
    counts |= {name: workload.get(name, 0) for name in ("warmup", "steps")}
    bad = [name for name, value in counts.items() if not isinstance(value, int) or isinstance(value, bool)
           or value < (0 if name in ("warmup", "steps") else 1)]
    if bad:
        raise UsageError(f"{result.get('_path', 'a result')}: its model or workload field {bad[0]!r} is missing or "
                         "not a positive integer: is it a scoutbench throughput result?")
    shape = ModelShape(*(counts[name] for name in sizes))
    context = counts["len"] + counts["warmup"] + counts["steps"] // 2
    batch = counts["batch"]
    from scoutbench.models import parse_dtype

    tied = model.get("name") in _tied_presets()
    return Shape(shape, context, batch, parse_dtype(str(model.get("dtype", "float32"))).itemsize, tied)


def work_problem(result: dict[str, Any]) -> str | None:
    """Why a throughput result's work counters cannot be derived (a field missing or of the wrong type in its
    shape, config or method stats), or None: the projection skips such a result and the counter gate refuses it,
    instead of failing on it with a traceback."""
    try:
        step_work(measured_work(result), result_shape(result)).totals()
    except UsageError as exc:
        return str(exc)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError, IndexError) as exc:
        return f"its work counters cannot be derived ({type(exc).__name__}: {exc})"
    return None


def _tied_presets() -> set[str]:
    from scoutbench.models import PRESETS

    return {name for name, (_, fields) in PRESETS.items() if fields.get("tie_word_embeddings")}


def measured_work(result: dict[str, Any]) -> MeasuredWork:
    """The shape-free fractions of one ok throughput result (see MeasuredWork), measured by its method's
    `measure_work`."""
    from scoutbench.methods import recorded_method

    name = str(result.get("method"))
    config = dict(result.get("method_config") or {})
    method = recorded_method(name, config)
    run = RunRecord(result.get("method_stats") or {}, method, result_shape(result),
                    (result.get("workload") or {}).get("steps"))
    # the tokens attended per (sequence, KV head) in a sparse layer, as fractions of the budget (older results, written
    # before methods counted attended tokens, lack them: the work model then assumes the budget)
    return MeasuredWork(name, method.name, config, attended_max_budget_frac=run.attended_budget_frac("max"),
                        source=str(result.get("_path", "")), **method.measure_work(run))


# ---- to bytes for a shape ---------------------------------------------------------------------------------------

def linear_weight_bytes(shape: Shape) -> float:
    """q/k/v/o projections and the gated MLP of one layer (planning's count, which sizes the weights)."""
    from scoutbench.planning import layer_linear_params

    return sum(layer_linear_params(shape.model)) * shape.elem_bytes


def linear_split(m: ModelShape) -> tuple[float, float, float]:
    qkv = m.hidden_size * m.head_dim * (m.num_heads + 2 * m.num_kv_heads)
    o = m.hidden_size * m.head_dim * m.num_heads
    mlp = 3 * m.hidden_size * m.intermediate_size
    total = qkv + o + mlp
    return qkv / total, o / total, mlp / total


FETCH_GRANULARITIES = ("gathered", "token")


def step_work(work: MeasuredWork, shape: Shape, budget: int | None = None, block_size: int | None = None,
              fetch_granularity: str = "gathered") -> StepWork:
    """Bytes, copies, tokens and FLOPs of one decode step of `work`'s method at `shape`.

    `budget`/`block_size` replace the run's (the measured fractions are relative to the budget, so they carry).
    `fetch_granularity`: how a fetch of selected tokens crosses the bus (`gathered`: staged on the host, one copy
    of K and one of V; `token`: one copy per token; InfiniGen.sparse_layer_work). The method, as the run was
    configured and re-budgeted (`MeasuredWork.method_at`), says what its sparse layers do (`sparse_layer_work`) and
    how many layers run dense; this function adds the shape's dense layers and lm_head.
    """
    if fetch_granularity not in FETCH_GRANULARITIES:
        raise UsageError(f"bad fetch granularity {fetch_granularity!r}: use {' or '.join(FETCH_GRANULARITIES)}")
    m, B, N, e = shape.model, shape.batch, shape.context_len, shape.elem_bytes
    kv = shape.kv_bytes_per_token
    method = work.method_at(budget, block_size)
    weights = linear_weight_bytes(shape)
    flops = 2.0 * B * weights / e
    split = linear_split(shape.model)
    dense_layer = LayerWork("none", weights, flops, split, device_kv_bytes=B * N * kv, device_tokens=B * m.num_kv_heads * N)
    terms = LayerTerms(
        shape, weights, flops, split, dense_layer,
        query_bytes=B * m.num_heads * m.head_dim * e,
        new_kv=Transfer(B * kv, 1),
        result_back=Transfer(B * m.num_heads * (m.head_dim + 1) * FP32_BYTES, 1),  # fp32 partial output + LSE
        merge_bytes=3 * B * m.num_heads * (m.head_dim + 1) * FP32_BYTES,  # two partial states in, one out
        predict_weight_bytes=m.hidden_size * m.num_heads * m.head_dim * e,  # next layer's q_proj, once per layer
        fetch_granularity=fetch_granularity)
    num_dense = method.work_dense_layers(m.num_layers)
    sparse = method.sparse_layer_work(work.fractions, terms)
    rows = B * m.num_kv_heads
    target_budget = getattr(method, "budget", None)
    if num_dense == m.num_layers:
        attended_max = float(N)
    elif target_budget is not None:  # measured, as a fraction of the budget; else the bound itself
        frac = 1.0 if work.attended_max_budget_frac is None else work.attended_max_budget_frac
        attended_max = min(frac * target_budget, N)
    else:  # HGCA's fraction policy has no budget: its mean selection
        attended_max = (sparse.device_tokens + sparse.cpu_tokens) / rows
    head_bytes = m.vocab_size * m.hidden_size * e
    return StepWork(dense_layer, sparse, num_dense, m.num_layers - num_dense, head_bytes, 2.0 * B * head_bytes / e,
                    rows, attended_max)

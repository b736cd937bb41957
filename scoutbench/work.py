"""Work counters: what a method reads, moves and computes in one decode step, derived from a measured run.

A run's `method_stats` count what the method actually selected (ScoutAttention's CPU share of its budget and the
blocks it recalled, InfiniGen's fetched tokens, HGCA's CPU (head, token) pairs, Quest's attended tokens). These
are turned into *shape-free fractions* (`MeasuredWork`: e.g. "the CPU attends 9% of the budget"), which carry
to another model, length, batch and budget; `step_work` multiplies them out for a shape into bytes per tier, bus
bytes each way, CPU-attended tokens, recall bytes, linear-layer FLOPs and the tokens attended per (sequence, KV
head) in a sparse layer, mean and max (what `--budget` bounds) (`StepWork`).

Two users, one arithmetic: the projection (scoutbench/projection.py) times a `StepWork` on a hardware profile,
and the counter gate (scoutbench/counter_gate.py) compares the `StepWork` of a run at its own shape with a
baseline's: those numbers do not depend on the machine's speed, only on what the method chose to read.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from scoutbench.errors import UsageError
from scoutbench.methods.base import ModelShape

FP32_BYTES = 4
INDEX_BYTES = 8  # int64 block / token ids
FAMILIES = ("fullkv", "quest", "infinigen", "hgca", "scout")


@dataclass(frozen=True)
class MeasuredWork:
    """One run's selection behaviour as fractions that do not depend on the shape it ran at."""

    method: str  # the name run (scout-pc, not the class's scout)
    family: str  # one of FAMILIES
    config: dict[str, Any]
    cpu_budget_frac: float = 0.0  # scout: share of the budget attended on the CPU
    recall_budget_frac: float = 0.0  # scout: tokens recalled per (sequence, KV head, sparse layer, step) / budget
    fetch_context_frac: float = 0.0  # infinigen: tokens fetched per (sequence, KV head, sparse layer) / context
    cpu_host_frac: float = 0.0  # hgca: tokens the CPU attends per (sequence, query head) / host tokens
    attended_budget_frac: float = 1.0  # quest, scout: tokens attended per (sequence, KV head, sparse layer) / budget
    attended_max_budget_frac: float | None = None  # the most tokens one (sequence, KV head, layer, step) attended / budget
    source: str = ""  # the result file

    def describe(self) -> dict[str, Any]:
        return asdict(self)


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
    device_tokens: float = 0.0  # (sequence, KV head, token) triples attended on the device
    host_kv_bytes: float = 0.0  # KV (and score state) read by CPU attention
    cpu_tokens: float = 0.0  # (sequence, KV head, token) triples attended on the CPU
    host_gather_bytes: float = 0.0  # gathered on the host into a staging buffer before a bulk copy
    merge_bytes: float = 0.0  # partial states merged on the device
    d2h: Transfer = field(default_factory=Transfer)  # on the critical path
    h2d: Transfer = field(default_factory=Transfer)  # on the critical path (results, prefetches)
    h2d_async: Transfer = field(default_factory=Transfer)  # off the critical path (periodic recall)


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
            # what --budget bounds: tokens per (sequence, KV head) in a sparse layer, both tiers (issue 18)
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

def method_family(method: str) -> str:
    """The algorithm behind a registered name (scout-pc -> scout: the class's own name)."""
    from scoutbench.methods import METHODS

    family = METHODS.load(method).name
    if family not in FAMILIES:
        raise UsageError(f"no work model for method {method!r}: the projection knows {', '.join(FAMILIES)}")
    return family


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
    """The shape-free fractions of one ok throughput result (see MeasuredWork)."""
    method = str(result.get("method"))
    family = method_family(method)
    config = dict(result.get("method_config") or {})
    stats = result.get("method_stats") or {}
    shape = result_shape(result)
    source = str(result.get("_path", ""))
    m = shape.model
    # the tokens attended per (sequence, KV head) in a sparse layer, as fractions of the budget (results written
    # before issue 18 lack them: the work model then assumes the budget)
    attended = stats.get("attended_tokens_per_head") or {}
    budget = config.get("budget")
    mean_frac = attended["mean"] / budget if budget and attended.get("mean") is not None else None
    max_frac = attended["max"] / budget if budget and attended.get("max") is not None else None
    if family == "scout":
        ratio = (stats.get("cpu_compute_ratio") or {}).get("mean") or 0.0
        recall = stats.get("recall") or {}
        steps = stats.get("steps") or (result.get("workload") or {}).get("steps") or 1
        sparse = max(m.num_layers - min(config.get("dense_layers", 0), m.num_layers), 1)
        rows = steps * shape.batch * m.num_kv_heads * sparse
        recalled_tokens = (recall.get("blocks") or 0) * config.get("block_size", 1) / rows
        return MeasuredWork(method, family, config, cpu_budget_frac=float(ratio),
                            recall_budget_frac=recalled_tokens / config["budget"],
                            attended_budget_frac=1.0 if mean_frac is None else mean_frac,
                            attended_max_budget_frac=max_frac, source=source)
    if family == "infinigen":
        dense = min(config.get("dense_layers", 0), m.num_layers)
        fetched = [n for n in (stats.get("tokens_fetched_per_layer") or [])[dense:]]
        mean_fetched = statistics.fmean(fetched) if fetched else 0.0
        return MeasuredWork(method, family, config, fetch_context_frac=mean_fetched / shape.context_len,
                            attended_max_budget_frac=max_frac, source=source)
    if family == "hgca":
        dense = min(config.get("dense_layers", 0), m.num_layers)
        pairs = (stats.get("cpu_tokens_per_layer") or [])[dense:]
        host_tokens = stats.get("host_tokens_mean") or 0.0
        per_head = statistics.fmean(pairs) / (shape.batch * m.num_heads) if pairs else 0.0
        return MeasuredWork(method, family, config, cpu_host_frac=per_head / host_tokens if host_tokens else 0.0,
                            attended_max_budget_frac=max_frac, source=source)
    if family == "quest":
        dense = min(config.get("dense_layers", 0), m.num_layers)
        attended = (stats.get("attended_tokens_per_layer") or [])[dense:]
        per_layer = (stats.get("attended_tokens_per_layer") or [])[dense:]
        frac = statistics.fmean(per_layer) / config["budget"] if per_layer else 1.0
        return MeasuredWork(method, family, config, attended_budget_frac=frac, attended_max_budget_frac=max_frac,
                            source=source)
    return MeasuredWork(method, family, config, source=source)


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
    `fetch_granularity`: how InfiniGen's fetch crosses the bus. `gathered` (scoutbench's implementation, like its
    recall): the host gathers the selected tokens into a staging buffer, then K and V go in one copy each;
    `token`: one copy per token (all KV heads), as the ScoutAttention paper describes its InfiniGen baseline
    (section 2.3: "4 KB per token per layer ... 800 MB/s").
    """
    if fetch_granularity not in FETCH_GRANULARITIES:
        raise UsageError(f"bad fetch granularity {fetch_granularity!r}: use {' or '.join(FETCH_GRANULARITIES)}")
    m, B, N, e = shape.model, shape.batch, shape.context_len, shape.elem_bytes
    kv = shape.kv_bytes_per_token
    cfg = dict(work.config)
    if budget is not None and cfg.get("budget") is not None:  # HGCA's budget=None (fraction policy) stays
        cfg["budget"] = budget
    if block_size is not None and "block_size" in cfg:
        cfg["block_size"] = block_size
    weights = linear_weight_bytes(shape)
    flops = 2.0 * B * weights / e
    split = linear_split(shape.model)
    dense_layer = LayerWork("none", weights, flops, split, device_kv_bytes=B * N * kv, device_tokens=B * m.num_kv_heads * N)
    num_dense = min(int(cfg.get("dense_layers", 0)), m.num_layers) if work.family != "fullkv" else m.num_layers
    q_bytes = B * m.num_heads * m.head_dim * e
    new_kv = Transfer(B * kv, 1)
    result_back = Transfer(B * m.num_heads * (m.head_dim + 1) * FP32_BYTES, 1)  # fp32 partial output + LSE
    merge = 3 * B * m.num_heads * (m.head_dim + 1) * FP32_BYTES  # two partial states in, one out
    predict = m.hidden_size * m.num_heads * m.head_dim * e  # next layer's q_proj, read once per layer
    if work.family == "fullkv":
        sparse = dense_layer
    elif work.family == "quest":
        tokens = min(work.attended_budget_frac * cfg["budget"], N)
        digests = B * m.num_kv_heads * math.ceil(N / cfg["block_size"]) * 2 * m.head_dim * e
        sparse = LayerWork("none", weights, flops, split, select_bytes=digests, device_kv_bytes=B * tokens * kv,
                           device_tokens=B * m.num_kv_heads * tokens)
    elif work.family == "scout":
        T, bs = min(cfg["budget"], N), cfg["block_size"]
        cpu_tokens = work.cpu_budget_frac * T
        attended = min(work.attended_budget_frac * cfg["budget"], N)  # both tiers
        digests = B * m.num_kv_heads * math.ceil(N / bs) * 2 * m.head_dim * e
        indices = Transfer(B * m.num_kv_heads * math.ceil(cpu_tokens / bs) * INDEX_BYTES, 0)  # rides with q
        recalled = work.recall_budget_frac * cfg["budget"] if cfg.get("pr", True) else 0.0
        recall_bytes = B * recalled * kv
        sparse = LayerWork(
            "layer_ahead" if cfg.get("pc", True) else "same_layer", weights, flops, split,
            predict_weight_bytes=predict if cfg.get("pc", True) else 0.0, select_bytes=digests,
            device_kv_bytes=B * (attended - cpu_tokens) * kv, device_tokens=B * m.num_kv_heads * (attended - cpu_tokens),
            host_kv_bytes=B * cpu_tokens * kv, cpu_tokens=B * m.num_kv_heads * cpu_tokens, merge_bytes=merge,
            d2h=Transfer(q_bytes, 1) + indices + new_kv, h2d=result_back,
            host_gather_bytes=recall_bytes, h2d_async=Transfer(recall_bytes, 2 if recall_bytes else 0))
    elif work.family == "infinigen":
        cap = cfg["budget"] - 1  # n = budget - 1 fetched, the alpha count only with dynamic_count
        fetched = min(work.fetch_context_frac * N, cap, N) if cfg.get("dynamic_count") else min(cap, N)
        partial_dim = max(1, round(cfg.get("partial_ratio", 0.2) * m.head_dim))
        speculation = B * N * m.num_kv_heads * partial_dim * e
        fetch_bytes = B * fetched * kv
        gathered = fetch_granularity == "gathered"
        sparse = LayerWork("prefetch", weights, flops, split, predict_weight_bytes=predict, select_bytes=speculation,
                           device_kv_bytes=fetch_bytes, device_tokens=B * m.num_kv_heads * (fetched + 1),  # + current
                           host_gather_bytes=fetch_bytes if gathered else 0.0, d2h=new_kv,
                           h2d=Transfer(fetch_bytes, (2 if fetched else 0) if gathered else B * fetched))
    elif work.family == "hgca":
        if cfg.get("budget") is not None:  # issue 11: window + CPU tokens = budget, one selection per KV head
            # the window grows a migration block past its target and drops back: half a block over it on average
            window = min(round(cfg["budget"] * cfg.get("window_share", 0.5)) + cfg.get("migrate_block", 32) / 2, N)
            host = N - window
            cpu_per_head = min(cfg["budget"] - window, host)
            selection_heads = m.num_kv_heads
        else:  # fraction policy (budget=None): each query head selects its own
            window = min(math.ceil(cfg.get("window_frac", 0.25) * N), N)
            host = N - window
            cpu_per_head = min(work.cpu_host_frac * host, host)
            selection_heads = m.num_heads
        # K and V of the selected tokens per selection row, and the fp32 score average of every query head
        host_bytes = B * selection_heads * cpu_per_head * 2 * m.head_dim * e + B * m.num_heads * host * FP32_BYTES
        sparse = LayerWork("same_layer", weights, flops, split, device_kv_bytes=B * window * kv,
                           device_tokens=B * m.num_kv_heads * window, host_kv_bytes=host_bytes,
                           cpu_tokens=B * m.num_heads * cpu_per_head / (m.num_heads // m.num_kv_heads),
                           merge_bytes=merge, d2h=Transfer(q_bytes, 1) + new_kv, h2d=result_back)
    else:  # pragma: no cover - method_family only returns FAMILIES
        raise UsageError(f"no work model for {work.family}")
    rows = B * m.num_kv_heads
    if num_dense == m.num_layers:
        attended_max = float(N)
    elif cfg.get("budget") is not None:  # measured, as a fraction of the budget; else the bound itself
        frac = 1.0 if work.attended_max_budget_frac is None else work.attended_max_budget_frac
        attended_max = min(frac * cfg["budget"], N)
    else:  # HGCA's fraction policy has no budget: its mean selection
        attended_max = (sparse.device_tokens + sparse.cpu_tokens) / rows
    head_bytes = m.vocab_size * m.hidden_size * e
    return StepWork(dense_layer, sparse, num_dense, m.num_layers - num_dense, head_bytes, 2.0 * B * head_bytes / e,
                    rows, attended_max)

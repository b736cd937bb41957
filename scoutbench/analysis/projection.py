"""Paper-scale projection: a per-layer timeline of each method's decode step on hardware you do not have.

Inputs: the work a method did in a real run (scoutbench/analysis/work.py turns its counters into shape-free fractions and
multiplies them out for the target model, length, batch and budget) and a hardware profile (device memory,
bandwidth and peak FLOPs, bus bandwidth and per-copy latency, host CPU attention rate; every number with its
source, scoutbench/data/hardware/*.json, or a file from `scoutbench calibrate`; read by analysis/hardware.py).

The timeline, per layer (docs/projection.md has the derivation):

    device work   linear layers   max(weight bytes / memory bw, FLOPs / peak)      (roofline)
                  selection       digests (Quest, Scout) or speculation keys (InfiniGen)
                                  / (memory bw x efficiency.digest_topk)
                  attention       device KV bytes / (memory bw x the efficiency of its kernel: dense_attention for
                                  contiguous KV, block_sparse_16 / block_sparse_32 for selected pages)
                  hand-off        efficiency.layer_handoff_s in every layer with a host part
    host work     CPU attention   host KV bytes / host attention bw
    bus           a copy of n bytes takes overhead + n / bus bw; copies in one direction are serial

    what the device waits for (idle):
      none         FullKV, Quest
      same_layer   HGCA, Scout without PC: max(0, D2H + CPU + H2D - device attention of the same layer)
      layer_ahead  Scout with PC: the CPU part of layer i+1 runs during layer i:
                   max(0, D2H + CPU + H2D - (device time of a layer after the prediction))
      prefetch     InfiniGen: layer i+1's tokens are copied during layer i:
                   max(0, H2D fetch - (device time of a layer after the speculation))
    per step      the CPU and the bus are each one serial resource: a step is at least the CPU time and the bus
                  time (recall copies included) of all its layers.

    host issue    the host's launches: each torch call the main thread issues costs `host.launch_s`, each CUDA graph
                  replay `host.graph_replay_s`; a method's launches per layer, with graphs on (the default, as
                  SGLang decodes) or off (`--cuda-graphs off`), come from scoutbench/data/launch_counts.json
                  (counted on emulated CUDA: benchmarks/launch_counts.py). The device runs behind the host, so a step
                  takes max(device time, host issue time); a step whose host issue time is at least 90% of it is
                  launch-bound (the row measures Python and launches, not the method).
It is a model: it ignores cache effects and on a GPU the few-percent cost of the merge. On a CPU-only profile (`calibrate` here) "device" and "host" are the same
cores: the CPU part then also slows the device part while it runs (`host.shares_device`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scoutbench.analysis.hardware import Hardware
from scoutbench.analysis.work import (
    LayerWork,
    MeasuredWork,
    Shape,
    StepWork,
    measured_work,
    step_work,
)
from scoutbench.errors import UsageError

STAGES = ("qkv_proj", "predict", "attn_device", "idle", "merge", "o_proj", "mlp", "other")
LAUNCH_COUNTS = Path(__file__).resolve().parents[1] / "data" / "launch_counts.json"
LAUNCH_BOUND_FRAC = 0.9  # as a measured run's `launch_bound` (scoutbench/timing.py)


# ---- the timeline ------------------------------------------------------------------------------------------------

@dataclass
class LayerTime:
    """Seconds of one layer: device stages, and the CPU and bus time it needs."""

    stages: dict[str, float]
    cpu_s: float = 0.0
    bus_h2d_s: float = 0.0
    bus_d2h_s: float = 0.0
    waits_on: str | None = None  # what the device's idle in this layer waits for: cpu or bus


def layer_time(layer: LayerWork, hw: Hardware) -> LayerTime:
    """Device stages of one layer, then the idle its overlap pattern leaves (see the module docstring)."""
    mem_bw, peak = hw.values["device.memory_bw_bytes_s"], hw.values["device.peak_flops"]
    linear_s = max(layer.weight_bytes / mem_bw, layer.linear_flops / peak)
    # split the linear time as the weights are split: q/k/v, o and the MLP (fractions from the weight counts)
    stages = {s: 0.0 for s in STAGES}
    qkv, o, mlp = layer.linear_split
    stages["qkv_proj"], stages["o_proj"], stages["mlp"] = linear_s * qkv, linear_s * o, linear_s * mlp
    # selection (digests or speculation keys, and the top-k) is timed at its own kernel's efficiency: inside the
    # prediction for the methods with a host part, inside device attention for the rest
    select_s = layer.select_bytes / hw.select_bytes_s
    stages["predict"] = layer.predict_weight_bytes / mem_bw + (select_s if layer.overlap != "none" else 0.0)
    stages["attn_device"] = layer.device_kv_bytes / hw.attention_bytes_s(layer.device_page_tokens) + \
        (select_s if layer.overlap == "none" else 0.0)
    stages["merge"] = layer.merge_bytes / mem_bw
    if layer.overlap != "none":  # the device and the host meet once in this layer
        stages["other"] = hw.layer_handoff_s
    attend_s = layer.host_kv_bytes / hw.values["host.attention_bytes_s"]
    gather_s = layer.host_gather_bytes / hw.values["host.memory_bw_bytes_s"]
    task_s = hw.get("host.task_overhead_s", 0.0) if layer.host_kv_bytes or layer.host_gather_bytes else 0.0
    # on the critical path: CPU attention, and the gather of a prefetch (a recall's gather is asynchronous)
    critical_cpu_s = attend_s + task_s + (gather_s if layer.overlap == "prefetch" else 0.0)
    d2h_s, h2d_s = hw.transfer_s(layer.d2h), hw.transfer_s(layer.h2d)
    device_s = sum(stages.values())
    if hw.shares_device and critical_cpu_s:
        # one CPU: while the host part runs it takes its cores from the device part
        host_cores = hw.get("host.cores")
        device_s_share = critical_cpu_s * min(1.0, host_cores / hw.get("device.cores", 2 * host_cores))
        stages["attn_device"] += device_s_share
        device_s += device_s_share
    if layer.overlap == "same_layer":
        idle = max(0.0, d2h_s + critical_cpu_s + h2d_s - stages["attn_device"])
    elif layer.overlap == "layer_ahead":
        idle = max(0.0, d2h_s + critical_cpu_s + h2d_s - (device_s - stages["predict"]))
    elif layer.overlap == "prefetch":  # the host gathers the tokens, then they cross the bus
        idle = max(0.0, critical_cpu_s + h2d_s - (device_s - stages["predict"]))
    else:
        idle = 0.0
    stages["idle"] = idle
    waits_on = None if idle == 0 else ("cpu" if critical_cpu_s >= d2h_s + h2d_s else "bus")
    return LayerTime(stages, attend_s + gather_s + task_s, h2d_s + hw.transfer_s(layer.h2d_async), d2h_s, waits_on)


@dataclass
class StepProjection:
    method: str
    stages_ms: dict[str, float]
    step_ms: float
    batch: int
    cpu_ms: float
    bus_h2d_ms: float
    bus_d2h_ms: float
    bound_by: str  # device (never waits), or what the device waits for most: cpu | bus | launches
    host_issue_ms: float | None = None  # the host's launches of one step (None: no launch count for the method)

    @property
    def throughput_tok_s(self) -> float:
        return self.batch / (self.step_ms / 1e3) if self.step_ms > 0 else 0.0

    @property
    def idle_frac(self) -> float:
        return self.stages_ms["idle"] / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def launch_bound(self) -> bool | None:
        return None if self.host_issue_ms is None else self.host_issue_ms >= LAUNCH_BOUND_FRAC * self.step_ms


def launch_counts(method: str, cuda_graphs: bool) -> dict[str, float] | None:
    """The committed launch count of `method` (its registered name) with graphs on or off, or None."""
    try:
        table = json.loads(LAUNCH_COUNTS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    counts = (table.get("graphs_on" if cuda_graphs else "graphs_off") or {}).get(method)
    return None if counts is None else {**counts, "layers": table["layers"]}


def host_issue_s(counts: dict[str, float], num_layers: int, hw: Hardware) -> float | None:
    """Seconds of host issue of one step of `num_layers` layers from a method's launch counts, or None where the
    profile has no launch costs. The counts are per layer of the model they were taken on."""
    if "host.launch_s" not in hw.values:
        return None
    per_step = counts["torch_calls_per_step"] * hw.values["host.launch_s"] + \
        (counts.get("graph_replays_per_step") or 0.0) * hw.get("host.graph_replay_s", hw.values["host.launch_s"])
    return per_step / counts["layers"] * num_layers


def project_step(work: StepWork, hw: Hardware, batch: int, method: str = "",
                 launches: dict[str, float] | None = None) -> StepProjection:
    """Sum the layers; then the step is at least the CPU's and the bus's serial time (the excess is idle)."""
    dense, sparse = layer_time(work.dense, hw), layer_time(work.sparse, hw)
    stages = {s: work.num_dense * dense.stages[s] + work.num_sparse * sparse.stages[s] for s in STAGES}
    mem_bw, peak = hw.values["device.memory_bw_bytes_s"], hw.values["device.peak_flops"]
    stages["other"] += max(work.head_weight_bytes / mem_bw, work.head_flops / peak)
    stages["other"] += hw.get("device.layer_overhead_s", 0.0) * (work.num_dense + work.num_sparse)
    cpu_s = work.num_dense * dense.cpu_s + work.num_sparse * sparse.cpu_s
    h2d_s = work.num_dense * dense.bus_h2d_s + work.num_sparse * sparse.bus_h2d_s
    d2h_s = work.num_dense * dense.bus_d2h_s + work.num_sparse * sparse.bus_d2h_s
    step_s = sum(stages.values())
    bound_by = sparse.waits_on or dense.waits_on or "device"
    issue_s = None if launches is None else host_issue_s(launches, work.num_dense + work.num_sparse, hw)
    for name, serial_s in (("cpu", cpu_s), ("bus", h2d_s), ("bus", d2h_s), ("launches", issue_s or 0.0)):
        if serial_s > step_s:
            stages["idle"] += serial_s - step_s
            step_s, bound_by = serial_s, name
    return StepProjection(method, {k: v * 1e3 for k, v in stages.items()}, step_s * 1e3, batch, cpu_s * 1e3,
                          h2d_s * 1e3, d2h_s * 1e3, bound_by, None if issue_s is None else issue_s * 1e3)


# ---- from results to a projection table -----------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """What to project to; None keeps each result's own value."""

    model: str | None = None
    length: int | None = None
    batch: int | str | None = None  # "auto": each method's largest batch on the profile (scoutbench/planning.py)
    budget: int | None = None
    block_size: int | None = None
    dtype: str | None = None
    fetch_granularity: str = "gathered"  # InfiniGen's copies: gathered (this tool) or token (the paper's baseline)
    cuda_graphs: bool = True  # the host issue of a step replayed from CUDA graphs (False: eager launches)
    dense_layers: int | None = None  # layers every sparse method keeps dense (None: each result's own)
    decode_instance: bool = False  # plan memory without the prefill transient (prefill-decode disaggregation)


@dataclass
class Projection:
    method: str
    method_config: dict[str, Any]
    model: str
    length: int  # the mean context the step is projected at (prompt + warm-up + half the timed steps, or --len)
    batch: int
    batch_limited_by: str | None
    step: StepProjection
    work: dict[str, float]
    measured: MeasuredWork
    sources: list[str] = field(default_factory=list)
    measured_step_ms: float | None = None  # the run's own median step, when projected at its own shape
    prompt_len: int = 0  # the prompt length the row stands for: the measured run's --len, or the target --len
    source: str = ""  # the measured point it was projected from (points.PointKey.describe, with what varies)
    max_batch: int = 0  # the largest batch the profile's memory holds (planning); above it the step cannot run
    run_budget: int | None = None  # the budget the measured run used (None: the method has none)
    budget: int | None = None  # the budget the row is projected at

    @property
    def fits_memory(self) -> bool:
        return self.batch <= self.max_batch

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "method_config": self.method_config, "model": self.model,
                "len": self.prompt_len or self.length, "context_len": self.length, "source_point": self.source,
                "batch": self.batch, "batch_limited_by": self.batch_limited_by, "max_batch": self.max_batch,
                "fits_memory": self.fits_memory, "run_budget": self.run_budget, "budget": self.budget,
                "decode_throughput_tok_s": self.step.throughput_tok_s, "decode_step_ms": self.step.step_ms,
                "latency_breakdown_ms": self.step.stages_ms, "gpu_idle_frac": self.step.idle_frac,
                "cpu_ms_per_step": self.step.cpu_ms, "bus_h2d_ms_per_step": self.step.bus_h2d_ms,
                "bus_d2h_ms_per_step": self.step.bus_d2h_ms, "bound_by": self.step.bound_by,
                "host_issue_ms": self.step.host_issue_ms, "launch_bound": self.step.launch_bound,
                "work_per_step": self.work, "measured_work": self.measured.describe(), "sources": self.sources,
                "measured_step_ms": self.measured_step_ms}


def target_shape(result: dict[str, Any], target: Target) -> tuple[Shape, str]:
    """The shape to project one result to (batch 1 stands in for `auto` until planned) and the model's name."""
    from scoutbench.analysis.work import result_shape
    from scoutbench.models import model_config, parse_dtype

    own = result_shape(result)
    model_name = target.model or str((result.get("model") or {}).get("name"))
    if target.model is not None:
        from scoutbench.methods.base import ModelShape

        config = model_config(target.model)  # a preset, a built-in, a folder or a hub id: its config alone
        model, tied = ModelShape.from_config(config), bool(config.tie_word_embeddings)
    else:
        model, tied = own.model, own.tied_embeddings
    elem = parse_dtype(target.dtype).itemsize if target.dtype else own.elem_bytes
    length = target.length or own.context_len
    batch = target.batch if target.batch is not None else own.batch
    return Shape(model, length, batch if isinstance(batch, int) else 1, elem, tied), model_name


def max_batch(work: MeasuredWork, target: Target, shape: Shape, hw: Hardware) -> tuple[int, str]:
    """The method's largest batch at `shape` on `hw` and what limits it, planned (`planning.plan_method`, as a
    decode instance where the target says so) as its work is projected (`MeasuredWork.method_at`: the target's
    budget and block size, and what an older result's config lacks)."""
    from scoutbench.planning import plan_method

    built = work.method_at(target.budget, target.block_size)
    plan = plan_method(built, shape.model, shape.context_len, shape.elem_bytes, int(hw.values["device.memory_bytes"]),
                       int(hw.values["host.memory_bytes"]), shape.tied_embeddings, target.decode_instance)
    return plan.max_batch, plan.limited_by


def with_dense_layers(work: MeasuredWork, dense_layers: int | None) -> MeasuredWork:
    """`work` with the target's dense layers where its method keeps some (its fractions are per sparse layer, so
    they carry); unchanged for None or a method without the field."""
    from scoutbench.methods.declarations import DENSE_LAYERS_FIELD

    if dense_layers is None or DENSE_LAYERS_FIELD not in work.config:
        return work
    return MeasuredWork(work.method, work.family, {**work.config, DENSE_LAYERS_FIELD: dense_layers},
                        attended_max_budget_frac=work.attended_max_budget_frac, source=work.source, **work.fractions)


def project_work(work: MeasuredWork, shape: Shape, hw: Hardware, target: Target) -> tuple[StepProjection, StepWork,
                                                                                          int, str]:
    """One method's step from its measured (or stated) fractions at `shape` (batch `auto`: its largest that fits),
    and the largest batch the profile holds and what limits it: the projection of one point, which
    `project_results` applies to each measured point and benchmarks/projection_validation.py to the paper's own
    counters."""
    work = with_dense_layers(work, target.dense_layers)
    fits, memory = max_batch(work, target, shape, hw)
    if fits < 1:
        raise UsageError(f"{work.method}: not one sequence of {shape.context_len} tokens fits on {hw.name} "
                         f"({memory} memory)")
    if target.batch == "auto":
        shape = Shape(shape.model, shape.context_len, fits, shape.elem_bytes, shape.tied_embeddings)
    steps = step_work(work, shape, target.budget, target.block_size, target.fetch_granularity)
    step = project_step(steps, hw, shape.batch, work.method, launch_counts(work.method, target.cuda_graphs))
    if not (math.isfinite(step.step_ms) and step.step_ms > 0):  # e.g. a rate so small that a time overflows
        raise UsageError(f"{hw.path or hw.name}: its numbers give {work.method} a step of {step.step_ms} ms; "
                         "check the profile's rates and sizes (SI units: bytes, bytes/s, FLOP/s, seconds)")
    return step, steps, fits, memory


def project_results(results: list[dict[str, Any]], hw: Hardware, target: Target) -> list[Projection]:
    """One projection per measured point among the ok throughput results (points as the gate and report know
    them: method and config, model, dtype, length, batch and run settings); repeats are merged by the median of
    their measured fractions (they are deterministic for a seed, so repeats normally agree). Each projection names
    its source point, so rows projected to one target shape from different points can be told apart."""
    from scoutbench.analysis.points import point_key, point_labels

    groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        if r.get("kind") == "throughput" and r.get("status", "ok") == "ok":
            groups[point_key(r)].append(r)
    if not groups:
        raise UsageError("no ok throughput results to project: run `scoutbench throughput` or `sweep` first")
    labels = point_labels([r for runs in groups.values() for r in runs])
    out = []
    for key, runs in groups.items():
        first = runs[0]
        work = with_dense_layers(median_work([measured_work(r) for r in runs]), target.dense_layers)
        shape, model_name = target_shape(first, target)
        try:
            step, steps, fits, memory = project_work(work, shape, hw, target)
        except UsageError as exc:
            raise UsageError(f"{exc} (model {model_name})") from None
        measured = _measured_step_ms(runs, hw) if target == Target(fetch_granularity=target.fetch_granularity,
                                                                   cuda_graphs=target.cuda_graphs) else None
        prompt_len = target.length or int(first["workload"]["len"])
        budget = getattr(work.method_at(target.budget, target.block_size), "budget", None)
        out.append(Projection(first["method"], work.config, model_name, shape.context_len, step.batch,
                              memory if target.batch == "auto" else None, step, steps.totals(), work,
                              [str(r.get("_path", "")) for r in runs], measured, prompt_len,
                              key.describe(labels.get(key)), fits, work.config.get("budget"), budget))
    return sorted(out, key=lambda p: (p.model, p.length, p.batch, p.method, p.source))


def _measured_step_ms(runs: list[dict[str, Any]], hw: Hardware) -> float | None:
    """The runs' median step, for comparison, when they ran on the profile's kind of machine: a CPU run with a
    calibrated CPU profile, a CUDA run with a GPU profile."""
    steps = [(r.get("decode_step_ms") or {}).get("median") for r in runs]
    on_cpu = {(r.get("device") or {}).get("type") == "cpu" for r in runs}
    if not all(isinstance(s, (int, float)) for s in steps) or on_cpu != {hw.shares_device}:
        return None
    return statistics.median(steps)


def median_work(works: list[MeasuredWork]) -> MeasuredWork:
    """Repeats (or records) of one point as one: the median of each measured fraction."""
    if len(works) == 1:
        return works[0]
    first = works[0]
    medians = {name: statistics.median(w.fractions[name] for w in works) for name in first.fractions}
    # the most tokens one row attended (what --budget bounds): kept, not reset to "the budget", when repeats merge
    maxima = [w.attended_max_budget_frac for w in works if w.attended_max_budget_frac is not None]
    return MeasuredWork(first.method, first.family, first.config, source=first.source,
                        attended_max_budget_frac=statistics.median(maxima) if maxima else None, **medians)


ASSUMPTIONS = (
    "roofline per layer: linear layers take max(weight bytes / memory bandwidth, FLOPs / peak); decode attention "
    "and block selection are bandwidth-bound at the profile's efficiency of their kernel (dense, block-sparse by "
    "page size, digest scoring with top-k), and a layer with a host part pays the profile's hand-off once",
    "host issue on a GPU profile: each method's launches per layer (docs/projection.md; CUDA graphs on unless "
    "--cuda-graphs off) times the profile's cost per launch; a step is at least its host issue time; a calibrated "
    "CPU profile adds its measured per-layer engine overhead",
    "a copy costs the profile's per-copy overhead plus bytes / bus bandwidth; copies in one direction are serial",
    "the measured selection behaviour (CPU share of the budget, recall volume, fetched and CPU-attended token "
    "fractions) carries to the target shape as a fraction of the budget or of the context",
    "the step is at least the serial CPU time and the serial bus time of all its layers",
    "repeats of one point are merged by the median of their measured fractions",
)


def projection_document(results: list[dict[str, Any]], hw: Hardware, target: Target,
                        command: list[str] | None = None) -> dict[str, Any]:
    """The JSON `scoutbench project` prints and writes (kind "projection"; `report` tabulates it)."""
    from dataclasses import asdict

    from scoutbench.results import envelope

    usable, skipped = [], []
    for r in results:
        reason = unprojectable(r)
        if reason is None:
            usable.append(r)
        else:
            skipped.append({"file": r.get("_path"), "reason": reason})
    for flag, value, name in (("--budget", target.budget, "budget"), ("--block-size", target.block_size, "block_size"),
                              ("--dense-layers", target.dense_layers, "dense_layers")):
        if value is not None and usable and not any(name in (r.get("method_config") or {}) for r in usable):
            raise UsageError(f"{flag}: no projected result's method has {name.replace('_', ' ')} "
                             f"({', '.join(sorted({str(r.get('method')) for r in usable}))}); drop {flag}")
    if target.budget is None:
        for r in usable:
            check_budget_carried(r, target)
    projections = project_results(usable, hw, target)
    return {**envelope("projection", command), "hardware": hw.describe(), "target": asdict(target),
            "assumptions": list(ASSUMPTIONS), "projections": [p.to_dict() for p in projections],
            "skipped": skipped}


def check_budget_carried(result: dict[str, Any], target: Target) -> None:
    """A run carried to another length keeps its budget only when asked to: the same number of tokens is another
    share of the context there (a 1k run at budget 256 attends a quarter of its context, at 64k 0.4%), so without
    `--budget` that is refused (UsageError, exit 2) rather than done silently."""
    from scoutbench.units import format_length

    budget = (result.get("method_config") or {}).get("budget")
    run_len = (result.get("workload") or {}).get("len")
    if budget is None or target.length is None or target.length == run_len:
        return
    raise UsageError(f"{result.get('_path') or result.get('method')}: its run used budget {budget} at len "
                     f"{format_length(run_len) if isinstance(run_len, int) else run_len}; carried to len "
                     f"{format_length(target.length)} it would be another budget relative to the context; pass "
                     f"--budget {budget} to keep it or --budget N for the target's")


def unprojectable(result: dict[str, Any]) -> str | None:
    """Why a result file cannot feed a projection (None when it can)."""
    from scoutbench.analysis.work import method_family, work_problem

    if result.get("kind") != "throughput":
        return f"kind {result.get('kind')!r} is not a throughput result"
    if result.get("status", "ok") != "ok":
        return f"status {result.get('status')}: {result.get('error')}"
    try:
        method_family(str(result.get("method")))
    except UsageError as exc:
        return str(exc)
    return work_problem(result)


def projection_markdown(document: dict[str, Any]) -> list[str]:
    """A projection document as a markdown table (for `report`'s summary); `setting` is each row's grid point with
    the paper-literal one beside it (`methods.setting_text`)."""
    from scoutbench.units import format_length

    hw = document["hardware"]
    labels = hw.get("labels", {})
    projections = document.get("projections", [])
    with_source = needs_source_column(projections)
    lines = [f"Projected on **{hw['name']}** ({labels.get('device', '')}, {labels.get('bus', '')}, "
             f"{labels.get('host', '')}); see docs/projection.md for the model and its assumptions.", "",
             "| method | setting | model | len | batch | budget | tok/s | step ms | idle % | bound by | vs fullkv |"
             + (" from |" if with_source else ""), "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" * with_source)]
    from scoutbench.methods import is_reference, setting_text

    fullkv = {(p["model"], p["len"]): p["decode_throughput_tok_s"] for p in projections if is_reference(p["method"])}
    for p in projections:
        base = fullkv.get((p["model"], p["len"]))
        batch = f"{p['batch']} ({p['batch_limited_by']})" if p.get("batch_limited_by") else str(p["batch"])
        speedup = f"{p['decode_throughput_tok_s'] / base:.2f}x" if base else "-"
        method = p["method"] + (" (launch-bound)" if p.get("launch_bound") else "")
        setting = setting_text(p["method"], p.get("method_config") or {}) or "-"
        lines.append(f"| {method} | {setting} | {p['model']} | {format_length(p['len'])} | {batch} | {budget_cell(p)} "
                     f"| {p['decode_throughput_tok_s']:.1f} | {p['decode_step_ms']:.2f} "
                     f"| {100 * p['gpu_idle_frac']:.1f} | {p['bound_by']} | {speedup} |"
                     + (f" {p.get('source_point', '')} |" if with_source else ""))
    return lines


def budget_cell(projection: dict[str, Any]) -> str:
    """The budget a row is projected at, with the run's beside it when they differ (`256 -> 2k`); `-` without one."""
    from scoutbench.units import format_length

    run, target = projection.get("run_budget"), projection.get("budget")
    if target is None:
        return "-"
    if run is None or run == target:
        return format_length(target)
    return f"{format_length(run)} -> {format_length(target)}"


def needs_source_column(projections: list[dict[str, Any]]) -> bool:
    """True when two projections share method, model, len and batch: only their source points tell them apart."""
    shown = [(p.get("method"), p.get("model"), p.get("len"), p.get("batch")) for p in projections]
    return len(set(shown)) < len(shown)

"""The throughput benchmark: decode a synthetic workload with one method and measure where the time goes.

Decode is summarised by the median step (as SGLang's bench_one_batch does) and throughput is
batch x timed steps / timed decode time. Warm-up steps run first and are excluded (their count is recorded).

The timed window holds each method's per-block work (a completed block's digests and copy to the host tier, a
window migration: `block_events`) at its real rate in one of two forms (`block_window` in the result): whole
cycles, a window of a multiple of the method's `block_cycle` steps, which then holds every event steps / cycle
times (the default step counts are whole cycles of the compared methods); or, with `amortise_blocks`, a window
opened on the method's next block event (untimed alignment steps first), whose event steps and ordinary steps are
timed apart and weighted as one cycle holds them (the amortised step). Any other window is `partial`, and says so.

A run is resolved first (`bench/resolve.py`: ThroughputConfig -> ResolvedRun, with its one memory check); this
module measures it and runs a comparison's methods in turn (`run_methods`). A measurement is `measure` (prefill,
warm-up, the timed window, the untimed counted and profiled steps) -> `Measurement`, the raw figures, and
`assemble_result` -> the result dict; the timed loop itself is `decode_steps` (gpt-fast's `decode_n_tokens`: decode
steps and nothing else inside a step's time) under `decode_timed` (the window's counters started and read).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from scoutbench.bench.resolve import (
    ResolvedRun,
    ThroughputConfig,
    memory_need,
    resolve_prefill,
    resolve_run,
    storage_tokens,
)
from scoutbench.devices import device_description
from scoutbench.errors import ScoutbenchError, error_text
from scoutbench.kernels.backends import USAGE as attention_backends
from scoutbench.methods import build_method
from scoutbench.methods.base import AttentionMethod, dense_layers_of
from scoutbench.models import LoadedModel
from scoutbench.results import envelope
from scoutbench.step_stats import spread_warning, step_summary
from scoutbench.telemetry import NvmlSampler
from scoutbench.tiers import tier_fields, wait_fields
from scoutbench.timing import LAUNCH_BOUND_FRAC, STAGES, TorchCallCounter
from scoutbench.units import format_length
from scoutbench.workloads.synthetic import SyntheticWorkload

if TYPE_CHECKING:  # the engine (and its kernels) is imported where a run starts
    from scoutbench.workloads.synthetic_kv import SyntheticKVCache

# an offloading method's host arena is its planned host bytes within this fraction (alignment, per-layer staging;
# tests/bench/test_plan.py): what a buffer kept for several runs reserves on top of the largest plan
HOST_PLAN_SLACK = 0.02


def graph_fields(engine: Any, timed_captures: int) -> dict[str, Any]:
    """The result's `cuda_graphs`: what replayed (graphs.GraphRunner.describe), or eager throughout and why."""
    if engine.graphs is None:
        return {"cuda_graphs": {"enabled": engine.graphs_failure is not None, "captured": False,
                                "failure": engine.graphs_failure}}
    return {"cuda_graphs": {**engine.graphs.describe(), "captures_in_timed_steps": timed_captures}}


def host_fields(records: list[dict[str, float]], calls_per_step: float | None, counted_steps: int,
                replays_per_step: float | None = None) -> dict[str, Any]:
    """The host side of the timed steps (docs/results.md, `host` and `launch_bound`): torch calls (and CUDA graph
    replays) per step from the counted steps, and on CUDA each step's host issue and wait time. `launch_bound` is
    null off CUDA (no launches: the host runs the step's work itself) and where no step recorded its host time."""
    issue = [r["host_issue"] for r in records if "host_issue" in r]
    issue_frac = [r["host_issue"] / r["total"] for r in records if "host_issue" in r and r["total"] > 0]
    median = statistics.median
    host = {
        "torch_calls_per_step": calls_per_step, "graph_replays_per_step": replays_per_step,
        "counted_steps": counted_steps,
        "host_issue_ms": median(issue) if issue else None,
        "host_wait_ms": median([r["host_wait"] for r in records if "host_wait" in r]) if issue else None,
        "host_issue_frac": median(issue_frac) if issue_frac else None,
        "launch_bound_frac": LAUNCH_BOUND_FRAC,
    }
    launch_bound = None if not issue_frac else host["host_issue_frac"] >= LAUNCH_BOUND_FRAC
    return {"host": host, "launch_bound": launch_bound}


def count_calls(engine: Any, tokens: torch.Tensor, steps: int, events: list[tuple[str, ...]] | None = None
                ) -> tuple[torch.Tensor, float | None, float | None]:
    """Decode `steps` untimed steps with the main thread's torch calls counted; (next tokens, calls per step,
    CUDA graph replays per step or None without graphs). With graphs a torch function mode sees the host points'
    calls, not the replayed ones: the replays are counted apart. `events` receives each step's block events."""
    if steps <= 0:
        return tokens, None, None
    counter = TorchCallCounter()
    replays_before = engine.graphs.replayed_pieces if engine.graphs is not None else 0
    with counter:
        for _ in range(steps):
            if events is not None:
                events.append(engine.method.block_events(engine.positions_host))
            tokens = engine.decode_step(tokens).argmax(-1)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    replays = None if engine.graphs is None else (engine.graphs.replayed_pieces - replays_before) / steps
    return tokens, counter.calls / steps, replays


def summarise_steps(records: list[dict[str, float]], batch: int, device_type: str = "cpu") -> dict[str, Any]:
    """Per-step records (ms per stage + total) -> the result's timing fields."""
    totals = [r["total"] for r in records]
    decode_s = sum(totals) / 1e3
    breakdown = {stage: statistics.fmean(r[stage] for r in records) for stage in STAGES}
    mean_total = statistics.fmean(totals)
    step_ms = step_summary(totals)
    return {
        "decode_throughput_tok_s": batch * len(records) / decode_s if decode_s > 0 else 0.0,
        "decode_time_s": decode_s,
        "decode_step_ms": step_ms, "step_spread_warning": spread_warning(step_ms),
        "latency_breakdown_ms": breakdown,
        "latency_breakdown_frac": {k: (v / mean_total if mean_total else 0.0) for k, v in breakdown.items()},
        **wait_fields(breakdown["idle"], mean_total, device_type),
        "step_ms": totals,
    }


def alignment_steps(method: Any, positions: list[int], steps: int, amortise: bool) -> int:
    """Untimed steps before an amortised window, so that it opens on the method's next block event (a step with
    events after one without: ScoutAttention's completion, then its hand-over); 0 for whole cycles, a method
    without per-block work, or without `amortise`."""
    cycle = method.block_cycle()
    if not amortise or cycle is None or steps % cycle == 0:
        return 0

    def events(ahead: int) -> tuple[str, ...]:
        return method.block_events([p + ahead for p in positions])

    return next(k for k in range(cycle + 1) if events(k) and not events(k - 1))


def cycle_events(method: Any, positions: list[int]) -> dict[tuple[str, ...], int]:
    """The steps of one block cycle from `positions` that do per-block work, by their events: each event comes once
    a cycle, alone or with others in one step (looking ahead is right up to each event's first step)."""
    kinds: dict[tuple[str, ...], int] = {}
    seen: set[str] = set()
    for ahead in range(method.block_cycle() or 0):
        found = method.block_events([p + ahead for p in positions])
        if set(found) - seen:
            kinds[found] = 1
            seen.update(found)
    return kinds


def block_window(step_ms: list[float], events: list[tuple[str, ...]], cycle: int | None,
                 per_cycle: dict[tuple[str, ...], int], amortise: bool, alignment: int) -> dict[str, Any]:
    """The result's `block_window`: how the timed window holds the method's per-block work (module docstring), the
    events it held, and in the amortised form the event and ordinary steps' times and the amortised step."""
    counts: dict[str, int] = {}
    for step in events:
        for event in step:
            counts[event] = counts.get(event, 0) + 1
    out: dict[str, Any] = {"cycle_steps": cycle, "steps": len(step_ms), "events": counts,
                           "alignment_steps": alignment}
    if cycle is None:
        return {**out, "form": "none"}
    if len(step_ms) % cycle == 0:
        return {**out, "form": "whole"}
    by_kind: dict[tuple[str, ...], list[float]] = {}
    for ms, step in zip(step_ms, events, strict=True):
        by_kind.setdefault(step, []).append(ms)
    ordinary = cycle - sum(per_cycle.values())
    if not amortise or any(kind not in by_kind for kind in per_cycle) or (ordinary and () not in by_kind):
        return {**out, "form": "partial"}
    mean = statistics.fmean
    total = sum(mean(by_kind[kind]) * n for kind, n in per_cycle.items()) + (ordinary and ordinary * mean(by_kind[()]))
    return {**out, "form": "amortised", "ordinary_step_ms": mean(by_kind[()]) if () in by_kind else None,
            "event_step_ms": {"+".join(kind): mean(by_kind[kind]) for kind in per_cycle},
            "amortised_step_ms": total / cycle}


def amortised_timing(timing: dict[str, Any], window: dict[str, Any], batch: int) -> dict[str, Any]:
    """An amortised window's throughput: the window at the cycle's mix of steps (`decode_time_s` = steps x the
    amortised step, the measured time kept as `measured_decode_time_s`), so that tok/s stays tokens over the
    window's time."""
    if window["form"] != "amortised":
        return timing
    decode_s = window["steps"] * window["amortised_step_ms"] / 1e3
    return {**timing, "decode_time_s": decode_s, "measured_decode_time_s": timing["decode_time_s"],
            "decode_throughput_tok_s": batch * window["steps"] / decode_s}


ProgressCallback = Callable[[str, int, int], None]  # (phase "prefill" | "decode", done, total)


def run_throughput(run: ResolvedRun | ThroughputConfig, loaded: LoadedModel | None = None,
                   on_progress: ProgressCallback | None = None,
                   shared_kv: SyntheticKVCache | None = None) -> dict[str, Any]:
    """Execute one resolved run (a ThroughputConfig is resolved here first, on `loaded` when given) and return its
    result dict (see docs/results.md).

    With `batch="auto"` the batch is the method's planned maximum; an out-of-memory error halves it and retries,
    and the result's `batch_plan` records the plan and every attempt. `on_progress(phase, done, total)` reports
    prefill layers and decode steps. Runs given one `shared_kv` draw a synthetic prefill's K/V once between them.
    """
    if isinstance(run, ThroughputConfig):
        run = resolve_run(run, loaded, shared_kv)
    if run.auto_plan is None:
        return _run_at_batch(run, run.batch, on_progress, shared_kv)
    from scoutbench.planning import run_with_oom_backoff

    plan = run.auto_plan
    result, attempts = run_with_oom_backoff(
        lambda batch: _run_at_batch(run, batch, on_progress, shared_kv, oom_backoff=True), run.batch)
    result["batch_plan"] = {"mode": "auto", "planned": run.batch, "limited_by": plan.limited_by,
                            "gpu_mem_bytes": plan.gpu_mem_bytes, "host_mem_bytes": plan.host_mem_bytes,
                            "device_bytes_per_seq": plan.device_bytes_per_seq,
                            "host_bytes_per_seq": plan.host_bytes_per_seq,
                            "workspace_bytes_per_seq": plan.workspace_bytes_per_seq, "attempts": attempts}
    return result


def result_file_name(cfg: ThroughputConfig, result: dict[str, Any]) -> str:
    """A result's file name in a folder of results (the batch that ran: `--batch auto` records its own)."""
    return (f"throughput_{result['method']}_{cfg.model.replace('/', '--')}_len{format_length(cfg.length)}"
            f"_b{result['workload']['batch']}.json")


def run_methods(configs: list[ThroughputConfig], loaded: LoadedModel, log: Callable[[str], None] = lambda line: None,
                progress: Callable[[str], ProgressCallback] | None = None, raise_if_all_refused: bool = True
                ) -> Iterator[tuple[ThroughputConfig, dict[str, Any]]]:
    """Run the configs (methods) on one loaded model in order, yielding each one's result as it finishes.

    Every run is resolved (its memory checked, once) before the first one starts. A method refused there, or
    failing while it runs, yields a failed result (`failed_result`, its error logged) and the next method runs;
    where every method is refused nothing runs and the first refusal is raised (with `raise_if_all_refused`, as a
    command's one-line error), else each yields its failed result. The methods decode over one
    synthetic prefill, drawn once (kept only for a second method: keeping it takes fresh memory for every layer,
    where a single run reuses one K and one V buffer). On CUDA their host tiers take one kept, registered buffer
    in turn: the process's where one is kept (offload.keep_host_memory: the GPU check), else one reserved here at
    the largest planned host tier: fresh host memory and its registration are paid once, not once per method.
    `progress(where)` gives a run's progress callback (`where`: "[2/5] scout")."""
    from scoutbench.planning import format_bytes
    from scoutbench.runtime.offload import keep_host_memory, kept_host_memory
    from scoutbench.workloads.synthetic_kv import SyntheticKVCache

    device = next(loaded.model.parameters()).device
    dtype_name = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")

    def failed(cfg: ThroughputConfig, exc: Exception) -> dict[str, Any]:
        log(f"{cfg.method}: failed: {error_text(exc)}")
        return failed_result(cfg, error_text(exc), device_description(device), dtype_name)

    runs: list[ResolvedRun | Exception] = []
    for cfg in configs:
        try:
            runs.append(resolve_run(cfg, loaded))
        except Exception as exc:  # noqa: BLE001 - the method's failed result below; Ctrl-C is no Exception
            runs.append(exc)
    if raise_if_all_refused and all(isinstance(run, Exception) for run in runs):
        raise runs[0]
    keep: Any = contextlib.nullcontext()
    host_bytes = max((run.host_bytes for run in runs if isinstance(run, ResolvedRun)), default=0)
    if device.type == "cuda" and len(runs) > 1 and host_bytes and kept_host_memory() is None:
        keep = keep_host_memory(device, reserve_bytes=int(host_bytes * (1 + HOST_PLAN_SLACK)))
    shared_kv = SyntheticKVCache() if len(runs) > 1 else None
    try:
        with keep as kept:
            if kept is not None:
                log(f"host memory kept for the offloading methods: {format_bytes(kept.nbytes)} (filled in "
                    f"{kept.fill_s:.1f} s, registered in {kept.register_s:.1f} s)")
            for index, (cfg, run) in enumerate(zip(configs, runs, strict=True), 1):
                if isinstance(run, Exception):
                    yield cfg, failed(cfg, run)
                    continue
                on_progress = None if progress is None else progress(f"[{index}/{len(runs)}] {cfg.method}")
                try:
                    result = run_throughput(run, on_progress=on_progress, shared_kv=shared_kv)
                except Exception as exc:  # noqa: BLE001 - as above: the next method runs
                    result = failed(cfg, exc)
                yield cfg, result
    finally:
        if shared_kv is not None:
            shared_kv.clear()


def failed_result(cfg: ThroughputConfig, error: str, device: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A failed run's file: the identifying fields of a result (the method's full config when it can be built,
    so that gates match it with the baseline's point), `status: failed` and the error (docs/results.md)."""
    try:
        method_config = build_method(cfg.method, cfg.method_args).config()
    except Exception:  # noqa: BLE001 - an unbuildable method is itself the error being recorded
        method_config = dict(cfg.method_args)
    return {**envelope("throughput", cfg.command), "status": "failed", "error": error,
            "method": cfg.method, "method_config": method_config, "method_repr": None,
            "model": {"name": cfg.model, "dtype": dtype},
            "workload": {"name": "synthetic", "len": cfg.length, "batch": cfg.batch, "steps": cfg.steps,
                         "warmup": cfg.warmup, "seed": cfg.seed, "prefill": resolve_prefill(cfg.prefill, cfg.model),
                         "kv_skew": cfg.kv_skew},
            "device": device}


def _run_at_batch(run: ResolvedRun, batch: int, on_progress: ProgressCallback | None,
                  shared_kv: SyntheticKVCache | None = None, oom_backoff: bool = False) -> dict[str, Any]:
    """One measured run of `run` at `batch`; out-of-memory errors propagate when the caller backs off."""
    from scoutbench.decode.engine import DecodeEngine

    cfg = run.cfg
    requested, method = run.build()
    workload = SyntheticWorkload(cfg.length, batch, cfg.steps, cfg.warmup, cfg.seed, run.prefill, cfg.kv_skew)
    if shared_kv is not None:
        shared_kv.make_room(sum(memory_need(cfg, method, run.loaded, batch).values()))
    try:
        with DecodeEngine(run.loaded.model, method) as engine:  # closes the method on every path
            measured = measure(engine, run, workload, on_progress, shared_kv)
    except torch.OutOfMemoryError:
        if oom_backoff:
            raise
        raise ScoutbenchError(f"{cfg.method}: out of GPU memory at batch {batch}, len {cfg.length}; lower "
                              "--batch or --len (or use --batch auto)") from None
    except RuntimeError as exc:
        if oom_backoff:
            raise
        if any(text in str(exc) for text in ("can't allocate memory", "not enough memory", "pinned host memory")):
            raise ScoutbenchError(f"{cfg.method}: out of host memory at batch {batch}, len {cfg.length}; "
                                  "lower --batch or --len") from None
        raise
    return assemble_result(run, requested, workload, measured)


@dataclass
class TimedSteps:
    """The timed window's raw measurements (`decode_timed`): each step's stage times and block events, and what
    the method, the attention backends and the CUDA graphs counted over exactly these steps."""

    records: list[dict[str, float]]  # StageTimer.end_step of each step: ms per stage and `total`
    events: list[tuple[str, ...]]  # each step's block events (the method's per-block work)
    cycle_events: dict[tuple[str, ...], int]  # the event steps one block cycle holds from the first step
    method_stats: dict[str, Any]
    attention_backends: dict[str, int]
    attention_backends_by_stage: dict[str, dict[str, int]]
    graph_captures: int  # CUDA graphs captured during the timed steps (a new shape: capture inside the window)
    nvml: dict[str, Any] | None


@dataclass
class Measurement:
    """What one run measured, raw: the prefill, the window's alignment, the timed steps and the untimed steps
    after them (torch calls counted, the profiler); `assemble_result` turns it into the result dict."""

    prefill_ms: float
    prefill_kv_reused: bool | None  # None for a real prefill (it draws nothing)
    block_cycle: int | None  # the decoding method's (FullKV's where the budget covers the context)
    alignment_steps: int
    timed: TimedSteps
    graphs: dict[str, Any]  # graph_fields
    calls_per_step: float | None
    replays_per_step: float | None
    counted_events: list[tuple[str, ...]]  # each counted step's block events
    profile: dict[str, Any] | None


def decode_steps(engine: Any, tokens: torch.Tensor, steps: int, on_step: Callable[[], None] | None = None,
                 events: list[tuple[str, ...]] | None = None, records: list[dict[str, float]] | None = None
                 ) -> torch.Tensor:
    """`steps` greedy decode steps (gpt-fast's `decode_n_tokens`), each one step of the engine's stage timer;
    the next tokens. `events` receives each step's block events, read before the step's time starts, and
    `records` its stage times; `on_step()` runs after each step, outside its time."""
    method, timer = engine.method, engine.timer
    for _ in range(steps):
        if events is not None:
            events.append(method.block_events(engine.positions_host))
        timer.begin_step()
        tokens = engine.decode_step(tokens).argmax(-1)
        record = timer.end_step()
        if records is not None:
            records.append(record)
        if on_step is not None:
            on_step()
    return tokens


def decode_timed(engine: Any, tokens: torch.Tensor, steps: int, nvml: NvmlSampler | None = None,
                 on_step: Callable[[], None] | None = None) -> tuple[torch.Tensor, TimedSteps]:
    """The measurement: `steps` timed decode steps with the method's and the backends' counters started fresh,
    `nvml` sampling over them, and the counters read before anything else runs; (next tokens, what they
    measured)."""
    method = engine.method
    method.reset_stats()
    attention_backends.reset()
    captures_before = len(engine.graphs.schedules) if engine.graphs is not None else 0
    per_cycle = cycle_events(method, engine.positions_host)
    events: list[tuple[str, ...]] = []
    records: list[dict[str, float]] = []
    with nvml or contextlib.nullcontext():
        tokens = decode_steps(engine, tokens, steps, on_step, events, records)
        stats = method.stats()
        backends, by_stage = attention_backends.snapshot(), attention_backends.by_stage()
        captures = len(engine.graphs.schedules) - captures_before if engine.graphs is not None else 0
    telemetry = None if nvml is None else nvml.summary(tokens=tokens.shape[0] * len(records))
    return tokens, TimedSteps(records, events, per_cycle, stats, backends, by_stage, captures, telemetry)


def measure(engine: Any, run: ResolvedRun, workload: SyntheticWorkload, on_progress: ProgressCallback | None,
            shared_kv: SyntheticKVCache | None = None) -> Measurement:
    """Start `engine` for `run`, prefill, decode the warm-up and alignment steps, the timed window
    (`decode_timed`), then the untimed counted and profiled steps (no part of the measurement)."""
    cfg, device, vocab_size = run.cfg, run.device, run.loaded.model.config.vocab_size
    method = engine.method
    engine.timer.nvtx = run.nvtx
    engine.start(workload.batch, storage_tokens(cfg, method), cuda_graphs=run.cuda_graphs)
    if on_progress is not None:  # phases start now: their elapsed time and ETA count from here
        on_progress("prefill", 0, engine.num_layers)
    on_layer = None if on_progress is None else lambda done, total: on_progress("prefill", done, total)
    start = time.perf_counter()
    kv_reused = None  # a real prefill draws nothing
    if workload.prefill == "real":
        tokens = engine.prefill(workload.prompt_ids(vocab_size), on_layer=on_layer).argmax(-1)
    else:
        lengths = torch.full((workload.batch,), workload.length, dtype=torch.long)
        kv_reused = engine.prefill_synthetic(lengths, cfg.seed, key_skew=workload.kv_skew, on_layer=on_layer,
                                             shared_kv=shared_kv)
        tokens = workload.first_tokens(vocab_size).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prefill_ms = (time.perf_counter() - start) * 1e3

    decoded, total_steps = 0, workload.warmup + workload.steps

    def report_step() -> None:
        nonlocal decoded
        decoded += 1
        on_progress("decode", decoded, total_steps)

    on_step = None if on_progress is None else report_step
    if on_progress is not None:
        on_progress("decode", 0, total_steps)
    tokens = decode_steps(engine, tokens, workload.warmup, on_step)
    alignment = alignment_steps(method, engine.positions_host, workload.steps, cfg.amortise_blocks)
    total_steps += alignment
    tokens = decode_steps(engine, tokens, alignment, on_step)
    nvml = NvmlSampler(device.index or 0, cfg.nvml_interval_ms) if run.nvml else None
    tokens, timed = decode_timed(engine, tokens, workload.steps, nvml, on_step)
    graphs = graph_fields(engine, timed.graph_captures)
    counted_events: list[tuple[str, ...]] = []
    tokens, calls_per_step, replays_per_step = count_calls(engine, tokens, cfg.count_steps, counted_events)
    profile = None
    if cfg.profiled_steps:
        from scoutbench.profiling import profile_decode

        stem = result_file_name(cfg, {"method": cfg.method, "workload": {"batch": workload.batch}})
        profile = profile_decode(engine, tokens, cfg.profiled_steps, cfg.profile_dir, stem.removesuffix(".json"))
    return Measurement(prefill_ms, kv_reused, method.block_cycle(), alignment, timed, graphs, calls_per_step,
                       replays_per_step, counted_events, profile)


def assemble_result(run: ResolvedRun, requested: AttentionMethod, workload: SyntheticWorkload,
                    measured: Measurement) -> dict[str, Any]:
    """The result dict of a measured run (docs/results.md): what ran (`requested`: the method as configured),
    the timing of the timed steps and how their window holds the per-block work, the host side, the counters."""
    cfg, device, timed = run.cfg, run.device, measured.timed
    cycle = measured.block_cycle
    window = block_window([r["total"] for r in timed.records], timed.events, cycle, timed.cycle_events,
                          cfg.amortise_blocks, measured.alignment_steps)
    host = host_fields(timed.records, measured.calls_per_step, cfg.count_steps, measured.replays_per_step)
    host["host"]["block_events"] = block_window([0.0] * len(measured.counted_events), measured.counted_events,
                                                cycle, {}, False, 0)["events"] if cfg.count_steps else None
    return {
        **envelope("throughput", cfg.command), "status": "ok", "error": None,
        "method": cfg.method, "method_config": requested.config(), "method_repr": repr(requested),
        **run.budget_plan.result_fields(), "dense_layers": dense_layers_of(requested),
        "model": run.loaded.describe(run.dtype), "workload": workload.describe(),
        "kv_source": workload.kv_source(cfg.model), "device": device_description(device),
        "prefill_ms": measured.prefill_ms, "prefill_kv_reused": measured.prefill_kv_reused, **tier_fields(device),
        **amortised_timing(summarise_steps(timed.records, workload.batch, device.type), window, workload.batch),
        "block_window": window, **host, **measured.graphs,
        "nvml": timed.nvml, "profile": measured.profile, "method_stats": timed.method_stats,
        "attention_backends": timed.attention_backends,
        "attention_backends_by_stage": timed.attention_backends_by_stage,
    }

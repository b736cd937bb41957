"""The throughput benchmark: decode a synthetic workload with one method and measure where the time goes.

Decode is summarised by the median step (as SGLang's bench_one_batch does) and throughput is
batch x timed steps / timed decode time. Warm-up steps run first and are excluded (their count is recorded).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from scoutbench.devices import device_description, resolve_device, resolve_dtype
from scoutbench.errors import ScoutbenchError, UsageError, error_text
from scoutbench.kernels.backends import USAGE as attention_backends
from scoutbench.methods import build_method
from scoutbench.methods.base import AttentionMethod, ModelShape, dense_layers_of
from scoutbench.methods.sparse import BudgetPlan, dense_if_budget_covers
from scoutbench.models import LoadedModel, load_model
from scoutbench.results import envelope
from scoutbench.step_stats import spread_warning, step_summary
from scoutbench.telemetry import NvmlSampler
from scoutbench.tiers import tier_fields, wait_fields
from scoutbench.timing import LAUNCH_BOUND_FRAC, STAGES, TorchCallCounter
from scoutbench.units import format_length
from scoutbench.workloads.synthetic import DEFAULT_KV_SKEW, SyntheticWorkload

if TYPE_CHECKING:  # the engine (and its kernels) is imported where a run starts
    from scoutbench.workloads.synthetic_kv import SyntheticKVCache


# an offloading method's host arena is its planned host bytes within this fraction (alignment, per-layer staging;
# tests/test_plan.py): what a buffer kept for several runs reserves on top of the largest plan
HOST_PLAN_SLACK = 0.02


@dataclass
class ThroughputConfig:
    method: str = "fullkv"
    method_args: dict[str, Any] = field(default_factory=dict)
    model: str = "tiny-qwen3"
    length: int = 4096
    batch: int | str = 1  # or "auto": the planned maximum (scoutbench/planning.py), halved on out-of-memory
    gpu_mem: int | None = None  # bytes for --batch auto; None: the CUDA device's usable memory (required on CPU)
    host_mem: int | None = None  # bytes of host memory for offloaded KV; None: this machine's available memory
    steps: int = 16
    warmup: int = 3
    device: str = "auto"
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    seed: int = 0
    prefill: str = "auto"  # auto: synthetic for random-weight presets, real for real models (resolve_prefill)
    kv_skew: float = DEFAULT_KV_SKEW
    force: bool = False  # run even when the planned memory exceeds what is free (check_memory)
    nvml_interval_ms: int = 100
    profile_dir: str | None = None  # --profile: a torch.profiler trace of `profile_steps` extra, untimed steps
    profile_steps: int = 4
    # extra, untimed steps after the timed ones during which the main thread's torch calls are counted (counting
    # costs ~2.5 us a call, so it never runs in a timed step); 0: not counted
    count_steps: int = 8
    # on: decode steps replay piecewise CUDA graphs (scoutbench/graphs.py); off: eager; auto: on where the device
    # is CUDA
    cuda_graphs: str = "auto"
    nvtx: bool = False  # an NVTX range per stage on CUDA (Nsight Systems); off by default (a cost per stage)
    command: list[str] = field(default_factory=lambda: list(sys.argv))

    @property
    def context_tokens(self) -> int:
        """Tokens each sequence's cache holds by the last timed step: prompt + warm-up + timed steps."""
        return self.length + self.warmup + self.steps

    @property
    def stored_tokens(self) -> int:
        """Tokens each sequence's storage holds: `context_tokens` plus the untimed counted and profiled steps."""
        return self.context_tokens + self.count_steps + (self.profile_steps if self.profile_dir is not None else 0)


CUDA_GRAPH_MODES = ("auto", "on", "off")


def use_cuda_graphs(mode: str, device: torch.device) -> bool:
    """Whether a run replays CUDA graphs: `auto` where the device is CUDA; `on` refuses any other device."""
    if mode not in CUDA_GRAPH_MODES:
        raise UsageError(f"--cuda-graphs {mode!r}: use one of {', '.join(CUDA_GRAPH_MODES)}")
    if mode == "on" and device.type != "cuda":
        raise UsageError(f"--cuda-graphs on needs a CUDA device (this run's is {device.type}): use --cuda-graphs "
                         "auto or off")
    return mode != "off" and device.type == "cuda"


def graph_fields(engine: Any, timed_captures: int) -> dict[str, Any]:
    """The result's `cuda_graphs`: what replayed (graphs.GraphRunner.describe), or eager throughout and why."""
    if engine.graphs is None:
        return {"cuda_graphs": {"enabled": engine.graphs_failure is not None, "captured": False,
                                "failure": engine.graphs_failure}}
    return {"cuda_graphs": {**engine.graphs.describe(), "captures_in_timed_steps": timed_captures}}


def resolve_prefill(mode: str, loaded: LoadedModel) -> str:
    """`auto`: a random-weight preset has nothing to learn from a real prefill (random text through random weights,
    minutes at 64k on a CPU), so its cache is filled synthetically; a real model prefills its prompt."""
    if mode == "auto":
        return "synthetic" if loaded.random_weights else "real"
    return mode


def memory_need(cfg: ThroughputConfig, method: AttentionMethod, loaded: LoadedModel, batch: int) -> dict[str, int]:
    """Bytes the run will allocate beyond the loaded weights, from the planner's footprint functions: the
    method's device and host tiers plus the per-sequence workspace, for prompt + warm-up + timed tokens."""
    from scoutbench.planning import workspace_bytes_per_seq

    dtype = next(loaded.model.parameters()).dtype
    shape = ModelShape.from_config(loaded.model.config)
    context_len = cfg.stored_tokens
    footprint = method.memory_footprint(shape, context_len, dtype.itemsize)
    workspace = workspace_bytes_per_seq(shape, context_len, dtype.itemsize, footprint.prefill_bytes_per_seq)
    return {"device": batch * (footprint.device_bytes_per_seq + workspace),
            "host": batch * footprint.host_bytes_per_seq}


def check_memory(cfg: ThroughputConfig, method: AttentionMethod, loaded: LoadedModel, batch: int,
                 planned: bool = False) -> None:
    """Refuse, in one line, a run whose planned memory exceeds what is free now, unless `cfg.force`: past that
    point the kernel's OOM killer ends the process with no message (exit 137) or the GPU allocator fails late.
    A batch the tool chose (`planned`: --batch auto) is checked exactly like one the user gave: the plan sizes it
    for --gpu-mem/--host-mem, which may be more than this machine has free (on a CPU both tiers are host memory).

    The host tier must fit the host memory less the planner's reserve: an explicit --host-mem where given (a
    machine whose RAM grows on demand reports less MemAvailable than it can have: the user's figure is the one
    that holds), else MemAvailable. On CUDA the device tier must fit the device's free memory (the loaded weights
    are already counted as used); on a CPU it is host memory too, and with MemAvailable both tiers together must
    fit. A real prefill needs more transient memory than planned (see scoutbench/planning.py); the check is a
    floor, not a guarantee.
    """
    from scoutbench.planning import HOST_RESERVE_FRACTION, device_free_bytes, format_bytes, usable_host_bytes

    if cfg.force:
        return
    need = memory_need(cfg, method, loaded, batch)
    device = next(loaded.model.parameters()).device
    machine_usable = usable_host_bytes()
    given_usable = None if cfg.host_mem is None else int(cfg.host_mem * (1 - HOST_RESERVE_FRACTION))
    free = "free less the planner's reserve"
    checks = []  # (what, bytes needed, bytes usable, where the usable bytes come from)
    if device.type == "cuda":
        device_usable = device_free_bytes(device) - torch.cuda.memory_allocated(device)
        checks.append(("device memory", need["device"], device_usable, free))
    elif given_usable is not None and machine_usable is not None:  # the CPU's "device" tier: this machine's RAM
        checks.append(("host memory", need["device"], machine_usable, free))
    if given_usable is not None:
        checks.append(("host memory", need["host"], given_usable, "--host-mem less the planner's reserve"))
    elif machine_usable is not None:
        on_host = need["host"] + (need["device"] if device.type != "cuda" else 0)
        checks.append(("host memory", on_host, machine_usable, free))
    for what, needed, usable, basis in checks:
        if needed > usable:
            chosen = "--batch auto's planned " if planned else ""
            fix = ("lower --gpu-mem / --host-mem to what this machine has, or give --batch" if planned
                   else "lower --len or --batch (see `scoutbench plan`)")
            raise ScoutbenchError(
                f"{cfg.method}: {chosen}batch {batch} at len {format_length(cfg.length)} needs about "
                f"{format_bytes(needed)} of {what} but only {format_bytes(max(usable, 0))} is usable ({basis}); "
                f"{fix}, or pass --force to try anyway")


def check_context_fits(cfg: ThroughputConfig, loaded: LoadedModel | None = None) -> None:
    """A real prefill of a real model past its trained window measures attention the model never learned (every
    sparse method's selection then runs on noise): refused, pointing at a synthetic prefill, which only times the
    decode over that many positions. Before loading (`loaded` None) only built-in real models' windows are known."""
    from scoutbench.models import check_context, context_window, loaded_context_window

    if loaded is None:
        window, real = context_window(cfg.model), cfg.prefill != "synthetic"
    else:
        window, real = loaded_context_window(loaded), resolve_prefill(cfg.prefill, loaded) == "real"
    if not real:
        return
    check_context(cfg.model, window, cfg.context_tokens,
                  f"--len {format_length(cfg.length)} plus {cfg.warmup + cfg.steps} decode steps",
                  "lower --len, or pass --prefill synthetic to time decode at that length")


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


def count_calls(engine: Any, tokens: torch.Tensor, steps: int) -> tuple[torch.Tensor, float | None, float | None]:
    """Decode `steps` untimed steps with the main thread's torch calls counted; (next tokens, calls per step,
    CUDA graph replays per step or None without graphs). With graphs a torch function mode sees the host points'
    calls, not the replayed ones: the replays are counted apart."""
    if steps <= 0:
        return tokens, None, None
    counter = TorchCallCounter()
    replays_before = engine.graphs.replayed_pieces if engine.graphs is not None else 0
    with counter:
        for _ in range(steps):
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


ProgressCallback = Callable[[str, int, int], None]  # (phase "prefill" | "decode", done, total)


@dataclass(frozen=True)
class ResolvedRun:
    """One throughput run with every choice made, once, at the edge (the CLI, a sweep's runner): the loaded model
    with its device and dtype, the method's configuration and its budget plan (FullKV runs when the budget covers
    the context: methods.sparse.dense_if_budget_covers), the batch (`--batch auto`: planned, with the plan) and a
    passed free-memory check. `run_throughput` executes it and decides nothing again."""

    cfg: ThroughputConfig
    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype
    budget_plan: BudgetPlan
    batch: int
    auto_plan: Any = None  # planning.MethodPlan of --batch auto, else None

    @property
    def method(self) -> str:
        return self.cfg.method

    @property
    def host_bytes(self) -> int:
        """The host tier the run's plan holds (memory_need); its arena is within HOST_PLAN_SLACK of it."""
        requested, method = self.build()
        try:
            return memory_need(self.cfg, method, self.loaded, self.batch)["host"]
        finally:
            method.close()
            requested.close()

    def build(self) -> tuple[AttentionMethod, AttentionMethod]:
        """Fresh instances for one attempt (each attempt of --batch auto binds its own): the method as configured
        (its config is the result's) and the one that decodes (FullKV when the budget plan says dense)."""
        requested = build_method(self.cfg.method, self.cfg.method_args)
        return requested, dense_if_budget_covers(requested, self.cfg.context_tokens)[0]


def resolve_run(cfg: ThroughputConfig, loaded: LoadedModel | None = None,
                shared_kv: SyntheticKVCache | None = None) -> ResolvedRun:
    """Resolve `cfg` into a ResolvedRun: load the model (unless given), check the context window, build the method
    and its budget plan, choose the batch (`auto`: the plan's) and check it against free memory (check_memory),
    the one memory check of the run. A prefill kept in `shared_kv` gives its memory back first where the run needs
    it: always for `--batch auto` (the plan takes what is free), otherwise where the run would not fit beside it."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    use_cuda_graphs(cfg.cuda_graphs, device)
    if loaded is None:
        loaded = load_model(cfg.model, device, dtype, cfg.seed)
    check_context_fits(cfg, loaded)
    requested = build_method(cfg.method, cfg.method_args)
    method, budget_plan = dense_if_budget_covers(requested, cfg.context_tokens)
    try:
        if shared_kv is not None and cfg.batch == "auto":
            shared_kv.clear()
        batch, auto_plan = plan_auto_batch(cfg, method, loaded) if cfg.batch == "auto" else (int(cfg.batch), None)
        if shared_kv is not None:
            shared_kv.make_room(sum(memory_need(cfg, method, loaded, batch).values()))
        check_memory(cfg, method, loaded, batch, planned=auto_plan is not None)
    finally:
        method.close()
        if requested is not method:
            requested.close()
    return ResolvedRun(cfg, loaded, device, dtype, budget_plan, batch, auto_plan)


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
    import contextlib

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


def plan_auto_batch(cfg: ThroughputConfig, method: AttentionMethod, loaded: LoadedModel) -> tuple[int, Any]:
    """`--batch auto`: the method's largest batch for --gpu-mem (default: the CUDA device's usable memory) and
    --host-mem (default: this machine's available memory), and the plan it comes from."""
    from scoutbench.planning import auto_batch, available_host_bytes, device_free_bytes, plan_method

    device = next(loaded.model.parameters()).device
    dtype = next(loaded.model.parameters()).dtype
    config = loaded.model.config
    gpu_mem = cfg.gpu_mem if cfg.gpu_mem is not None else device_free_bytes(device)
    host_mem = cfg.host_mem if cfg.host_mem is not None else available_host_bytes()
    planning_args = (method, ModelShape.from_config(config), cfg.context_tokens, dtype.itemsize,
                     gpu_mem, host_mem, bool(getattr(config, "tie_word_embeddings", False)))
    return auto_batch(*planning_args), plan_method(*planning_args)


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
                         "warmup": cfg.warmup, "seed": cfg.seed, "prefill": cfg.prefill, "kv_skew": cfg.kv_skew},
            "device": device}


def _run_at_batch(run: ResolvedRun, batch: int, on_progress: ProgressCallback | None,
                  shared_kv: SyntheticKVCache | None = None, oom_backoff: bool = False) -> dict[str, Any]:
    """One measured run of `run` at `batch`; out-of-memory errors propagate when the caller backs off."""
    cfg, loaded, device, dtype, budget_plan = run.cfg, run.loaded, run.device, run.dtype, run.budget_plan
    requested, method = run.build()
    workload = SyntheticWorkload(cfg.length, batch, cfg.steps, cfg.warmup, cfg.seed,
                                 resolve_prefill(cfg.prefill, loaded), cfg.kv_skew)
    from scoutbench.engine import DecodeEngine

    def report(phase: str) -> Callable[[int, int], None] | None:
        return None if on_progress is None else lambda done, total: on_progress(phase, done, total)

    if shared_kv is not None:
        shared_kv.make_room(sum(memory_need(cfg, method, loaded, batch).values()))
    engine = DecodeEngine(loaded.model, method)
    timer = engine.timer
    timer.nvtx = cfg.nvtx and device.type == "cuda"
    total_steps = workload.warmup + workload.steps
    profiled_steps = cfg.profile_steps if cfg.profile_dir is not None else 0
    calls_per_step = replays_per_step = None
    graphs_on = use_cuda_graphs(cfg.cuda_graphs, device)
    captures_before_timing = 0
    records: list[dict[str, float]] = []
    nvml = nvml_summary = profile = None
    attention_backends.reset()  # also counted when there are no warm-up steps
    try:
        engine.start(workload.batch, workload.total_tokens + cfg.count_steps + profiled_steps, cuda_graphs=graphs_on)
        if on_progress is not None:  # phases start now: their elapsed time and ETA count from here
            on_progress("prefill", 0, engine.num_layers)
        start = time.perf_counter()
        kv_reused = None  # a real prefill draws nothing
        if workload.prefill == "real":
            logits = engine.prefill(workload.prompt_ids(loaded.model.config.vocab_size), on_layer=report("prefill"))
            tokens = logits.argmax(-1)
        else:
            lengths = torch.full((workload.batch,), workload.length, dtype=torch.long)
            kv_reused = engine.prefill_synthetic(lengths, cfg.seed, key_skew=workload.kv_skew,
                                                 on_layer=report("prefill"), shared_kv=shared_kv)
            tokens = workload.first_tokens(loaded.model.config.vocab_size).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        prefill_ms = (time.perf_counter() - start) * 1e3
        if on_progress is not None:
            on_progress("decode", 0, total_steps)
        for index in range(total_steps):
            if index == workload.warmup:
                method.reset_stats()
                attention_backends.reset()
                captures_before_timing = len(engine.graphs.schedules) if engine.graphs is not None else 0
                if device.type == "cuda":
                    nvml = NvmlSampler(device.index or 0, cfg.nvml_interval_ms).__enter__()
            timer.begin_step()
            tokens = engine.decode_step(tokens).argmax(-1)
            record = timer.end_step()
            if index >= workload.warmup:
                records.append(record)
            if on_progress is not None:
                on_progress("decode", index + 1, total_steps)
        stats = method.stats()
        backends_used = attention_backends.snapshot()
        timed_captures = len(engine.graphs.schedules) - captures_before_timing if engine.graphs is not None else 0
        graphs = graph_fields(engine, timed_captures)
        if nvml is not None:  # the counted and profiled steps below are no part of the measurement
            nvml.__exit__(None, None, None)
            nvml_summary, nvml = nvml.summary(tokens=workload.batch * len(records)), None
        tokens, calls_per_step, replays_per_step = count_calls(engine, tokens, cfg.count_steps)
        if profiled_steps:
            from scoutbench.profiling import profile_decode

            stem = (f"throughput_{cfg.method}_{cfg.model.replace('/', '--')}_len{format_length(cfg.length)}"
                    f"_b{workload.batch}")  # the result file's name in a folder (cli/throughput.py)
            profile = profile_decode(engine, tokens, profiled_steps, cfg.profile_dir, stem)
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
    finally:
        if nvml is not None:  # also on errors: never leave the sampler thread running
            nvml.__exit__(None, None, None)
        method.close()
    return {
        **envelope("throughput", cfg.command), "status": "ok", "error": None,
        "method": cfg.method, "method_config": requested.config(), "method_repr": repr(requested),
        **budget_plan.result_fields(), "dense_layers": dense_layers_of(requested),
        "model": loaded.describe(dtype), "workload": workload.describe(),
        "kv_source": workload.kv_source(cfg.model), "device": device_description(device),
        "prefill_ms": prefill_ms, "prefill_kv_reused": kv_reused, **tier_fields(device),
        **summarise_steps(records, workload.batch, device.type),
        **host_fields(records, calls_per_step, cfg.count_steps, replays_per_step), **graphs,
        "nvml": nvml_summary, "profile": profile, "method_stats": stats,
        "attention_backends": backends_used,
    }

"""A throughput run's configuration and its resolution, every choice made once at the edge (the CLI, a sweep's
runner): `ThroughputConfig` (what was asked) -> `resolve_run` (model, device, dtype, method and its budget plan,
the batch, `--batch auto`'s plan, the context window and the one free-memory check) -> `ResolvedRun`, which
`bench/throughput.py` measures without deciding anything again."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from scoutbench.devices import resolve_device, resolve_dtype
from scoutbench.errors import ScoutbenchError, UsageError
from scoutbench.methods import build_method
from scoutbench.methods.base import AttentionMethod, ModelShape
from scoutbench.methods.sparse import BudgetPlan, dense_if_budget_covers
from scoutbench.models import LoadedModel, load_model
from scoutbench.units import format_length
from scoutbench.workloads.synthetic import DEFAULT_KV_SKEW

if TYPE_CHECKING:  # a type only: the kept synthetic K/V sit with the engine, imported where a run starts
    from scoutbench.workloads.synthetic_kv import SyntheticKVCache


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
    # adds host time to every call, so it never runs in a timed step); 0: not counted
    count_steps: int = 8
    # time each method's per-block work as an amortised step (bench/throughput.py): the window opens on a block
    # event, after untimed alignment steps, where it does not span whole block cycles
    amortise_blocks: bool = False
    # on: decode steps replay piecewise CUDA graphs (scoutbench/decode/graphs.py); off: eager; auto: on where the
    # device is CUDA
    cuda_graphs: str = "auto"
    nvtx: bool = False  # an NVTX range per stage on CUDA (Nsight Systems); off by default (a cost per stage)
    command: list[str] = field(default_factory=lambda: list(sys.argv))

    @property
    def context_tokens(self) -> int:
        """Tokens each sequence's cache holds by the last timed step: prompt + warm-up + timed steps."""
        return self.length + self.warmup + self.steps

    @property
    def profiled_steps(self) -> int:
        """The untimed steps under torch.profiler after the counted ones: `profile_steps` with --profile, else 0."""
        return self.profile_steps if self.profile_dir is not None else 0

    @property
    def stored_tokens(self) -> int:
        """Tokens each sequence's storage holds: `context_tokens` plus the untimed counted and profiled steps."""
        return self.context_tokens + self.count_steps + self.profiled_steps


CUDA_GRAPH_MODES = ("auto", "on", "off")


def check_cuda_graphs(mode: str, device: torch.device) -> None:
    """Refuse a `--cuda-graphs` mode that is unknown, or `on` for a device that is not CUDA (the API checks it
    before loading anything; `use_cuda_graphs` decides it)."""
    if mode not in CUDA_GRAPH_MODES:
        raise UsageError(f"--cuda-graphs {mode!r}: use one of {', '.join(CUDA_GRAPH_MODES)}")
    if mode == "on" and device.type != "cuda":
        raise UsageError(f"--cuda-graphs on needs a CUDA device (this run's is {device.type}): use --cuda-graphs "
                         "auto or off")


def use_cuda_graphs(mode: str, device: torch.device) -> bool:
    """Whether a run replays CUDA graphs: `auto` where the device is CUDA; `on` refuses any other device."""
    check_cuda_graphs(mode, device)
    return mode != "off" and device.type == "cuda"


def resolve_prefill(mode: str, model: LoadedModel | str) -> str:
    """The one prefill default of every command (`throughput`, `sweep`, its presets, the API): `auto` fills a
    random-weight preset's cache synthetically, since it has nothing to learn from a real prefill (random text
    through random weights, minutes at 64k on a CPU), and prefills a real model's prompt. `model` is the loaded
    model or its name (`ID@REV` too): only the built-in presets have random weights, so the name decides before
    anything loads (a sweep records the resolved prefill in its settings)."""
    if mode != "auto":
        return mode
    if isinstance(model, str):
        from scoutbench.models import PRESETS, split_reference

        return "synthetic" if split_reference(model)[0] in PRESETS else "real"
    return "synthetic" if model.random_weights else "real"


def storage_tokens(cfg: ThroughputConfig, method: AttentionMethod) -> int:
    """Tokens each sequence's storage holds with `method` (the engine's `max_len`, the memory plan's context):
    `cfg.stored_tokens` plus the room an amortised window's alignment steps may take (a block cycle and one)."""
    cycle = method.block_cycle()
    return cfg.stored_tokens + (cycle + 1 if cfg.amortise_blocks and cycle is not None else 0)


def memory_need(cfg: ThroughputConfig, method: AttentionMethod, loaded: LoadedModel, batch: int) -> dict[str, int]:
    """Bytes the run will allocate beyond the loaded weights, from the planner's footprint functions: the
    method's device and host tiers plus the per-sequence workspace, for every token its storage holds."""
    from scoutbench.planning import workspace_bytes_per_seq

    dtype = next(loaded.model.parameters()).dtype
    shape = ModelShape.from_config(loaded.model.config)
    context_len = storage_tokens(cfg, method)
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


def check_context_fits(cfg: ThroughputConfig, loaded: LoadedModel | None = None, prefill: str | None = None) -> None:
    """A real prefill of a real model past its trained window measures attention the model never learned (every
    sparse method's selection then runs on noise): refused, pointing at a synthetic prefill, which only times the
    decode over that many positions. Before loading (`loaded` None) only built-in real models' windows are known;
    after it, `prefill` is the run's resolved one."""
    from scoutbench.models import check_context, context_window, loaded_context_window

    if loaded is None:
        window, real = context_window(cfg.model), cfg.prefill != "synthetic"
    else:
        window, real = loaded_context_window(loaded), (prefill or resolve_prefill(cfg.prefill, loaded)) == "real"
    if not real:
        return
    check_context(cfg.model, window, cfg.context_tokens,
                  f"--len {format_length(cfg.length)} plus {cfg.warmup + cfg.steps} decode steps",
                  "lower --len, or pass --prefill synthetic to time decode at that length")


@dataclass(frozen=True)
class ResolvedRun:
    """One throughput run with every choice made, once, at the edge (the CLI, a sweep's runner): the loaded model
    with its device and dtype, the method's configuration and its budget plan (FullKV runs when the budget covers
    the context: methods.sparse.dense_if_budget_covers), the batch (`--batch auto`: planned, with the plan), the
    prefill (`resolve_prefill`), whether decode replays CUDA graphs (`use_cuda_graphs`), the CUDA-only
    instrumentation (NVTX ranges, NVML sampling) and a passed free-memory check. `run_throughput` executes it and
    decides nothing again."""

    cfg: ThroughputConfig
    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype
    budget_plan: BudgetPlan
    batch: int
    prefill: str  # "real" or "synthetic"
    cuda_graphs: bool
    nvtx: bool  # an NVTX range per stage (--nvtx on a CUDA device)
    nvml: bool  # NVML telemetry sampled over the timed steps (a CUDA device)
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
    cuda_graphs = use_cuda_graphs(cfg.cuda_graphs, device)
    if loaded is None:
        loaded = load_model(cfg.model, device, dtype, cfg.seed)
    prefill = resolve_prefill(cfg.prefill, loaded)
    check_context_fits(cfg, loaded, prefill)
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
    return ResolvedRun(cfg, loaded, device, dtype, budget_plan, batch, prefill, cuda_graphs,
                       nvtx=cfg.nvtx and device.type == "cuda", nvml=device.type == "cuda", auto_plan=auto_plan)


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

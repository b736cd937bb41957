"""The Python API: what the CLI does, as functions that return results instead of printing them.

    from scoutbench import api

    runs = api.throughput(["fullkv", "scout"], model="tiny-qwen3", length=4096, steps=8, budget=1024)
    points = api.accuracy(["passkey"], ["fullkv", "scout"], model="smollm2-135m", length=1024, limit=2,
                          out_dir="results/accuracy")
    results = api.load_results("results/ablation")
    method = api.build_method("scout", budget=1024, block_size=32)   # for your own decode loop (README)

Every result is the dict the CLI writes as JSON (docs/results.md), with the same provenance. `scoutbench throughput`
and `scoutbench accuracy` are these functions plus their options, tables and files: the configurations are built and
checked here (`throughput_configs`), methods run here (`run_throughput_configs`) and accuracy tasks are read and
built here (`accuracy_records`, `accuracy_tasks`), so the two ways of running give the same numbers.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from scoutbench.environment import check_environment
from scoutbench.errors import UsageError

if TYPE_CHECKING:
    from scoutbench.bench.throughput import ThroughputConfig
    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.methods.base import AttentionMethod
    from scoutbench.models import LoadedModel

# The no-argument throughput run, per device type. CUDA: the paper's setup (Qwen3-14B shape, bf16, every method's
# default budget 2048 and block 32). CPU: bench-attn16, the paper models' dense share (2 of 16 layers) and GQA group
# (4) with a small hidden size, so that attention dominates a step as at long context on a GPU; every method in
# about a minute on 2 cores. Both at 32k with a synthetic prefill (the weights are random), every method with the
# same dense layers.
DEFAULT_MODELS = {"cuda": "qwen3-14b", "cpu": "bench-attn16"}
DEFAULT_LENGTH = 32 * 1024
# (timed, warm-up) decode steps: fewer on a CPU, where a 32k FullKV step of bench-attn16 takes over 100 ms; the timed
# ones at least, rounded up to whole block cycles of the compared methods (32 with the defaults: `whole_cycle_steps`)
DEFAULT_STEPS = {"cuda": (16, 3), "cpu": (8, 2)}


def whole_cycle_steps(least: int, cycles: Sequence[int | None]) -> int:
    """The default timed steps: at least `least`, in whole block cycles of every compared method (the least common
    multiple of their `block_cycle`s), so that the window holds each method's per-block work at its real rate."""
    unit = math.lcm(*(c for c in cycles if c)) if any(cycles) else 1
    return math.ceil(least / unit) * unit


def _names(values: str | Sequence[str], what: str, example: str) -> list[str]:
    """One name or a list of them; none at all is a usage error (it used to end in a bare IndexError)."""
    names = [values] if isinstance(values, str) else list(values)
    if not names:
        raise UsageError(f"no {what} given: pass at least one, e.g. {example}")
    return names


# What the API runs on, imported on first use (importing scoutbench.api costs nothing). Two threads that called the
# API first at once raced inside transformers' lazy module (`ImportError: cannot import name
# 'AutoModelForCausalLM'`: its import-deadlock guard fired), so the first call imports it all under one lock, the
# names transformers resolves lazily and the decoders scoutbench runs included; later calls find them imported.
RUNTIME_MODULES = ("torch", "transformers", "scoutbench.models", "scoutbench.decode.engine",
                   "scoutbench.bench.throughput", "scoutbench.eval.accuracy", "scoutbench.eval.generation")
TRANSFORMERS_NAMES = ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "AttentionInterface", "LlamaConfig",
                      "Qwen3Config")
_RUNTIME_LOCK = threading.Lock()
_runtime_imported = False
_Function = TypeVar("_Function", bound=Callable[..., Any])


def _import_runtime() -> None:
    global _runtime_imported
    if _runtime_imported:
        return
    with _RUNTIME_LOCK:
        if _runtime_imported:
            return
        for name in RUNTIME_MODULES:
            importlib.import_module(name)
        from scoutbench.models import SUPPORTED_ARCHITECTURES

        transformers = sys.modules["transformers"]
        for name in TRANSFORMERS_NAMES:
            getattr(transformers, name)
        for arch in SUPPORTED_ARCHITECTURES:
            importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        _runtime_imported = True


def _runs_models(function: _Function) -> _Function:
    """An API entry point that loads or runs a model: the environment checked (as every command checks it first)
    and the runtime imported, once, thread-safely."""
    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        check_environment()
        _import_runtime()
        return function(*args, **kwargs)

    return checked  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- models, methods
@_runs_models
def load_model(name: str, *, revision: str | None = None, device: str = "auto", dtype: str | None = None,
               seed: int = 0) -> LoadedModel:
    """A model as every command loads it: a preset (random weights, seeded), a built-in real model, a local folder
    or a Hugging Face id (`revision`: a commit, branch or tag). `.model` is the transformers model, `.tokenizer`
    its tokenizer (None for presets), `.describe(dtype)` what results record about it."""
    from scoutbench.devices import resolve_device, resolve_dtype
    from scoutbench.models import load_model as load
    from scoutbench.models import model_reference

    resolved = resolve_device(device)
    return load(model_reference(name, revision), resolved, resolve_dtype(dtype, resolved), seed)


@_runs_models
def build_method(name: str, *, budget: int | None = None, block_size: int | None = None,
                 dense_layers: int | None = None, **fields: Any) -> AttentionMethod:
    """A registered method (`scoutbench methods` lists them and their fields) with its fields set: `budget`,
    `block_size` and `dense_layers` as the CLI's shared flags set them (only for a method that has the field),
    any other field by name. The object follows the method contract (docs/architecture.md): `DecodeEngine(model,
    method)` runs it in a decode loop of your own."""
    from scoutbench.method_args import MethodSettings, resolve_method_args
    from scoutbench.methods import build_method as build

    settings = MethodSettings.of(fields, budget=budget, block_size=block_size, dense_layers=dense_layers)
    return build(name, resolve_method_args([name], settings)[name])


@_runs_models
def decode_engine(loaded: LoadedModel, method: AttentionMethod, batch: int, max_len: int) -> DecodeEngine:
    """The engine every command decodes with, running `method` on `loaded`'s model, started for `batch` sequences of
    up to `max_len` tokens: `prefill(input_ids)` (the prompts' last logits) then `decode_step(tokens)` as often as
    you like; `method.stats()` has the method's counters. The caller owns it: use it as a context manager (`with
    decode_engine(...) as engine:`), whose end closes the method (its workers and host memory) on every path; a
    start that fails closes it here."""
    from scoutbench.decode.engine import DecodeEngine

    engine = DecodeEngine(loaded.model, method)
    with engine.closed_on_failure():
        engine.start(batch=batch, max_len=max_len)
    return engine


# ---------------------------------------------------------------------------------------------- throughput
@_runs_models
def throughput_configs(methods: str | Sequence[str], *, model: str | None = None, revision: str | None = None,
                       length: int = DEFAULT_LENGTH, batch: int | str = 1, gpu_mem: int | None = None,
                       host_mem: int | None = None, steps: int | None = None, warmup: int | None = None,
                       device: str = "auto", dtype: str | None = None, seed: int = 0, prefill: str = "auto",
                       kv_skew: float | None = None, budget: int | None = None, block_size: int | None = None,
                       dense_layers: int | None = None, method_args: Mapping[str, Any] | None = None,
                       **run_options: Any) -> list[ThroughputConfig]:
    """One checked `ThroughputConfig` per method: the model, steps and warm-up default to the device's (the
    no-argument run of `scoutbench throughput`), the shared settings go to the methods that have them, and every
    method's fields, workload and context are checked before anything loads. `run_options` are the config's other
    fields (`force`, `profile_dir`, `count_steps`, `cuda_graphs`, `nvtx`, `command`, ...)."""
    from scoutbench.bench.resolve import ThroughputConfig, check_context_fits, check_cuda_graphs
    from scoutbench.devices import resolve_device, resolve_dtype
    from scoutbench.method_args import MethodSettings, check_methods_fit, resolve_method_args
    from scoutbench.methods import METHODS
    from scoutbench.methods import build_method as build
    from scoutbench.models import model_reference
    from scoutbench.workloads.synthetic import DEFAULT_KV_SKEW, SyntheticWorkload

    resolved = resolve_device(device)
    check_cuda_graphs(run_options.get("cuda_graphs", "auto"), resolved)
    kind = "cuda" if resolved.type == "cuda" else "cpu"
    if revision is not None and model is None:
        raise UsageError("--revision pins the weights of a Hugging Face --model; pass --model ID too")
    model = model_reference(model or DEFAULT_MODELS[kind], revision)
    warmup = DEFAULT_STEPS[kind][1] if warmup is None else warmup
    if batch == "auto" and gpu_mem is None and resolved.type != "cuda":
        raise UsageError("--batch auto needs --gpu-mem when the device is not CUDA (e.g. --gpu-mem 2GiB)")
    resolve_dtype(dtype, resolved)
    names = [METHODS.canonical(name) for name in _names(methods, "methods", "['fullkv', 'scout']")]
    per_method = resolve_method_args(names, MethodSettings.of(method_args, budget=budget, block_size=block_size,
                                                              dense_layers=dense_layers))
    if steps is None:
        steps = whole_cycle_steps(DEFAULT_STEPS[kind][0], [build(name, per_method[name]).block_cycle()
                                                           for name in names])
    configs = [ThroughputConfig(method=name, method_args=per_method[name], model=model, length=length, batch=batch,
                                gpu_mem=gpu_mem, host_mem=host_mem, steps=steps, warmup=warmup, device=device,
                                dtype=dtype, seed=seed, prefill=prefill,
                                kv_skew=DEFAULT_KV_SKEW if kv_skew is None else kv_skew, **run_options)
               for name in names]
    methods = []
    for cfg in configs:  # every method's fields and workload checked before loading anything
        SyntheticWorkload(cfg.length, 1 if cfg.batch == "auto" else cfg.batch, cfg.steps, cfg.warmup, cfg.seed,
                          "real", cfg.kv_skew)
        methods.append(build(cfg.method, cfg.method_args))
        check_context_fits(cfg)
    check_methods_fit(methods, model)
    return configs


@_runs_models
def run_throughput_configs(configs: list[ThroughputConfig], *, loaded: LoadedModel | None = None,
                           on_result: Callable[[ThroughputConfig, dict[str, Any]], None] | None = None,
                           on_status: Callable[[str], None] | None = None,
                           on_progress: Callable[[str, int, int], None] | None = None) -> list[dict[str, Any]]:
    """Run each config on one model (`loaded`, or loaded here) and return its result (`bench.throughput.run_methods`:
    a method refused before the runs or failing in its run gets a failed result, `status: failed` and its error, and
    the next method runs). `on_result(cfg, result)` sees each result as soon as its method finishes (write it there:
    an interruption then keeps every finished result); `on_status` gets one-line messages, `on_progress(label,
    done, total)` each phase's progress."""
    from scoutbench.bench.throughput import run_methods
    from scoutbench.devices import resolve_device, resolve_dtype
    from scoutbench.models import load_model as load

    if not configs:
        raise UsageError("no configs given: make them with api.throughput_configs(['fullkv', ...], ...)")
    if loaded is None:
        first = configs[0]
        device = resolve_device(first.device)
        loaded = load(first.model, device, resolve_dtype(first.dtype, device), first.seed)
    progress = None if on_progress is None else \
        (lambda where: lambda phase, done, total: on_progress(f"{where} {phase}", done, total))
    results = []
    for cfg, result in run_methods(configs, loaded, on_status or (lambda line: None), progress):
        if on_result is not None:
            on_result(cfg, result)
        results.append(result)
    return results


@_runs_models
def throughput(methods: str | Sequence[str] = ("fullkv", "scout"), **settings: Any) -> list[dict[str, Any]]:
    """Decode throughput of each method at one point, as `scoutbench throughput` measures it: one result dict per
    method (failed ones have `status: failed` and their `error`). `settings` are `throughput_configs`' (model,
    revision, length, batch, steps, warmup, device, dtype, seed, prefill, budget, block_size, dense_layers,
    method_args, ...). Nothing is written; `scoutbench.results.write_json_atomic` writes a result as the CLI does."""
    return run_throughput_configs(throughput_configs(methods, **settings))


# ---------------------------------------------------------------------------------------------- accuracy
@_runs_models
def accuracy_records(names: Iterable[str], data_dir: str | Path | None = None, data_revision: str | None = None,
                     limit: int | None = None) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """The records of each dataset in `names` whose suite reads data (the first `limit`), and where each came from
    (LongBench: a folder, a parquet mirror or the hub archive at `data_revision`); passkey tasks are generated, not
    read. Read before any model loads: a data file that cannot be used is refused (exit 2) in seconds."""
    from scoutbench.workloads import suite_for

    records, sources = {}, {}
    for name in names:
        loaded = suite_for(name).load_records(name, data_dir, data_revision)
        if loaded is None:
            continue
        rows, sources[name] = loaded
        records[name] = rows[:limit]
    return records, sources


@_runs_models
def accuracy_tasks(names: Iterable[str], loaded: LoadedModel, records: Mapping[str, list[dict[str, Any]]],
                   sources: Mapping[str, Any], max_length: int | None, length: int, limit: int | None = None,
                   depth: float | None = None, seed: int = 0) -> list[Any]:
    """The tasks of `names` for `loaded`'s tokenizer, each built by its suite: LongBench tasks of `records`,
    truncated to `max_length` tokens, and passkey tasks of `length` tokens (`limit` samples, 10 by default, at
    `depth`)."""
    from scoutbench.workloads import suite_for
    from scoutbench.workloads.suite import TaskSettings

    settings = TaskSettings(max_length, length, limit, depth, seed)
    return [suite_for(name).task(name, loaded.tokenizer, records.get(name), sources.get(name), settings)
            for name in names]


def default_max_length(names: Iterable[str], loaded: LoadedModel) -> int | None:
    """The prompt limit of `names` when none is given: the first of their suites' own (LongBench's official rule
    for the model's window); None when no suite has one."""
    from scoutbench.workloads import suite_for

    for name in names:
        limit = suite_for(name).default_max_length(loaded.name, loaded.model.config)
        if limit is not None:
            return limit
    return None


@_runs_models
def accuracy(datasets: str | Sequence[str], methods: str | Sequence[str] = ("fullkv",), *,
             model: str = "smollm2-135m", revision: str | None = None, budgets: Sequence[int] | None = None,
             block_size: int | None = None, dense_layers: int | None = None,
             method_args: Mapping[str, Any] | None = None, device: str = "auto", dtype: str | None = None,
             seed: int = 0, data_dir: str | Path | None = None, data_revision: str | None = None,
             limit: int | None = None, max_length: int | None = None, length: int = 4096,
             depth: float | None = None, fidelity_steps: int = 0, out_dir: str | Path = "results/accuracy",
             on_progress: Callable[[str, int, int], None] | None = None) -> list[dict[str, Any]]:
    """Accuracy of each method (at each of `budgets`) on LongBench datasets or passkey, compared with FullKV, as
    `scoutbench accuracy` runs it: predictions are written under `out_dir` (resumable: a rerun skips finished
    records) and one result dict per method configuration is returned (its `results[dataset]` holds the score).
    `length` is the passkey prompt length; LongBench prompts are truncated to `max_length` (default: the official
    rule for the model's window)."""
    from scoutbench.eval.accuracy import run_comparison
    from scoutbench.eval.generation import method_specs
    from scoutbench.method_args import check_methods_fit
    from scoutbench.models import context_window, loaded_context_window, model_reference
    from scoutbench.results import output_lock

    names = _names(datasets, "datasets", "['passkey']")
    specs = method_specs(list(dict.fromkeys(_names(methods, "methods", "['fullkv', 'scout']"))), dict(method_args or {}),
                         None if budgets is None else list(budgets), dense_layers, block_size)
    records, sources = accuracy_records(names, data_dir, data_revision, limit)
    check_methods_fit([spec.build() for spec in specs], model_reference(model, revision))
    check_accuracy_context(names, model, context_window(model), length, max_length)  # a built-in's, before loading
    with output_lock(out_dir):
        loaded = load_model(model, revision=revision, device=device, dtype=dtype, seed=seed)
        if loaded.tokenizer is None:
            raise UsageError(f"model {model!r} has no tokenizer; accuracy tasks need text (use smollm2-135m)")
        if max_length is None:
            max_length = default_max_length(names, loaded)
        check_accuracy_context(names, loaded.name, loaded_context_window(loaded), length, max_length)
        tasks = accuracy_tasks(names, loaded, records, sources, max_length, length, limit, depth, seed)
        outcomes = run_comparison(tasks, loaded, specs, out_dir, max_length, seed, limit, on_progress=on_progress,
                                  fidelity_steps=fidelity_steps)
    return [result for result, _ in outcomes]


def check_accuracy_context(names: Iterable[str], model: str, window: int | None, length: int,
                           max_length: int | None) -> None:
    """Prompts plus answers must fit the model's trained window (past it a passkey scores 0 without a word), as
    each dataset's suite sizes them: passkey prompts are sized to `length`, LongBench prompts are middle-truncated
    to `max_length` (as the official pred.py does; the default leaves the official 500 tokens for the chat wrapper
    and the answer)."""
    from scoutbench.workloads import suite_for
    from scoutbench.workloads.suite import TaskSettings

    settings = TaskSettings(max_length=max_length, length=length)
    for name in names:
        suite_for(name).check_context(name, model, window, settings)


# ---------------------------------------------------------------------------------------------- results
def load_results(*paths: str | Path, skipped: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """Every scoutbench result under `paths` (files, folders, sweep folders), validated as `report` and `gate`
    read them; each has `_path`, the file it came from. Files that are not results (or not of this schema) are
    left out, with why, in `skipped` when given; without it an unreadable result file is an error."""
    from scoutbench.results import load_results as load

    check_environment()
    on_skip = None if skipped is None else (lambda file, why: skipped.append((str(file), why)))
    return load(paths, on_skip=on_skip)

"""`scoutbench accuracy`, `scoutbench score` and `scoutbench fidelity`. Heavy imports happen inside the commands."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from scoutbench.cli.options import SEED, parse_method_args
from scoutbench.errors import UsageError

LENGTH_HELP = "tokens; k = 1024 (4k = 4096)"
BUDGET_HELP = ("Token budget: sets the `budget` field of the sparse methods; "
               "methods without one (fullkv) reject it")


def _parse_len(text: str | None, flag: str = "--len") -> int | None:
    from scoutbench.units import parse_length

    return None if text is None else parse_length(text, flag)


def _load(model: str, device: str, dtype: str | None, seed: int):
    from scoutbench.models import load_model
    from scoutbench.throughput import resolve_device, resolve_dtype

    resolved = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, resolved)
    return load_model(model, resolved, torch_dtype, seed=seed), torch_dtype


def _common_options(func):
    options = [
        click.option("--method", default="fullkv", show_default=True, help="Attention method (scoutbench methods)."),
        click.option("--model", default="smollm2-135m", show_default=True,
                     help="smollm2-135m or qwen2.5-0.5b (real, offline), a local folder or a Hugging Face id."),
        click.option("--budget", default=None, help=BUDGET_HELP),
        click.option("--dense-layers", default=None, type=click.IntRange(min=0),
                     help="First layers the sparse method keeps dense (default: the methods' shared 2)."),
        click.option("--method-arg", "method_args", multiple=True, metavar="KEY=VALUE",
                     help="Set a method field (repeatable)."),
        click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N]."),
        click.option("--dtype", default=None,
                     help="float32|bfloat16|float16 (fp32/bf16/fp16); default fp32 on CPU, bf16 on CUDA."),
        click.option("--seed", default=0, show_default=True, type=SEED, help="Seed for synthetic prompts."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


# ---------------------------------------------------------------------------------------------- accuracy
def _expand_datasets(names: tuple[str, ...]) -> list[str]:
    import difflib

    from scoutbench.workloads import longbench, passkey

    known = [*longbench.DATASETS, *longbench.E_DATASETS, *passkey.TASKS, "all"]
    expanded: list[str] = []
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"unknown --dataset {name!r}{hint} (LongBench: {', '.join(longbench.DATASETS)}, their "
                             "_e variants, or 'all'; or passkey, passkey-multi)")
        for item in (longbench.DATASETS if name == "all" else (name,)):
            if item not in expanded:
                expanded.append(item)
    return expanded


@click.command("accuracy")
@click.option("--dataset", "datasets", multiple=True, required=True,
              help="LongBench dataset (any of v1's 21, e.g. qasper, hotpotqa, lcc, or a LongBench-E file such as "
                   "qasper_e), 'all' (the 21 v1 datasets), passkey or passkey-multi. Repeatable.")
@_common_options
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of official LongBench <name>.jsonl files (default: the hub archive, when online).")
@click.option("--limit", type=int, default=None, help="Only the first N records (passkey: N prompts, default 10).")
@click.option("--max-length", "max_length", default=None,
              help=f"LongBench prompt limit before middle truncation ({LENGTH_HELP}); default per model.")
@click.option("--len", "context_len", default="1k", show_default=True,
              help=f"Passkey prompt length ({LENGTH_HELP}).")
@click.option("--depth", type=float, default=None, help="Passkey needle depth in [0, 1] (default: spread).")
@click.option("-o", "--output", "out_dir", default="results/runs/accuracy", show_default=True,
              help="Output folder (predictions + result.json).")
@click.option("--json", "as_json", is_flag=True, help="Print the result JSON instead of a table.")
def command(datasets, method, model, budget, dense_layers, method_args, device, dtype, seed, data_dir, limit,
            max_length, context_len, depth, out_dir, as_json) -> None:
    """Accuracy of a method on LongBench (official prompts, truncation and metrics) or passkey retrieval.

    Predictions are resumable: rerunning the same command skips finished samples.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from scoutbench.accuracy import run_accuracy
    from scoutbench.generation import method_spec
    from scoutbench.models import PRESETS
    from scoutbench.results import check_writable
    from scoutbench.throughput import resolve_device, resolve_dtype
    from scoutbench.workloads import longbench, passkey

    # every option is checked before the model loads (a minute for a real model) and before any data is read
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be at least 1, got {limit}")
    names = _expand_datasets(datasets)
    spec = method_spec(method, parse_method_args(method_args), _parse_len(budget, "--budget"), dense_layers)
    passkey_len = _parse_len(context_len, "--len")
    length_limit = _parse_len(max_length, "--max-length")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise UsageError(f"--depth must be between 0 and 1, got {depth}")
    if model in PRESETS:
        raise UsageError(f"model {model!r} has random weights and no tokenizer; accuracy tasks need text "
                         "(use smollm2-135m, a local folder or a Hugging Face id)")
    resolve_dtype(dtype, resolve_device(device))
    records = {}
    for name in names:
        if name in passkey.TASKS:
            continue
        try:
            records[name] = longbench.load_records(name, data_dir)[:limit]
        except UnicodeDecodeError as exc:
            raise UsageError(f"the {name} data is not UTF-8 text (byte {exc.start}); use the official LongBench "
                             "files") from None
    for name, rows in records.items():
        if not rows:
            raise UsageError(f"no records for {name} in {data_dir or 'the hub archive'}: the data file is empty")
    check_writable(out_dir, single_file=False)
    loaded, _ = _load(model, device, dtype, seed)
    if loaded.tokenizer is None:
        raise UsageError(f"model {model!r} has no tokenizer; accuracy tasks need text (use smollm2-135m)")
    if records and length_limit is None:
        length_limit = longbench.default_max_length(loaded.name, loaded.model.config)
    tasks: list[Any] = []
    for name in names:
        if name in passkey.TASKS:
            tasks.append(passkey.PasskeyTask(name, loaded.tokenizer, passkey_len, limit or 10, depth, seed))
        else:
            tasks.append(longbench.LongBenchTask(name, records[name], loaded.tokenizer, length_limit))

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=as_json, disable=as_json) as progress:
        bars = {task.name: progress.add_task(task.name, total=len(task.records)) for task in tasks}

        def on_progress(task_name: str, done: int, total: int) -> None:
            progress.update(bars[task_name], completed=done, total=total)

        result, path = run_accuracy(tasks, loaded, spec, out_dir, length_limit, seed, limit,
                                    command=["scoutbench", *sys.argv[1:]], on_progress=on_progress)
    if as_json:
        click.echo(path.read_text("utf-8"), nl=False)  # the file as written: strict JSON
        return
    _print_accuracy_table(console, result, [task.name for task in tasks])
    console.print(f"result: {path}")


def _print_accuracy_table(console, result: dict[str, Any], names: list[str]) -> None:
    from rich.table import Table

    table = Table(title=f"{result['method_repr']} on {result['model']['name']}")
    for column in ("dataset", "metric", "n", "score (0-100)", "buckets"):
        table.add_column(column)
    for name in names:
        entry = result["results"][name]
        buckets = " ".join(f"{k}: {v}" for k, v in entry.get("buckets", {}).items())
        table.add_row(name, entry["metric"], str(entry["n"]), f"{entry['score']:.2f}", buckets)
    console.print(table)


# ---------------------------------------------------------------------------------------------- fidelity
@click.command("fidelity")
@_common_options
@click.option("--len", "context_len", default="1k", show_default=True, help=f"Prompt length ({LENGTH_HELP}).")
@click.option("--steps", default=32, show_default=True, type=int, help="Decode steps compared per prompt.")
@click.option("--prompts", "num_prompts", default=2, show_default=True, type=int, help="Number of prompts.")
@click.option("-o", "--output", "out_file", default=None,
              help="Also write the result JSON to this file.")
@click.option("--overwrite", is_flag=True, help="Replace an existing -o file instead of failing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result JSON instead of a table.")
def fidelity_command(method, model, budget, dense_layers, method_args, device, dtype, seed, context_len, steps,
                     num_prompts, out_file, overwrite, as_json) -> None:
    """A method against FullKV on the same prompts, teacher-forced on FullKV's greedy tokens: top-1 agreement,
    KL(FullKV || method) and final-hidden-state cosine, per step and overall."""
    from rich.console import Console
    from rich.table import Table

    from scoutbench import __version__
    from scoutbench.fidelity import fidelity_prompts, measure_fidelity
    from scoutbench.generation import method_spec
    from scoutbench.results import SCHEMA_VERSION, env_info, utc_now, write_json_atomic
    from scoutbench.throughput import device_description

    if steps < 1 or num_prompts < 1:
        raise UsageError("--steps and --prompts must be at least 1")
    from scoutbench.results import check_writable

    spec = method_spec(method, parse_method_args(method_args), _parse_len(budget, "--budget"), dense_layers)
    context_tokens = _parse_len(context_len)
    if out_file:
        check_writable(out_file, overwrite, single_file=True)
    loaded, torch_dtype = _load(model, device, dtype, seed)
    prompts = fidelity_prompts(loaded, context_tokens, num_prompts, seed)
    metrics = measure_fidelity(loaded, spec, prompts, steps)
    result = {"schema_version": SCHEMA_VERSION, "kind": "fidelity", "scoutbench_version": __version__,
              "created_at": utc_now(), "command": ["scoutbench", *sys.argv[1:]], **spec.describe(),
              "model": loaded.describe(torch_dtype), "device": device_description(next(loaded.model.parameters()).device),
              "len": context_tokens, "steps": steps, "seed": seed, **metrics, "env": env_info()}
    if out_file:
        write_json_atomic(out_file, result, overwrite=overwrite)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    overall = metrics["overall"]
    table = Table(title=f"{result['method_repr']} vs FullKV, {len(prompts)} prompts of "
                        f"{metrics['prompt_tokens']} tokens, {steps} steps")
    for column in ("step", "top-1 agreement", "KL (nats)", "hidden cosine"):
        table.add_column(column, justify="right")
    for row in metrics["per_step"]:
        table.add_row(str(row["step"]), f"{row['top1_agreement']:.3f}", f"{row['kl_mean']:.4g}",
                      f"{row['hidden_cosine']:.5f}")
    table.add_row("all", f"{overall['top1_agreement']:.3f}", f"{overall['kl_mean']:.4g}",
                  f"{overall['hidden_cosine']:.5f}", style="bold")
    Console().print(table)

"""`scoutbench accuracy`, `scoutbench score` and `scoutbench fidelity`. Heavy imports happen inside the commands."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from scoutbench.cli.options import DTYPE, LENGTH, SEED, parse_method_args, revision_option, rich_console
from scoutbench.errors import UsageError
from scoutbench.method_args import BLOCK_SIZE, BUDGET, DENSE_LAYERS

LENGTH_HELP = "tokens; k = 1024 (4k = 4096)"
def _parse_len(text: str | None, flag: str = "--len") -> int | None:
    from scoutbench.units import parse_length

    return None if text is None else parse_length(text, flag)


def _load(model: str, device: str, dtype: str | None, seed: int):
    from scoutbench.devices import resolve_device, resolve_dtype
    from scoutbench.models import load_model

    resolved = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, resolved)
    return load_model(model, resolved, torch_dtype, seed=seed), torch_dtype


def _method_options(func):
    """One method, one budget (fidelity)."""
    func = click.option("--budget", default=None, type=LENGTH, help=BUDGET.help)(func)
    return click.option("--method", default="fullkv", show_default=True,
                        help="Attention method (scoutbench methods).")(func)


def _common_options(func):
    options = [
        click.option("--model", default="smollm2-135m", show_default=True,
                     help="smollm2-135m, qwen2.5-0.5b or qwen2.5-1.5b (real, offline), a local folder or a Hugging Face id."),
        click.option("--block-size", default=None, type=LENGTH, help=BLOCK_SIZE.help),
        click.option("--dense-layers", default=None, type=click.IntRange(min=0), help=DENSE_LAYERS.help),
        click.option("--method-arg", "method_args", multiple=True, metavar="KEY=VALUE",
                     help="Set a method field (repeatable; with several methods, of every method that has it)."),
        click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N]."),
        click.option("--dtype", default=None, type=DTYPE, help="Default fp32 on CPU, bf16 on CUDA."),
        click.option("--seed", default=0, show_default=True, type=SEED, help="Seed for synthetic prompts."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


# ---------------------------------------------------------------------------------------------- accuracy
def _list_datasets(as_json: bool) -> None:
    """`--dataset list`: every name --dataset accepts (each registered suite's datasets, then their groups), with
    its official metric."""
    from scoutbench.workloads import suites

    rows = [row for suite in suites() for row in suite.listing()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        click.echo(f"{row['name']:<22} {row['suite']:<12} {row['metric']}")
    for suite in suites():
        for group, (_, description) in suite.groups().items():
            click.echo(f"{group:<22} {description}")


@click.command("accuracy")
@revision_option
@click.option("--dataset", "datasets", multiple=True, required=True,
              help="LongBench dataset (any of v1's 21, e.g. qasper, hotpotqa, lcc, or a LongBench-E file such as "
                   "qasper_e), 'all' (the 21 v1 datasets), passkey or passkey-multi. Repeatable. "
                   "'list' prints them all (with their metric) and exits.")
@click.option("--method", "methods", multiple=True, default=("fullkv",), show_default=True,
              help="Attention method (scoutbench methods). Repeatable: the methods are compared side by side, "
                   "sharing one dense prefill per record.")
@click.option("--budget", "budgets", default=None,
              help=f"{BUDGET.help} Comma-separated (1k,2k): one configuration per method and budget; methods "
                   "without one (fullkv) run once.")
@_common_options
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of official LongBench <name>.jsonl files, or a parquet mirror (<name>.parquet, "
                   "<name>/**/*.parquet; needs scoutbench[datasets]) (default: the hub archive, when online).")
@click.option("--data-revision", default=None,
              help="Hub revision (branch, tag or commit) of zai-org/LongBench's data.zip (default: main; the "
                   "resolved commit is recorded).")
@click.option("--limit", type=int, default=None, help="Only the first N records (passkey: N prompts, default 10).")
@click.option("--max-length", "max_length", default=None,
              help=f"LongBench prompt limit before middle truncation ({LENGTH_HELP}); default per model.")
@click.option("--len", "context_len", default="1k", show_default=True,
              help=f"Passkey prompt length ({LENGTH_HELP}).")
@click.option("--depth", type=float, default=None, help="Passkey needle depth in [0, 1] (default: spread).")
@click.option("--fidelity-steps", type=int, default=0, show_default=True,
              help="Also teacher-force every method but FullKV on FullKV's first N generated tokens of each record "
                   "(top-1 agreement, KL); 0: off.")
@click.option("-o", "--output", "out_dir", default="results/runs/accuracy", show_default=True,
              help="Output folder (one folder per method configuration: predictions + result.json).")
@click.option("--markdown", "markdown_file", default=None, type=click.Path(dir_okay=False),
              help="Also write the comparison tables as markdown to this file.")
@click.option("--summarize", is_flag=True,
              help="Generate nothing: score the predictions already in -o (a run still in progress included, which "
                   "is left alone; n per task says how far it got) and print or write the tables.")
@click.option("--json", "as_json", is_flag=True, help="Print the result JSON instead of a table (one method; "
              "several: a JSON list).")
def command(datasets, methods, budgets, model, block_size, dense_layers, method_args, device, dtype, seed, data_dir, data_revision, limit,
            max_length, context_len, depth, fidelity_steps, out_dir, markdown_file, summarize, as_json) -> None:
    """Accuracy of one or several methods on LongBench (official prompts, truncation and metrics) or passkey
    retrieval, each compared with FullKV.

    Predictions are resumable per method configuration: rerunning the same command skips finished samples.
    """
    if "list" in datasets:  # before the imports below: listing the datasets loads no torch
        _list_datasets(as_json)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from scoutbench.api import accuracy_records, accuracy_tasks, check_accuracy_context, default_max_length
    from scoutbench.devices import resolve_device, resolve_dtype
    from scoutbench.eval.accuracy import run_comparison
    from scoutbench.eval.generation import method_specs
    from scoutbench.eval.tables import comparison_tables, tables_markdown
    from scoutbench.method_args import check_methods_fit
    from scoutbench.models import PRESETS, context_window, loaded_context_window
    from scoutbench.results import check_writable, json_text, output_lock, utc_now
    from scoutbench.workloads import resolve_datasets

    # every option is checked before the model loads (a minute for a real model) and before any data is read
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be at least 1, got {limit}")
    if fidelity_steps < 0:
        raise UsageError(f"--fidelity-steps must be 0 (off) or more, got {fidelity_steps}")
    names = resolve_datasets(datasets)  # each name through the workload registry
    budget_list = None if budgets is None else [_parse_len(b.strip(), "--budget") for b in budgets.split(",")]
    specs = method_specs(list(dict.fromkeys(methods)), parse_method_args(method_args), budget_list,
                         dense_layers, block_size)
    passkey_len = _parse_len(context_len, "--len")
    length_limit = _parse_len(max_length, "--max-length")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise UsageError(f"--depth must be between 0 and 1, got {depth}")
    if model in PRESETS:
        raise UsageError(f"model {model!r} has random weights and no tokenizer; accuracy tasks need text "
                         "(use smollm2-135m, a local folder or a Hugging Face id)")
    resolve_dtype(dtype, resolve_device(device))
    records, sources = accuracy_records(names, data_dir, data_revision, limit)
    check_methods_fit([spec.build() for spec in specs], model)
    check_accuracy_context(names, model, context_window(model), passkey_len, length_limit)
    check_writable(out_dir, single_file=False)
    if markdown_file:
        check_writable(markdown_file, overwrite=True, single_file=True)
    if not summarize:
        # the folder's writer lock before the model loads (a minute): a second run into -o stops at once; released
        # when the command ends (click closes its context), as every command holds its -o. --summarize only reads.
        click.get_current_context().with_resource(output_lock(out_dir))
    loaded, _ = _load(model, device, dtype, seed)
    if loaded.tokenizer is None:
        raise UsageError(f"model {model!r} has no tokenizer; accuracy tasks need text (use smollm2-135m)")
    if length_limit is None:
        length_limit = default_max_length(names, loaded)
    check_accuracy_context(names, model, loaded_context_window(loaded), passkey_len, length_limit)
    tasks = accuracy_tasks(names, loaded, records, sources, length_limit, passkey_len, limit, depth, seed)

    console = rich_console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=as_json, disable=as_json) as progress:
        bars = {task.name: progress.add_task(task.name, total=len(task.records)) for task in tasks}

        def on_progress(task_name: str, done: int, total: int) -> None:
            progress.update(bars[task_name], completed=done, total=total)
            if not console.is_terminal and not as_json:  # a log file (a background run): one line per record
                console.print(f"{utc_now()} {task_name}: {done}/{total} records", highlight=False)

        try:
            outcomes = run_comparison(tasks, loaded, specs, out_dir, length_limit, seed, limit,
                                      command=["scoutbench", *sys.argv[1:]], on_progress=on_progress,
                                      fidelity_steps=fidelity_steps, generate=not summarize)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: every finished prediction is on disk
            console.print(f"kept the finished predictions in {out_dir}; rerun the same command to resume")
            raise
    task_names = [task.name for task in tasks]
    results = [result for result, _ in outcomes]
    if markdown_file:
        from pathlib import Path

        from scoutbench.analysis.export import write_text

        write_text(Path(markdown_file), tables_markdown(comparison_tables(results, task_names)), overwrite=True)
    if as_json:
        if len(outcomes) == 1 and not summarize:
            click.echo(outcomes[0][1].read_text("utf-8"), nl=False)  # the file as written: strict JSON
        elif not summarize:
            click.echo("[" + ",\n".join(path.read_text("utf-8").strip() for _, path in outcomes) + "]")
        else:  # nothing was written: the results as computed
            click.echo(json_text(results if len(results) > 1 else results[0]))
        return
    stdout = rich_console()  # the result on stdout, progress and paths on stderr
    if len(results) == 1:
        _print_accuracy_table(stdout, results[0], task_names)
    else:
        _print_comparison(stdout, comparison_tables(results, task_names))
    for _, path in outcomes:
        console.print(f"result: {path}")


def _print_accuracy_table(console, result: dict[str, Any], names: list[str]) -> None:
    from rich.table import Table

    from scoutbench.cli.options import settings_note, table_caption
    from scoutbench.eval.tables import NOTE, interval_cell

    table = Table(title=f"{result['method_repr']} on {result['model']['name']}",
                  caption=table_caption(NOTE, settings_note([result])))
    for column in ("dataset", "metric", "n", "score (0-100) [95% interval]", "buckets"):
        table.add_column(column)
    for name in names:
        entry = result["results"][name]
        buckets = " ".join(f"{k}: {v}" for k, v in entry.get("buckets", {}).items())
        table.add_row(name, entry["metric"], str(entry["n"]), interval_cell(_score_interval(entry),
                                                                            value=entry["score"]), buckets)
    console.print(table)


def _score_interval(entry: dict[str, Any]):
    """The task's score interval from its per-sample values (the one bootstrap of every accuracy output)."""
    from scoutbench.analysis import bootstrap

    samples = entry.get("samples")
    return bootstrap.mean_interval([s["score"] for s in samples]) if samples else None


def _print_comparison(console, tables) -> None:
    from rich.table import Table

    for title, header, rows in tables:
        table = Table(title=title)
        for column in header:
            table.add_column(column, justify="left" if column in ("task", "metric") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


# ---------------------------------------------------------------------------------------------- fidelity
@click.command("fidelity")
@revision_option
@_method_options
@_common_options
@click.option("--len", "context_len", default="1k", show_default=True, help=f"Prompt length ({LENGTH_HELP}).")
@click.option("--steps", default=32, show_default=True, type=int, help="Decode steps compared per prompt.")
@click.option("--prompts", "num_prompts", default=2, show_default=True, type=int, help="Number of prompts.")
@click.option("-o", "--output", "out_file", default=None,
              help="Also write the result JSON to this file.")
@click.option("--overwrite", is_flag=True, help="Replace an existing -o file instead of failing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result JSON instead of a table.")
def fidelity_command(method, model, budget, block_size, dense_layers, method_args, device, dtype, seed, context_len, steps,
                     num_prompts, out_file, overwrite, as_json) -> None:
    """A method against FullKV on the same prompts, teacher-forced on FullKV's greedy tokens: top-1 agreement,
    KL(FullKV || method) and final-hidden-state cosine, per step and overall."""
    from rich.table import Table

    from scoutbench.cli.options import settings_note, table_caption
    from scoutbench.devices import device_description
    from scoutbench.eval.fidelity import fidelity_prompts, measure_fidelity
    from scoutbench.eval.generation import method_spec
    from scoutbench.results import envelope, write_json_atomic

    if steps < 1 or num_prompts < 1:
        raise UsageError("--steps and --prompts must be at least 1")
    from scoutbench.results import check_writable, json_text

    spec = method_spec(method, parse_method_args(method_args), budget, dense_layers, block_size)
    from scoutbench.method_args import check_methods_fit

    check_methods_fit([spec.build()], model)
    context_tokens = _parse_len(context_len)
    from scoutbench.models import check_context, context_window, loaded_context_window

    what, fix = f"--len {context_len} plus {steps} decode steps", "lower --len or --steps"
    check_context(model, context_window(model), context_tokens + steps, what, fix)
    if out_file:
        check_writable(out_file, overwrite, single_file=True)
    loaded, torch_dtype = _load(model, device, dtype, seed)
    check_context(model, loaded_context_window(loaded), context_tokens + steps, what, fix)
    prompts = fidelity_prompts(loaded, context_tokens, num_prompts, seed)
    metrics = measure_fidelity(loaded, spec, prompts, steps)
    result = {**envelope("fidelity"), **spec.describe(),
              "model": loaded.describe(torch_dtype), "device": device_description(next(loaded.model.parameters()).device),
              "len": context_tokens, "steps": steps, "seed": seed, **metrics}
    if out_file:
        write_json_atomic(out_file, result, overwrite=overwrite)
    if as_json:
        click.echo(json_text(result))
        return
    overall = metrics["overall"]
    table = Table(title=f"{result['method_repr']} vs FullKV, {len(prompts)} prompts of "
                        f"{metrics['prompt_tokens']} tokens, {steps} steps")
    for column in ("step", "top-1 agreement", "KL (nats)", "hidden cosine"):
        table.add_column(column, justify="right")
    for row in metrics["per_step"]:
        table.add_row(str(row["step"]), f"{row['top1_agreement']:.3f}", f"{row['kl_mean']:.4g}",
                      f"{row['hidden_cosine']:.5f}")
    table.add_row("all", *(f"{overall[name]:{spec}}" + ("" if f"{name}_ci95" not in overall else
                                                         " [{:{spec}}, {:{spec}}]".format(*overall[f"{name}_ci95"],
                                                                                          spec=spec))
                           for name, spec in (("top1_agreement", ".3f"), ("kl_mean", ".4g"))),
                  f"{overall['hidden_cosine']:.5f}", style="bold")
    table.caption = table_caption(f"all: 95% interval over the {len(prompts)} prompts (percentile bootstrap, seed 0)",
                                  settings_note([result]))
    rich_console().print(table)

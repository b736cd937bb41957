"""`scoutbench profile-recall` and `scoutbench cosine`: ScoutAttention's offline tools."""

from __future__ import annotations

import click

from scoutbench.cli.options import DTYPE, FORCE_HELP, LENGTH, SEED, parse_method_args, revision_option
from scoutbench.units import parse_length

_MODEL_HELP = "Built-in name (tiny-qwen3, smollm2-135m, bench-attn, ...), local folder or Hugging Face id."


def _common(fn):
    for option in reversed([
        click.option("--model", default="tiny-qwen3", show_default=True, help=_MODEL_HELP),
        click.option("--len", "length", default="4k", show_default=True, type=LENGTH, help="Prompt tokens: 4096, 4k, 64k."),
        click.option("--batch", default=1, show_default=True, type=int, help="Sequences decoded together."),
        click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N]."),
        click.option("--dtype", default=None, type=DTYPE, help="fp32|bf16|fp16; default fp32 on CPU, bf16 on CUDA."),
        click.option("--seed", default=0, show_default=True, type=SEED),
    ]):
        fn = option(fn)
    return fn


def _check_positive(name: str, value: int) -> None:
    from scoutbench.errors import UsageError

    if value < 1:
        raise UsageError(f"{name} must be at least 1 (got {value})")


def _check_context(model: str, length: int, steps: int, more: str = "") -> None:
    """Before loading: a built-in real model's trained window must hold the prompt and the decode steps (the
    library checks folders and hub models once loaded)."""
    from scoutbench.models import check_context, context_window

    check_context(model, context_window(model), length + steps + 1, f"--len {length} plus {steps} decode steps",
                  f"lower --len or --steps{' ' + more if more else ''}")


@click.command(name="profile-recall")
@revision_option
@_common
@click.option("--steps", default=32, show_default=True, type=int, help="Decode steps profiled (max interval + 1).")
@click.option("--beta", default=0.12, show_default=True, type=float, help="CPU compute ratio threshold.")
@click.option("--prefill", type=click.Choice(["real", "synthetic"]), default="real", show_default=True,
              help="real: the model runs on the prompt (--dataset's records, else random tokens); synthetic: random "
                   "K/V, whose selection churns without real drift (its intervals describe no real workload).")
@click.option("--dataset", "datasets", multiple=True, help="Profile on real LongBench records of this dataset (e.g. "
              "gov_report), those of at least --len tokens, each prompt middle-truncated to --len, instead of random "
              "tokens; repeatable (--limit records of each, one profile over all).")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of official LongBench <dataset>.jsonl files (default: the hub archive).")
@click.option("--limit", default=1, show_default=True, type=int,
              help="Records of each --dataset profiled (its first N of at least --len tokens).")
@click.option("--budget", default=None, type=LENGTH, help="ScoutAttention's token budget (default 2048; e.g. 2k).")
@click.option("--block-size", default=None, type=LENGTH, help="ScoutAttention's block size (default 32).")
@click.option("--method-arg", "method_args", multiple=True, metavar="KEY=VALUE",
              help="Any other ScoutAttention field (repeatable), e.g. dense_layers=2, pred_norm=self.")
@click.option("-o", "--output", required=True, help="JSON file to write (ScoutAttention's recall_profile).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option("--force", is_flag=True, help=FORCE_HELP)
def profile_recall_command(model, length, batch, device, dtype, seed, steps, beta, prefill, datasets, data_dir, limit,
                           budget, block_size, method_args, output, overwrite, force):
    """Profile per-layer recall intervals: the largest interval that keeps each layer's CPU compute ratio
    under BETA after a recall (paper section 3.4), on real records (--dataset) or random prompts. Writes a JSON
    that `--method-arg recall_profile=FILE` reads; it and every result that uses it say what it measured on."""
    from scoutbench.bench.recall import longbench_prompts, profile_recall
    from scoutbench.errors import UsageError
    from scoutbench.method_args import MethodSettings, check_methods_fit, resolve_method_args
    from scoutbench.methods.scout import ScoutAttention
    from scoutbench.results import check_writable, write_json_atomic

    length_tokens = parse_length(length)
    _check_positive("--steps", steps)
    _check_positive("--batch", batch)
    _check_positive("--limit", limit)
    if not 0.0 <= beta <= 1.0:
        raise UsageError(f"--beta must be in [0, 1] (got {beta})")
    if not datasets and data_dir is not None:
        raise UsageError("--data-dir needs --dataset: name the LongBench dataset to profile on")
    if datasets and (prefill == "synthetic" or batch != 1):
        raise UsageError("--dataset profiles real records, one at a time: drop --prefill synthetic and --batch")
    args = resolve_method_args(["scout"], MethodSettings.of(parse_method_args(method_args), budget=budget,
                                                            block_size=block_size))["scout"]
    for key in ("pr", "recall_profile"):
        if key in args:
            raise UsageError(f"--method-arg {key} makes no sense here: profiling runs with recall off")
    ScoutAttention.from_args(args)  # validate before loading the model
    if prefill != "synthetic":
        _check_context(model, length_tokens, steps, "or pass --prefill synthetic")
    data = None
    if datasets:  # the data before the model (a minute to load): a file that cannot be used is exit 2 at once
        from scoutbench.models import PRESETS
        from scoutbench.workloads import longbench

        unknown = [name for name in datasets if name not in longbench.DATASETS]
        if unknown:
            raise UsageError(f"unknown --dataset {unknown[0]!r} (LongBench: {', '.join(longbench.DATASETS)})")
        if model in PRESETS:
            raise UsageError(f"--dataset needs a model with a tokenizer; {model!r} has none (random-weight preset)")
        data = {name: longbench.load_task_data(name, data_dir) for name in dict.fromkeys(datasets)}
    check_methods_fit([ScoutAttention.from_args(args)], model)
    check_writable(output, overwrite, single_file=True)
    loaded = prompts = None
    if datasets:
        from scoutbench.devices import resolve_device, resolve_dtype
        from scoutbench.models import load_model

        torch_device = resolve_device(device)
        loaded = load_model(model, torch_device, resolve_dtype(dtype, torch_device), seed)
        if loaded.tokenizer is None:
            raise UsageError(f"--dataset needs a model with a tokenizer; {model!r} has none (random-weight preset)")
        prompts = longbench_prompts(list(datasets), data_dir, loaded.tokenizer, length_tokens, limit, data)
    result = profile_recall(model, length_tokens, steps, beta, batch=batch, device=device, dtype=dtype, seed=seed,
                            prefill=prefill, method_args=args, loaded=loaded, prompts=prompts, force=force)
    path = write_json_atomic(output, result, overwrite=overwrite)
    click.echo("layer  interval  expected ratio")
    for layer, (interval, ratio) in enumerate(zip(result["intervals"], result["expected_ratio"], strict=False)):
        if interval is None:
            click.echo(f"{layer:5d}  {'dense':>8}")
        else:
            click.echo(f"{layer:5d}  {interval:8d}  {ratio:14.3f}")
    measured = result["measured_on"]
    records = measured.get("records")
    click.echo(f"measured on {measured['prompts']}"
               + (f" ({measured['dataset']}: {len(records)} record(s))" if records is not None else ""))
    mean_interval, mean_ratio = result["mean_interval"], result["expected_ratio_mean"]
    if mean_interval is not None:
        click.echo(f"mean interval {mean_interval:.1f} steps, expected CPU compute ratio {mean_ratio:.3f} "
                   f"(beta {beta}); intervals capped at {result['interval_cap']} (= --steps - 1)")
    click.echo(f"wrote {path}")


@click.command(name="cosine")
@revision_option
@_common
@click.option("--steps", default=16, show_default=True, type=int, help="Decode steps measured.")
@click.option("--pred-norm", type=click.Choice(["next", "self"]), default="next", show_default=True,
              help="Prediction input reported as mean/per_layer (both are measured).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (model, mean, per_layer, ...) instead of a table.")
@click.option("-o", "--output", default=None, help="Also write the JSON to this file.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option("--force", is_flag=True, help=FORCE_HELP)
def cosine_command(model, length, batch, device, dtype, seed, steps, pred_norm, as_json, output, overwrite, force):
    """Cosine similarity of the predicted next-layer query vs the true one, per layer (paper Table 1).
    Entry i of per_layer is the prediction of layer i+1 from layer i's input."""
    from scoutbench.bench.cosine import query_cosine
    from scoutbench.results import check_writable, json_text, write_json_atomic

    length_tokens = parse_length(length)
    _check_positive("--steps", steps)
    _check_positive("--batch", batch)
    _check_context(model, length_tokens, steps)
    if output is not None:
        check_writable(output, overwrite, single_file=True)
    result = query_cosine(model, length_tokens, steps, batch=batch, device=device, dtype=dtype, seed=seed,
                          pred_norm=pred_norm, force=force)
    if output is not None:
        write_json_atomic(output, result, overwrite=overwrite)
    if as_json:
        click.echo(json_text(result))
        return
    other = "self" if pred_norm == "next" else "next"
    click.echo(f"{result['model']}: len {result['len']}, {result['steps']} decode steps, "
               f"{'random' if result['random_weights'] else 'real'} weights")
    click.echo(f"{'layer':>12}  {'cos (' + pred_norm + ')':>12}  {'cos (' + other + ')':>12}")
    for i, value in enumerate(result["per_layer"]):
        alt = result["by_pred_norm"][other]["per_layer"][i]
        click.echo(f"{f'{i} -> {i + 1}':>12}  {value:12.4f}  {alt:12.4f}")
    click.echo(f"{'mean':>12}  {result['mean']:12.4f}  {result['by_pred_norm'][other]['mean']:12.4f}")

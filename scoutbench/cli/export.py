"""`scoutbench export`: results to CSV, SGLang's result.jsonl, vLLM's benchmark JSON and the PyTorch benchmark
format, and/or into MLflow and W&B. No torch is imported."""

from __future__ import annotations

import click


@click.command(name="export")
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--format", "fmt", type=click.Choice(["csv", "sglang", "vllm", "pytorch"]), default=None,
              help="csv (every result, one row each), sglang (bench_one_batch result.jsonl), vllm (`vllm bench "
                   "latency` JSON per result) or pytorch (the PyTorch OSS benchmark records vLLM writes); "
                   "throughput results only except csv. Mappings: docs/results.md.")
@click.option("-o", "--output", default=None,
              help="File for csv/sglang; for vllm/pytorch a folder (one file per result) or a .json file (one result).")
@click.option("--overwrite", is_flag=True, help="Replace existing output files.")
@click.option("--mlflow", "mlflow_target", default=None, metavar="DIR_OR_URI",
              help="Also log one MLflow run per result: a folder (local file store, offline) or a tracking URI "
                   "(pip install 'scoutbench[mlflow]').")
@click.option("--experiment", default="scoutbench", show_default=True, help="MLflow experiment name.")
@click.option("--wandb", "wandb_project", default=None, metavar="PROJECT",
              help="Also log one W&B run per result into this project (pip install 'scoutbench[wandb]').")
@click.option("--wandb-dir", default="wandb-runs", show_default=True, type=click.Path(file_okay=False),
              help="Where W&B writes its runs.")
@click.option("--wandb-mode", type=click.Choice(["offline", "online"]), default="offline", show_default=True,
              help="offline: nothing leaves the machine (upload later with `wandb sync`).")
def command(results, fmt, output, overwrite, mlflow_target, experiment, wandb_project, wandb_dir, wandb_mode):
    """Export result files, folders or sweep folders to other tools' formats and trackers. Files that are not
    results, failed points and (for sglang/vllm/pytorch) non-throughput results are listed and left out."""
    from scoutbench.analysis.export import collect, export, synthetic_prefill_note
    from scoutbench.errors import UsageError

    if fmt is None and mlflow_target is None and wandb_project is None:
        raise UsageError("nothing to do: pass --format FORMAT -o PATH, --mlflow DIR_OR_URI and/or --wandb PROJECT")
    if (fmt is None) != (output is None):
        raise UsageError("--format and -o go together: the format to write and where")
    kinds = None if fmt in (None, "csv") else ("throughput",)
    chosen, skipped = collect(results, kinds, fmt)
    for line in skipped:
        click.echo(f"skipped {line}", err=True)
    if fmt is not None:
        for path in export(chosen, fmt, output, overwrite):
            click.echo(f"wrote {path}")
        note = synthetic_prefill_note(chosen) if fmt == "sglang" else None
        if note is not None:
            click.echo(note, err=True)
    if mlflow_target is not None:
        from scoutbench.analysis.loggers import log_mlflow

        runs, already = log_mlflow(chosen, mlflow_target, experiment)
        click.echo(f"mlflow: {len(runs)} run(s) in experiment {experiment!r} at {mlflow_target}"
                   + (f"; {already} result(s) logged there before, not again" if already else ""))
    if wandb_project is not None:
        from scoutbench.analysis.loggers import log_wandb

        runs, already = log_wandb(chosen, wandb_project, wandb_dir, wandb_mode)
        click.echo(f"wandb ({wandb_mode}): {len(runs)} run(s) in project {wandb_project!r} under {wandb_dir}"
                   + (f"; {already} result(s) logged there before, not again" if already else ""))

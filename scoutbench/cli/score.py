"""`scoutbench score`: official LongBench scores of a prediction file or, like eval.py, of a whole folder.
The logic is in `scoutbench.eval.score`; neither module imports torch."""

from __future__ import annotations

import json
from pathlib import Path

import click

from scoutbench.errors import UsageError


@click.command("score")
@click.argument("predictions", type=click.Path(exists=True))
@click.option("--dataset", default=None,
              help="File mode: the LongBench dataset whose metric applies (a _e name implies --e). Folder mode "
                   "takes the dataset from each file name, as eval.py.")
@click.option("--e", "longbench_e", is_flag=True,
              help="LongBench-E: the 0-4k / 4-8k / 8k+ buckets (folder mode: every file, as eval.py --e).")
@click.option("--json", "as_json", is_flag=True,
              help='File: {"dataset", "score"} (plus "buckets"). Folder: eval.py\'s result.json.')
def score_command(predictions, dataset, longbench_e, as_json) -> None:
    """Official LongBench score of PREDICTIONS: a .jsonl file (lines with `pred`, `answers`, and `length` for
    LongBench-E) or a folder of <dataset>.jsonl files. An empty LongBench-E bucket is NaN, as in eval.py."""
    from scoutbench.eval import score

    path = Path(predictions)
    if path.is_dir():
        if dataset is not None:
            raise UsageError(f"{path} is a folder: each <dataset>.jsonl is scored by its name; drop --dataset")
        scores, skipped = score.score_folder(path, longbench_e)
        if skipped:
            click.echo(f"skipped: {', '.join(skipped)}", err=True)
        if as_json:
            click.echo(score.official_json(scores))
            return
        for name, value in scores.items():
            click.echo(f"{name}: " + (" ".join(f"{k}: {v}" for k, v in value.items()) if isinstance(value, dict)
                                       else f"{value:.2f}"))
        return
    if dataset is None:
        raise UsageError("--dataset is required for a file (a folder is scored by file names)")
    if dataset == "all":
        raise UsageError("--dataset all: pass the folder of <dataset>.jsonl files instead of a file to score them all")
    output: dict = {"dataset": dataset, "score": score.score_file(dataset, path)}
    if longbench_e or dataset.endswith("_e"):
        output["buckets"] = score.score_file(dataset, path, longbench_e=True)
    if as_json:
        click.echo(json.dumps(output, ensure_ascii=False))  # an empty bucket is NaN, as eval.py writes it
        return
    score_text = "" if isinstance(output["score"], dict) else f" {output['score']:.2f}"  # a _e file: buckets only
    click.echo(f"{dataset}:{score_text}")
    for bucket, value in output.get("buckets", {}).items():
        click.echo(f"  {bucket}: {value}")

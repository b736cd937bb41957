"""Passkey and multi-key accuracy of every method at two budgets on a real model, one dense prefill per prompt.

For each length, `scoutbench.eval.accuracy.run_comparison` runs FullKV and every sparse method at every budget on the
same prompts, sharing one dense prefill per prompt between them (the same predictions as one `scoutbench accuracy`
run per method, which would repeat the prefill, minutes per prompt at 16k on CPU). Predictions and results go to
the layout of `scoutbench accuracy -o DIR` (one folder per method configuration, resumable: a rerun skips finished
prompts), so `scoutbench accuracy` with the same arguments finds them complete and `scoutbench report` reads them.
One length is the command

    scoutbench accuracy --dataset passkey --dataset passkey-multi --len 4k --limit 4 --model qwen2.5-0.5b \\
        --dtype bf16 --method fullkv --method quest --method infinigen --method hgca --method scout \\
        --budget 2048,1024 -o results/runs/accuracy-grid

and this script runs it for every length and prints one table. Budgets: the `budget` field of every sparse method
(quest, infinigen, hgca, scout), which bounds the tokens each attends per (sequence, KV head, layer, step).

    python benchmarks/accuracy_grid.py --model qwen2.5-0.5b --dtype bf16 --lens 4k:4,8k:2,16k:1 \\
        --budgets 2048,1024 -o results/runs/accuracy-grid
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md); before torch

from scoutbench.analysis import bootstrap  # noqa: E402
from scoutbench.eval.accuracy import run_comparison  # noqa: E402
from scoutbench.eval.generation import method_specs  # noqa: E402
from scoutbench.eval.tables import NOTE, interval_cell  # noqa: E402
from scoutbench.models import load_model, parse_dtype  # noqa: E402
from scoutbench.units import parse_length  # noqa: E402
from scoutbench.workloads.passkey import TASKS, PasskeyTask  # noqa: E402

METHODS = ("fullkv", "quest", "infinigen", "hgca", "scout")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--lens", default="4k:4,8k:2,16k:1", help="LEN:PROMPTS,... (prompts spread over depths)")
    parser.add_argument("--budgets", default="2048,1024")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", default="results/runs/accuracy-grid")
    parser.add_argument("--table", help="also write the markdown table here")
    args = parser.parse_args()

    loaded = load_model(args.model, "cpu", parse_dtype(args.dtype))
    specs = method_specs(list(METHODS), budgets=[int(b) for b in args.budgets.split(",")])
    scores: dict[str, dict[str, str]] = {}
    for item in args.lens.split(","):
        length_text, count = item.split(":")
        tasks = [PasskeyTask(variant, loaded.tokenizer, parse_length(length_text), num_samples=int(count),
                             seed=args.seed) for variant in args.tasks.split(",")]

        def progress(name: str, done: int, total: int) -> None:
            print(f"{name}: {done}/{total} prompts", flush=True)

        for result, _ in run_comparison(tasks, loaded, specs, args.output, None, args.seed, int(count),
                                        command=["python", "benchmarks/accuracy_grid.py"], on_progress=progress):
            for task in tasks:
                entry = result["results"][task.name]
                interval = bootstrap.mean_interval([s["score"] for s in entry["samples"]])
                scores.setdefault(result["label"], {})[f"{task.name} (n={entry['n']})"] = interval_cell(
                    interval, 0, value=entry["score"])
    columns = list(dict.fromkeys(column for row in scores.values() for column in row))
    lines = ["| method | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(row.get(c, "-") for c in columns) + " |" for label, row in scores.items()]
    table = "\n".join(lines) + f"\n\n{NOTE}"
    print(table)
    if args.table:
        with open(args.table, "w", encoding="utf-8") as out:
            out.write(table + "\n")


if __name__ == "__main__":
    main()

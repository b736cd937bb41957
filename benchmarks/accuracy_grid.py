"""Passkey and multi-key accuracy of every method at two budgets on a real model, one dense prefill per prompt.

For each task (passkey, passkey-multi), length and prompt, the dense prefill runs once and every method decodes from
it (`generation.generate_texts_shared_prefill`; the same predictions as one `scoutbench accuracy` run per method,
which would repeat the prefill, minutes per prompt at 16k on CPU). Predictions go to the layout of `scoutbench
accuracy -o DIR` (one folder per method configuration, resumable: a rerun skips finished prompts), then every
folder gets its `result.json` through the same runner, so `scoutbench accuracy` with the same arguments (and
`--len`, `--limit`, `--seed`) finds them complete and `scoutbench report` reads them.

Budgets: the `budget` field of every sparse method (quest, infinigen, hgca, scout).

    python benchmarks/accuracy_grid.py --model qwen2.5-0.5b --dtype bf16 --lens 4k:4,8k:2,16k:1 \\
        --budgets 2048,1024 -o results/runs/accuracy-grid
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md); before torch

from scoutbench.accuracy import prediction_row, read_predictions, run_accuracy, run_dir  # noqa: E402
from scoutbench.generation import MethodSpec, generate_texts_shared_prefill, method_spec, model_eos_ids  # noqa: E402
from scoutbench.models import load_model, parse_dtype  # noqa: E402
from scoutbench.units import parse_length  # noqa: E402
from scoutbench.workloads.passkey import TASKS, PasskeyTask  # noqa: E402

METHODS_WITH_BUDGET = ("quest", "infinigen", "hgca", "scout")


def grid_specs(budgets: list[int]) -> list[tuple[str, MethodSpec]]:
    """(label, spec) of FullKV and of every sparse method at every budget."""
    specs = [("fullkv", method_spec("fullkv"))]
    for budget in budgets:
        specs += [(f"{name}@{budget}", method_spec(name, budget=budget)) for name in METHODS_WITH_BUDGET]
    return specs


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
    stop_ids = model_eos_ids(loaded.model, loaded.tokenizer)
    budgets = [int(b) for b in args.budgets.split(",")]
    parameter = next(loaded.model.parameters())
    cells = []  # (task, label, spec)
    for item in args.lens.split(","):
        length_text, count = item.split(":")
        context_len = parse_length(length_text)
        for variant in args.tasks.split(","):
            task = PasskeyTask(variant, loaded.tokenizer, context_len, num_samples=int(count), seed=args.seed)
            specs = grid_specs(budgets)
            paths = [run_dir(args.output, loaded, spec.describe(), parameter.dtype, parameter.device, None,
                             args.seed) / f"{task.name}.jsonl" for _, spec in specs]
            for index, record in enumerate(task.records):
                pending = [(spec, path) for (_, spec), path in zip(specs, paths, strict=True)
                           if len(read_predictions(path, task.records)) <= index]
                if not pending:
                    continue
                prompt_ids = task.input_ids(record)
                start = time.perf_counter()
                preds = generate_texts_shared_prefill(loaded.model, loaded.tokenizer, [s for s, _ in pending],
                                                      prompt_ids, task.max_new_tokens, stop_ids)
                for (_, path), pred in zip(pending, preds, strict=True):
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with open(path, "a", encoding="utf-8") as out:
                        out.write(json.dumps(prediction_row(index, record, pred, prompt_ids)) + "\n")
                        out.flush()
                        os.fsync(out.fileno())
                print(f"{task.name} prompt {index}: {len(prompt_ids)} tokens, {len(pending)} methods, "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
            cells += [(task, label, spec) for label, spec in specs]

    scores: dict[str, dict[str, float]] = {}
    for task, label, spec in cells:
        result, _ = run_accuracy([task], loaded, spec, args.output, None, args.seed, None,
                                 command=["python", "benchmarks/accuracy_grid.py"])
        entry = result["results"][task.name]
        scores.setdefault(label, {})[f"{task.name} (n={entry['n']})"] = entry["score"]
    columns = list(dict.fromkeys(column for row in scores.values() for column in row))
    lines = ["| method | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(f"{row.get(c, float('nan')):.0f}" for c in columns) + " |"
              for label, row in scores.items()]
    table = "\n".join(lines)
    print(table)
    if args.table:
        with open(args.table, "w", encoding="utf-8") as out:
            out.write(table + "\n")


if __name__ == "__main__":
    main()

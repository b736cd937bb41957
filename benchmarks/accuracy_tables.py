"""The comparison tables of accuracy run folders, rescored from their prediction files without running a model.

`scoutbench accuracy --summarize` scores the configurations today's methods build; a folder made by an earlier
configuration (another method repr, so another hash: e.g. the LongBench and passkey tables of docs/accuracy.md,
decoded before the methods gained fields) is only reachable by its folder. This script rescores such folders as a
run of this version scores them (`eval.accuracy.rescore_folder`: per-sample values, every figure's 95% bootstrap
interval, the agreement with FullKV's predictions in the same model folder, the fidelity) and prints the same
tables (`eval.tables.comparison_tables`). It only reads.

    python benchmarks/accuracy_tables.py results/accuracy/longbench/qwen2.5-1.5b \\
        --data-dir ../shared/longbench/records --markdown /tmp/longbench.md
    python benchmarks/accuracy_tables.py results/accuracy/passkey/qwen2.5-0.5b --model qwen2.5-0.5b

LongBench tasks read their records from `--data-dir`; passkey tasks are generated again from the model's
tokenizer (`--model`) with each result's seed and record count, as the run generated them.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from scoutbench.eval.accuracy import rescore_folder
from scoutbench.eval.tables import comparison_tables, tables_markdown
from scoutbench.methods import display_rank
from scoutbench.methods.fullkv import FullKV
from scoutbench.workloads import longbench


def tasks_of(results: dict[Path, dict[str, Any]], data_dir: str | None, model: str | None) -> list[Any]:
    """Every task the results name or a folder has predictions of, in the order they first appear, built as their
    run built them."""
    names = list(dict.fromkeys([*(name for r in results.values() for name in r.get("results", {})),
                                *(p.stem for folder in results for p in sorted(folder.glob("*.jsonl"))
                                  if p.stem in longbench.DATASETS)]))
    results = list(results.values())
    tokenizer = None
    tasks = []
    for name in names:
        first = next((r for r in results if name in r.get("results", {})), results[0])
        if name in longbench.DATASETS:
            records, source = longbench.load_task_data(name, data_dir)
            tasks.append(longbench.LongBenchTask(name, records, None, first.get("max_length"), source))
            continue
        match = re.fullmatch(r"(passkey(?:-multi)?)_(\d+)", name)
        if match is None:
            raise SystemExit(f"{name}: not a LongBench or passkey task")
        if tokenizer is None:
            if model is None:
                raise SystemExit("passkey tasks are generated from the model's tokenizer: give --model")
            from scoutbench.models import load_model

            tokenizer = load_model(model, "cpu").tokenizer
        from scoutbench.workloads.passkey import PasskeyTask

        count = max(r["results"][name]["n"] for r in results if name in r.get("results", {}))
        tasks.append(PasskeyTask(match[1], tokenizer, int(match[2]), num_samples=count, seed=first.get("seed", 0)))
    return tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_folder", type=Path, help="a model's folder of an accuracy -o (its run folders)")
    parser.add_argument("--folder", action="append", help="only these run folders (repeatable; default: all)")
    parser.add_argument("--data-dir", help="folder of official LongBench <name>.jsonl files")
    parser.add_argument("--dataset", action="append", help="only these tasks (repeatable; default: every one)")
    parser.add_argument("--model", help="the model whose tokenizer generated passkey prompts")
    parser.add_argument("--markdown", type=Path, help="also write the tables here")
    args = parser.parse_args()
    folders = sorted(p for p in args.model_folder.iterdir() if (p / "result.json").is_file()
                     and (not args.folder or p.name in args.folder))
    stored = {p: json.loads((p / "result.json").read_text("utf-8")) for p in folders}
    reference = next((p for p, r in stored.items() if r.get("method_repr") == repr(FullKV())), None)
    tasks = [t for t in tasks_of(stored, args.data_dir, args.model) if not args.dataset or t.name in args.dataset]
    results = [rescore_folder(p, tasks, reference) for p in folders]
    results.sort(key=lambda r: (display_rank(r["method"]), (r.get("method_config") or {}).get("budget") or 0))
    for result in results:  # two configurations of one method and budget: tell them apart by their folder
        twins = [r for r in results if r["label"] == result["label"]]
        if len(twins) > 1:
            result["label"] += f" ({result['method_repr']})"
    text = tables_markdown(comparison_tables(results, [t.name for t in tasks]))
    print(text)
    if args.markdown:
        args.markdown.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()

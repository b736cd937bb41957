"""`scoutbench score`: official LongBench scores of existing prediction files, one file or a whole folder.

Folder mode is the official `eval.py`: every `<dataset>.jsonl` in the folder, the dataset being the file name
before its first "."; with `longbench_e` (eval.py's `--e`, files of a `pred_e/` folder named by their base dataset)
or for `<name>_e.jsonl` files, the 0-4k / 4-8k / 8k+ buckets instead of one score. The result has eval.py's shape
and JSON form ({dataset: score} or {dataset: {bucket: score}}, an empty bucket a bare NaN, indent 4). Never imports
torch: scoring a folder takes a second, not a torch import.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from scoutbench.errors import UsageError
from scoutbench.workloads import longbench_metrics as metrics


def prediction_row_problem(row: Any) -> str | None:
    """Why a prediction line cannot be scored (wrong JSON types), or None: `pred` a string, `answers` a list of
    strings, `all_classes` (when present) null or a list of strings, `length` (when present) a number. Shared with
    the accuracy runner's resume reader."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if not isinstance(row.get("pred"), str):
        return f"pred must be a string, got {type(row.get('pred')).__name__}"
    answers = row.get("answers")
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        return "answers must be a list of strings"
    classes = row.get("all_classes")
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        return "all_classes must be null or a list of strings"
    if "length" in row and (not isinstance(row["length"], (int, float)) or isinstance(row["length"], bool)):
        return f"length must be a number, got {type(row['length']).__name__}"
    if "length" in row and not (math.isfinite(row["length"]) and row["length"] >= 0):  # NaN fell in the 8k+ bucket
        return f"length must be a finite number of 0 or more, got {row['length']}"
    return None


def read_prediction_file(path: Path, need_length: bool) -> list[dict[str, Any]]:
    """Rows with `pred` and `answers` (and `length` for LongBench-E), in file order; a bad line or a file that is
    not UTF-8 is an error naming it."""
    try:
        rows = _prediction_rows(path, need_length)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if not rows:
        raise UsageError(f"{path}: no predictions to score")
    return rows


def _prediction_rows(path: Path, need_length: bool) -> list[dict[str, Any]]:
    from scoutbench.workloads.longbench import iter_jsonl

    required = ("pred", "answers", "length") if need_length else ("pred", "answers")
    rows = []
    with open(path, encoding="utf-8-sig") as lines:  # a byte-order mark is not part of the JSON
        for line_number, row in iter_jsonl(lines, str(path), UsageError):
            missing = [key for key in required if not isinstance(row, dict) or key not in row]
            if missing:
                raise UsageError(f"{path} line {line_number}: missing {', '.join(missing)}")
            problem = prediction_row_problem(row)
            if problem:
                raise UsageError(f"{path} line {line_number}: {problem}")
            rows.append(row)
    return rows


def score_file(dataset: str, path: Path, longbench_e: bool = False) -> float | dict[str, float]:
    """One file's official score; the buckets instead for LongBench-E (`longbench_e` or a `_e` dataset)."""
    metrics.check_dataset(dataset)
    longbench_e = longbench_e or dataset.endswith("_e")
    rows = read_prediction_file(path, need_length=longbench_e)
    try:
        return metrics.dataset_score_e(dataset, rows) if longbench_e else metrics.dataset_score(dataset, rows)
    except ValueError as exc:
        raise UsageError(f"{path}: {exc}") from None


def fidelity_file_name(task: str, steps: int) -> str:
    """`accuracy --fidelity-steps N`'s per-sample fidelity rows of a task, beside its predictions: named here, with
    the predictions' reader, so that a folder scored by file names passes over them."""
    return f"{task}.fidelity-{steps}.jsonl"


_FIDELITY_FILE = re.compile(r"[^.]+\.fidelity-\d+\.jsonl")


def score_folder(folder: Path, longbench_e: bool = False) -> tuple[dict[str, Any], list[str]]:
    """eval.py over a folder: ({dataset: score or buckets}, in file-name order; the .jsonl files skipped, each with
    why: a name that is not a LongBench dataset, e.g. passkey predictions beside them, or the fidelity rows an
    accuracy run writes beside its predictions). Two prediction files of one dataset are refused: eval.py would
    keep whichever it listed last."""
    files = sorted(path for path in folder.iterdir() if path.suffix == ".jsonl" and path.is_file())
    scores: dict[str, Any] = {}
    scored_from: dict[str, str] = {}
    skipped = []
    for path in files:
        dataset = path.name.split(".")[0]
        if _FIDELITY_FILE.fullmatch(path.name):
            skipped.append(f"{path.name} (fidelity rows of `accuracy --fidelity-steps`, not predictions)")
            continue
        if dataset not in metrics.DATASETS and dataset not in metrics.E_DATASETS:
            skipped.append(f"{path.name} (not a LongBench dataset name)")
            continue
        if dataset in scored_from:
            raise UsageError(f"{folder}: {scored_from[dataset]} and {path.name} are both predictions of {dataset}; "
                             "keep one of them in the folder, or score each file with --dataset")
        scores[dataset], scored_from[dataset] = score_file(dataset, path, longbench_e), path.name
    if not scores:
        raise UsageError(f"{folder}: no <dataset>.jsonl prediction files of LongBench datasets"
                         + (f" (skipped: {', '.join(skipped)})" if skipped else ""))
    return scores, skipped


def official_json(result: Any) -> str:
    """eval.py's result.json text: indent 4, UTF-8 kept, an empty bucket written NaN (not strict JSON, as there)."""
    return json.dumps(result, ensure_ascii=False, indent=4)

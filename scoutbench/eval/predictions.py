"""The row files of an accuracy run: one JSON object per line, appended and flushed as each is generated, read
back (and checked against the data) to resume. `<task>.jsonl` holds the predictions in the official LongBench
format (`pred`, `answers`, `all_classes`, `length`) plus `_id`, `index`, `input_tokens`, `prompt_sha256` and the
CPU seconds they cost; `<task>.fidelity-N.jsonl` the teacher-forced fidelity rows (`eval/accuracy.py` writes
both)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scoutbench.errors import UsageError
from scoutbench.eval.score import prediction_row_problem


def record_id(record: dict[str, Any], index: int) -> str:
    return str(record.get("_id", index))



def read_rows(path: Path, records: list[dict[str, Any]], problem: Callable[[Any], str | None],
              repair: bool = True) -> list[dict[str, Any]]:
    """Rows already written for `records` (one JSON object per line, `index` and `_id` checked against the data).
    An unterminated last line (a write cut by an interruption) is removed from the file (`repair`; a reader of a
    run in progress only skips it); any other bad line is an error naming the file and line (exit 2, like a malformed sweep manifest)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    complete_end = data.rfind(b"\n") + 1
    if complete_end < len(data) and repair:
        with open(path, "r+b") as handle:
            handle.truncate(complete_end)
    try:
        text = data[:complete_end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start}); delete the file to regenerate it") from None
    rows = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path} line {line_number}: not valid JSON ({exc.msg}); delete the file to "
                                  "regenerate it") from None
        why = problem(row)
        if why:
            raise UsageError(f"{path} line {line_number}: {why}; delete the file to regenerate it")
        index = len(rows)
        if index >= len(records):
            break  # a previous run with a larger --limit: only the selected samples count
        expected = record_id(records[index], index)
        if not isinstance(row, dict) or row.get("index") != index or str(row.get("_id")) != expected:
            raise UsageError(f"{path} line {line_number}: expected sample {index} (_id {expected}); the file "
                                  "was made from other data: delete it or use another -o")
        rows.append(row)
    return rows


def prompt_sha256(input_ids: list[int]) -> str:
    """Hash of exactly what the model was given for one record (its token ids after template, truncation and chat
    wrapper): two runs with equal hashes prompted identically (lm-eval's per-sample `prompt_hash`)."""
    return hashlib.sha256(",".join(map(str, input_ids)).encode()).hexdigest()


def prompts_sha256(rows: list[dict[str, Any]]) -> str | None:
    """One hash of a task's prompts in order (lm-eval's `task_hashes`); None if a row has no prompt hash."""
    hashes = [row.get("prompt_sha256") for row in rows]
    return None if None in hashes else hashlib.sha256("".join(hashes).encode()).hexdigest()


def read_predictions(path: Path, records: list[dict[str, Any]], repair: bool = True) -> list[dict[str, Any]]:
    return read_rows(path, records, prediction_row_problem, repair)


def fidelity_row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    for key in ("top1", "kl", "cosine"):
        if not isinstance(row.get(key), list) or len(row[key]) != row.get("steps"):
            return f"{key} must be a list of `steps` numbers"
    return None


def prediction_row(index: int, record: dict[str, Any], pred: str, input_ids: list[int],
                   cpu_s: float | None = None, shared_prefill_cpu_s: float | None = None) -> dict[str, Any]:
    """The official prediction fields, plus `_id`/`index` (resume) and the CPU seconds it cost: `cpu_s` is this
    method's own work (its decode, and the prefill when it was not shared), `shared_prefill_cpu_s` the dense
    prefill that every method of the record decoded from (None when not shared)."""
    row = {"pred": pred, "answers": record["answers"], "all_classes": record.get("all_classes"),
           "length": record["length"], "_id": record_id(record, index), "index": index,
           "input_tokens": len(input_ids), "prompt_sha256": prompt_sha256(input_ids)}
    if cpu_s is not None:
        row |= {"cpu_s": round(cpu_s, 2), "shared_prefill_cpu_s": None if shared_prefill_cpu_s is None
                else round(shared_prefill_cpu_s, 2)}
    return row


def append_row(path: Path, row: dict[str, Any]) -> None:
    """One line, flushed and synced: an interruption loses at most the line being written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
        out.flush()
        os.fsync(out.fileno())

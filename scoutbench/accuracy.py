"""The accuracy runner: generate predictions for LongBench or passkey tasks under one method, score them officially.

Layout of a run, under `-o DIR`:
    DIR/<model>/<method>-<config hash>/<task>.jsonl   one line per sample, in the official prediction format
                                                     (`pred`, `answers`, `all_classes`, `length`) plus `_id`,
                                                     `index` and `input_tokens`; official eval.py reads it as is
    DIR/<model>/<method>-<config hash>/result.json    scores, config and provenance, written atomically

The hash covers everything that changes a prediction (model, method repr, dtype, device type, max length, seed),
so a rerun of the same command finds its own files: samples already on disk are skipped, each new line is flushed
as soon as it is generated (an interruption loses at most the sample in flight), and a line left half-written by
an interruption is dropped and regenerated. Lines are checked against the data (`_id` at each index), so
predictions for other data are never mixed in.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import torch

from scoutbench import __version__
from scoutbench.errors import ScoutbenchError
from scoutbench.generation import MethodSpec, generate_text, model_eos_ids
from scoutbench.models import LoadedModel
from scoutbench.results import SCHEMA_VERSION, env_info, output_lock, utc_now, write_json_atomic
from scoutbench.score import prediction_row_problem
from scoutbench.throughput import device_description

ProgressCallback = Callable[[str, int, int], None]  # (task name, samples done, samples total)


class Task(Protocol):
    """What the runner needs from a workload (LongBenchTask, PasskeyTask)."""

    records: list[dict[str, Any]]
    max_new_tokens: int
    min_new_tokens: int

    @property
    def name(self) -> str: ...
    def stop_token_ids(self, model_eos_ids: frozenset[int]) -> frozenset[int]: ...
    def input_ids(self, record: dict[str, Any]) -> list[int]: ...
    def describe(self) -> dict[str, Any]: ...
    def score(self, rows: list[dict[str, Any]]) -> dict[str, Any]: ...


def record_id(record: dict[str, Any], index: int) -> str:
    return str(record.get("_id", index))


def run_dir(out_dir: str | Path, loaded: LoadedModel, method: dict[str, Any], dtype: torch.dtype,
            device: torch.device, max_length: int | None, seed: int) -> Path:
    """`out_dir/<model>/<method>-<hash of everything that changes a prediction>`: a rerun finds its own files."""
    identity = {"model": loaded.name, "method": method["method_repr"], "dtype": str(dtype), "device": device.type,
                "max_length": max_length, "seed": seed}
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
    model_dir = re.sub(r"[^A-Za-z0-9._-]+", "--", loaded.name.strip("/"))
    return Path(out_dir) / model_dir / f"{method['method']}-{digest}"


# ---------------------------------------------------------------------------------------------- predictions file
def read_predictions(path: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows already generated for `records`. An unterminated last line (a write cut by an interruption) is removed
    from the file; any other bad line is an error naming the file and line."""
    if not path.exists():
        return []
    data = path.read_bytes()
    complete_end = data.rfind(b"\n") + 1
    if complete_end < len(data):
        with open(path, "r+b") as handle:
            handle.truncate(complete_end)
    try:
        text = data[:complete_end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScoutbenchError(f"{path}: not UTF-8 text (byte {exc.start}); delete the file to regenerate it") from None
    rows = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ScoutbenchError(f"{path} line {line_number}: not valid JSON ({exc.msg}); delete the file to "
                                  "regenerate it") from None
        problem = prediction_row_problem(row)
        if problem:
            raise ScoutbenchError(f"{path} line {line_number}: {problem}; delete the file to regenerate it")
        index = len(rows)
        if index >= len(records):
            break  # a previous run with a larger --limit: only the selected samples count
        expected = record_id(records[index], index)
        if not isinstance(row, dict) or row.get("index") != index or str(row.get("_id")) != expected:
            raise ScoutbenchError(f"{path} line {line_number}: expected sample {index} (_id {expected}); the file "
                                  "was made from other data: delete it or use another -o")
        rows.append(row)
    return rows


def prompt_sha256(input_ids: list[int]) -> str:
    """Hash of exactly what the model was given for one record (its token ids after template, truncation and chat
    wrapper): two runs with equal hashes prompted identically (lm-eval's per-sample `prompt_hash`)."""
    return hashlib.sha256(",".join(map(str, input_ids)).encode()).hexdigest()


def prediction_row(index: int, record: dict[str, Any], pred: str, input_ids: list[int]) -> dict[str, Any]:
    return {"pred": pred, "answers": record["answers"], "all_classes": record.get("all_classes"),
            "length": record["length"], "_id": record_id(record, index), "index": index,
            "input_tokens": len(input_ids), "prompt_sha256": prompt_sha256(input_ids)}


def prompts_sha256(rows: list[dict[str, Any]]) -> str | None:
    """One hash of a task's prompts in order (lm-eval's `task_hashes`); None if a row predates prompt hashes."""
    hashes = [row.get("prompt_sha256") for row in rows]
    return None if None in hashes else hashlib.sha256("".join(hashes).encode()).hexdigest()


def predict_task(task: Task, loaded: LoadedModel, spec: MethodSpec, path: Path,
                 on_progress: ProgressCallback | None = None) -> list[dict[str, Any]]:
    """Resume or run `task`; returns one row per record, in record order."""
    rows = read_predictions(path, task.records)
    total = len(task.records)
    if on_progress:
        on_progress(task.name, len(rows), total)
    if len(rows) == total:
        return rows
    stop_ids = task.stop_token_ids(model_eos_ids(loaded.model, loaded.tokenizer))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        for index in range(len(rows), total):
            record = task.records[index]
            prompt_ids = task.input_ids(record)
            pred = generate_text(loaded.model, loaded.tokenizer, spec, prompt_ids, task.max_new_tokens, stop_ids,
                                 task.min_new_tokens)
            row = prediction_row(index, record, pred, prompt_ids)
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()
            os.fsync(out.fileno())
            rows.append(row)
            if on_progress:
                on_progress(task.name, index + 1, total)
    return rows


# ---------------------------------------------------------------------------------------------- result
def scoring_versions() -> dict[str, str | None]:
    """The scorer's own dependencies: ROUGE, jieba and fuzzywuzzy versions decide LongBench numbers (fuzzywuzzy's
    ratio comes from python-Levenshtein when installed, else difflib: `Levenshtein: null` means difflib)."""
    versions: dict[str, str | None] = {}
    for package in ("rouge", "jieba", "fuzzywuzzy", "Levenshtein", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def run_accuracy(tasks: list[Task], loaded: LoadedModel, spec: MethodSpec, out_dir: str | Path,
                 max_length: int | None, seed: int, limit: int | None, command: list[str] | None = None,
                 on_progress: ProgressCallback | None = None) -> tuple[dict[str, Any], Path]:
    """Predict and score every task; returns the result and its path. Scores of other tasks already in the same
    run folder's result.json are kept; the tasks of this call are rescored from their prediction files."""
    parameter = next(loaded.model.parameters())
    method = spec.describe()
    folder = run_dir(out_dir, loaded, method, parameter.dtype, parameter.device, max_length, seed)
    with output_lock(folder):  # two runs appending to one prediction file would interleave their lines
        return _run_accuracy_locked(tasks, loaded, spec, folder, method, max_length, seed, limit, command,
                                    on_progress)


def _run_accuracy_locked(tasks: list[Task], loaded: LoadedModel, spec: MethodSpec, folder: Path,
                         method: dict[str, Any], max_length: int | None, seed: int, limit: int | None,
                         command: list[str] | None, on_progress: ProgressCallback | None) -> tuple[dict[str, Any], Path]:
    parameter = next(loaded.model.parameters())
    result_path = folder / "result.json"
    results: dict[str, Any] = {}
    if result_path.exists():
        try:
            results = json.loads(result_path.read_text("utf-8")).get("results", {})
        except (ValueError, AttributeError):
            results = {}  # an unreadable summary: every score can be recomputed from its predictions
        if not isinstance(results, dict):
            results = {}
    for task in tasks:
        file_name = f"{task.name}.jsonl"
        rows = predict_task(task, loaded, spec, folder / file_name, on_progress)
        budget = method["method_config"].get("budget")
        dense = sum(budget is not None and budget >= row["input_tokens"] + task.max_new_tokens for row in rows)
        results[task.name] = {**task.score(rows), "n": len(rows), "dense_records": dense, **task.describe(),
                              "predictions": file_name, "prompts_sha256": prompts_sha256(rows)}
    result = {
        "schema_version": SCHEMA_VERSION, "kind": "accuracy", "scoutbench_version": __version__,
        "created_at": utc_now(), "command": command if command is not None else list(sys.argv),
        **method, "model": loaded.describe(parameter.dtype), "device": device_description(parameter.device),
        "max_length": max_length, "seed": seed, "limit": limit, "results": results,
        "env": {**env_info(), "scoring": scoring_versions()},
    }
    write_json_atomic(result_path, result, overwrite=True)
    return result, result_path

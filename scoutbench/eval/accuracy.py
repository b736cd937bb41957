"""The accuracy runner: generate predictions for LongBench or passkey tasks under one or several method
configurations, score them officially, and compare each with FullKV.

Layout of a run, under `-o DIR`, one folder per method configuration, `<run>` = `<method>-budget<N>-<config hash>`
(`<method>-<config hash>` without a budget, and for folders made before the budget was in the name):
    DIR/<model>/<run>/<task>.jsonl                    one line per sample, in the official prediction format
                                                     (`pred`, `answers`, `all_classes`, `length`) plus `_id`,
                                                     `index`, `input_tokens`, `prompt_sha256` and its CPU seconds;
                                                     official eval.py reads it as is
    DIR/<model>/<run>/<task>.fidelity-N.jsonl         per sample, the method teacher-forced on
                                                     FullKV's first N generated tokens: top-1 agreement, KL and
                                                     hidden-state cosine per step (`--fidelity-steps N`)
    DIR/<model>/<run>/result.json                     scores with their intervals and per-sample values,
                                                     agreement with FullKV, fidelity, config and provenance,
                                                     written atomically

Several configurations in one run share one dense prefill per record (`generation.SharedPrefill`; the prefill
does not depend on the method, and at long context it is most of the time); each still predicts exactly what a
run of its own predicts.

The hash covers everything that changes a prediction (model, method repr, dtype, device type, max length, seed),
so a rerun of the same command finds its own files: samples already on disk are skipped, each new line is flushed
as soon as it is generated (an interruption loses at most the sample in flight), and a line left half-written by
an interruption is dropped and regenerated. Lines are checked against the data (`_id` at each index), so
predictions for other data are never mixed in.

The row files themselves (their format, reading them back, appending to them) are `eval/predictions.py`; the
comparison tables of the results, `eval/tables.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import torch

from scoutbench.analysis import bootstrap
from scoutbench.devices import device_description
from scoutbench.errors import UsageError
from scoutbench.eval.fidelity import compare_steps, fullkv_reference
from scoutbench.eval.generation import Generation, MethodSpec, SharedPrefill, generate_text, model_eos_ids
from scoutbench.eval.predictions import (
    append_row,
    fidelity_row_problem,
    prediction_row,
    prompt_sha256,
    prompts_sha256,
    read_predictions,
    read_rows,
    record_id,
)
from scoutbench.eval.score import fidelity_file_name
from scoutbench.methods.fullkv import FullKV
from scoutbench.models import LoadedModel
from scoutbench.results import envelope, output_lock, write_json_atomic

ProgressCallback = Callable[[str, int, int], None]  # (task name, samples done, samples total)


class Task(Protocol):
    """What the runner needs from a task (a registered suite builds it, workloads/suite.py: LongBenchTask,
    PasskeyTask)."""

    records: list[dict[str, Any]]
    max_new_tokens: int
    min_new_tokens: int

    @property
    def name(self) -> str: ...
    def stop_token_ids(self, model_eos_ids: frozenset[int]) -> frozenset[int]: ...
    def input_ids(self, record: dict[str, Any]) -> list[int]: ...
    def describe(self) -> dict[str, Any]: ...
    def score(self, rows: list[dict[str, Any]]) -> dict[str, Any]: ...


def run_dir(out_dir: str | Path, loaded: LoadedModel, method: dict[str, Any], dtype: torch.dtype,
            device: torch.device, max_length: int | None, seed: int) -> Path:
    """`out_dir/<model>/<method>-budget<N>-<hash of everything that changes a prediction>` (no budget part for a
    method without one): a reader sees what ran, and a rerun finds its own files. A folder of the earlier naming,
    `<method>-<hash>` (the same hash), is used as it is when it exists: runs are resumed where their files are,
    never moved (a run of an older version may still be appending to them). Both at once is an error."""
    identity = {"model": loaded.name, "method": method["method_identity"], "dtype": str(dtype), "device": device.type,
                "max_length": max_length, "seed": seed}
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
    model_dir = Path(out_dir) / re.sub(r"[^A-Za-z0-9._-]+", "--", loaded.name.strip("/"))
    budget = method["method_config"].get("budget")
    readable = model_dir / "-".join([method["method"], *([] if budget is None else [f"budget{budget}"]), digest])
    legacy = model_dir / f"{method['method']}-{digest}"
    if legacy == readable or not legacy.exists():
        return readable
    if readable.exists():
        raise UsageError(f"{legacy} and {readable} both hold the files of one configuration (one written by an "
                         "older version): merge them into one, or remove one")
    return legacy


# ---------------------------------------------------------------------------------------------- configurations
@dataclass
class Config:
    """One method configuration of an accuracy run: its spec and the folder its files live in."""

    spec: MethodSpec
    method: dict[str, Any]  # spec.describe(): method, method_config, method_repr
    folder: Path

    @property
    def label(self) -> str:
        """`scout@1024`: the method name and, for a method with one, its budget."""
        budget = self.method["method_config"].get("budget")
        return self.method["method"] if budget is None else f"{self.method['method']}@{budget}"

    @property
    def is_reference(self) -> bool:
        """FullKV with its defaults: what agreement and fidelity compare against."""
        return self.method["method_repr"] == repr(FullKV())

    def predictions_path(self, task: Task) -> Path:
        return self.folder / f"{task.name}.jsonl"

    def fidelity_path(self, task: Task, steps: int) -> Path:
        return self.folder / fidelity_file_name(task.name, steps)


def make_config(spec: MethodSpec, loaded: LoadedModel, out_dir: str | Path, max_length: int | None,
                seed: int) -> Config:
    parameter = next(loaded.model.parameters())
    method = spec.describe()
    return Config(spec, method, run_dir(out_dir, loaded, method, parameter.dtype, parameter.device, max_length, seed))


# ---------------------------------------------------------------------------------------------- predicting
def predict_task(task: Task, loaded: LoadedModel, configs: list[Config], fidelity_steps: int = 0,
                 on_progress: ProgressCallback | None = None, generate: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Resume or run `task` for every configuration; returns each one's prediction rows (by label), in record order.

    Per record, the configurations still missing it share one dense prefill (`SharedPrefill`: the same
    predictions as separate runs); a lone configuration prefills into its method directly. With
    `fidelity_steps`, every configuration other than FullKV is also teacher-forced on FullKV's first
    `fidelity_steps` generated tokens (`<task>.fidelity-N.jsonl`, resumable like the predictions).
    `generate=False` only reads what is on disk (and leaves the files alone: a run may be writing them)."""
    records, total = task.records, len(task.records)
    rows = {c.label: read_predictions(c.predictions_path(task), records, generate) for c in configs}
    compared = [c for c in configs if fidelity_steps and not c.is_reference]
    fidelity = {c.label: read_rows(c.fidelity_path(task, fidelity_steps), records, fidelity_row_problem, generate)
                for c in compared}
    if not generate:
        return rows
    _check_prompts(task, {c.predictions_path(task): rows[c.label] for c in configs})
    order = sorted(configs, key=lambda c: not c.is_reference)  # FullKV first: its generation is the reference
    done = min([len(r) for r in rows.values()] + [len(r) for r in fidelity.values()])
    if on_progress:
        on_progress(task.name, done, total)
    stop_ids = task.stop_token_ids(model_eos_ids(loaded.model, loaded.tokenizer))
    for index in range(done, total):
        record = records[index]
        pending = [c for c in order if len(rows[c.label]) <= index]
        pending_fidelity = [c for c in compared if len(fidelity[c.label]) <= index]
        prompt_ids = task.input_ids(record)
        if len(pending) == 1 and not pending_fidelity:
            (config,) = pending
            start = time.process_time()
            pred = generate_text(loaded.model, loaded.tokenizer, config.spec, prompt_ids, task.max_new_tokens,
                                 stop_ids, task.min_new_tokens)
            row = prediction_row(index, record, pred, prompt_ids, time.process_time() - start)
            append_row(config.predictions_path(task), row)
            rows[config.label].append(row)
        else:
            _predict_shared(task, loaded, index, prompt_ids, pending, pending_fidelity, fidelity_steps, stop_ids,
                            rows, fidelity)
        if on_progress:
            on_progress(task.name, index + 1, total)
    return rows


def _check_prompts(task: Task, files: dict[Path, list[dict[str, Any]]]) -> None:
    """A resumed row counts only if the model was given this run's prompt for it: its `prompt_sha256` must be the
    hash of the record's prompt now. The folder and `_id` say which run and sample a row belongs to, not which text
    was behind the id (another --data-dir or --data-revision with the same ids, another template or truncation).
    A row without a hash (a file from a version that records none) is kept."""
    hashes: dict[int, str] = {}
    for path, rows in files.items():
        for line, row in enumerate(rows, start=1):
            recorded = row.get("prompt_sha256")
            if recorded is None:
                continue
            index = row["index"]
            if index not in hashes:
                hashes[index] = prompt_sha256(task.input_ids(task.records[index]))
            if recorded != hashes[index]:
                raise UsageError(f"{path} line {line}: sample {index} (_id {row.get('_id')}) was predicted from "
                                 "another prompt than this run's (other data, template or --max-length); delete the "
                                 "file to predict it again, or use another -o")


def _predict_shared(task: Task, loaded: LoadedModel, index: int, prompt_ids: list[int], pending: list[Config],
                    pending_fidelity: list[Config], fidelity_steps: int, stop_ids: frozenset[int],
                    rows: dict[str, list[dict[str, Any]]], fidelity: dict[str, list[dict[str, Any]]]) -> None:
    record = task.records[index]
    start = time.process_time()
    shared = SharedPrefill(loaded.model, prompt_ids)
    prefill_s = time.process_time() - start
    reference: Generation | None = None
    for config in pending:
        start = time.process_time()
        keep = fidelity_steps if config.is_reference and pending_fidelity else 0
        generation = shared.generate(config.spec, task.max_new_tokens, stop_ids, task.min_new_tokens, keep)
        if keep:
            reference = generation
        pred = loaded.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        row = prediction_row(index, record, pred, prompt_ids, time.process_time() - start, prefill_s)
        append_row(config.predictions_path(task), row)
        rows[config.label].append(row)
    if not pending_fidelity:
        return
    if reference is None:  # FullKV's prediction is on disk already: its first tokens again (deterministic)
        steps = min(fidelity_steps, task.max_new_tokens - 1)
        reference = fullkv_reference(shared, steps, stop_ids, task.min_new_tokens)
    for config in pending_fidelity:
        start = time.process_time()
        steps = compare_steps(reference, config.spec, shared)
        row = {"_id": record_id(record, index), "index": index, "steps": len(steps["top1"]), **steps,
               "cpu_s": round(time.process_time() - start, 2)}
        append_row(config.fidelity_path(task, fidelity_steps), row)
        fidelity[config.label].append(row)


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


def sample_scores(task: Task, rows: list[dict[str, Any]]) -> list[float]:
    """Each record's own metric value (0-100, the official score of that record alone): the per-sample values the
    task's score is the mean of, which its interval resamples."""
    return [task.score([row])["score"] for row in rows]


def score_interval(values: list[float]) -> dict[str, Any]:
    """The official score's 95% interval and standard error (`analysis/bootstrap.py`) from per-sample values."""
    interval = bootstrap.mean_interval(values)
    return {} if interval is None else interval.fields("score")


def agreement_with_reference(task: Task, rows: list[dict[str, Any]], reference_rows: list[dict[str, Any]]
                             ) -> dict[str, Any] | None:
    """How far a method's predictions are from FullKV's own on the same records: the exact-match rate, the task's
    metric with FullKV's prediction as the only reference (records where that metric is undefined, e.g. a
    retrieval reference without a paragraph number, are left out and counted), and the official score's change
    relative to FullKV's on the same records, each with its bootstrap interval over the records (the change
    paired: a resample takes the same records on both sides; `score_change_resolved`: its interval excludes 0).
    `samples` holds the per-record values (`exact_match` 0 or 100, `metric_vs_fullkv_pred` or None, FullKV's own
    `fullkv_score`). None when FullKV has none of these records."""
    n = min(len(rows), len(reference_rows))
    if n == 0:
        return None
    ours, theirs = rows[:n], reference_rows[:n]
    exact = [100.0 * (a["pred"] == b["pred"]) for a, b in zip(ours, theirs, strict=True)]
    as_reference = getattr(task, "reference_answer", lambda pred: pred)  # passkey: the key FullKV answered
    metric: list[float | None] = []
    for a, b in zip(ours, theirs, strict=True):
        try:
            metric.append(task.score([{**a, "answers": [as_reference(b["pred"])]}])["score"])
        except ValueError:
            metric.append(None)
    defined = [value for value in metric if value is not None]
    score, reference_score = task.score(ours)["score"], task.score(theirs)["score"]
    change = 100 * (score - reference_score) / reference_score if reference_score else None
    own, fullkv = sample_scores(task, ours), sample_scores(task, theirs)
    out: dict[str, Any] = {
        "n": n, "exact_match": round(statistics.fmean(exact), 2),
        "metric_vs_fullkv_pred": round(statistics.fmean(defined), 2) if defined else None,
        "metric_undefined": n - len(defined), "score": score, "fullkv_score": reference_score,
        "score_change_pct": None if change is None else round(change, 2)}
    for name, interval in (("exact_match", bootstrap.mean_interval(exact)),
                           ("metric_vs_fullkv_pred", bootstrap.mean_interval(defined) if defined else None),
                           ("score_change_pct", bootstrap.bootstrap([n], bootstrap.change_pct([own], [fullkv])))):
        if interval is not None:
            out |= interval.fields(name)
            if name == "score_change_pct":
                out["score_change_resolved"] = interval.resolved
    out["samples"] = [{"index": a["index"], "exact_match": e, "metric_vs_fullkv_pred": v, "fullkv_score": f}
                      for a, e, v, f in zip(ours, exact, metric, fullkv, strict=True)]
    return out


def fidelity_summary(rows: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Teacher-forced fidelity over every (record, step) compared: top-1 agreement (%) and mean KL (nats), each
    with its bootstrap interval over the records (every compared step weighs the same); `samples` per record."""
    top1 = [value for row in rows for value in row["top1"]]
    kl = [value for row in rows for value in row["kl"]]
    cpu = [row["cpu_s"] for row in rows if row.get("cpu_s") is not None]
    out = {"steps": steps, "records": len(rows), "compared_steps": len(top1),
           "cpu_s_per_record": round(sum(cpu) / len(cpu), 2) if cpu else None,
           "top1_agreement": round(100 * sum(top1) / len(top1), 2) if top1 else None,
           "kl_mean": sum(kl) / len(kl) if kl else None, "kl_max": max(kl) if kl else None}
    counts = [len(row["top1"]) for row in rows]
    for name, per_record, scale, digits in (("top1_agreement", [sum(row["top1"]) for row in rows], 100, 2),
                                            ("kl_mean", [sum(row["kl"]) for row in rows], 1, 4)):
        interval = bootstrap.bootstrap([len(rows)], bootstrap.pooled([[scale * v for v in per_record]], [counts])) \
            if rows else None
        if interval is not None:
            out |= interval.fields(name, digits)
    out["samples"] = [{"index": row["index"], "steps": len(row["top1"]),
                       "top1_agreement": round(100 * sum(row["top1"]) / len(row["top1"]), 2) if row["top1"] else None,
                       "kl_mean": sum(row["kl"]) / len(row["kl"]) if row["kl"] else None} for row in rows]
    return out


def task_entry(task: Task, own: list[dict[str, Any]], budget: int | None, predictions: str,
               reference_rows: list[dict[str, Any]] | None, fidelity_rows: list[dict[str, Any]] | None,
               fidelity_steps: int) -> dict[str, Any]:
    """A task's entry of result.json from its prediction rows: the official score with its interval and standard
    error, the per-sample values, n, the records the budget covered, CPU seconds; beside FullKV (`reference_rows`)
    the agreement, and the fidelity (`fidelity_rows`)."""
    dense = sum(budget is not None and budget >= row["input_tokens"] + task.max_new_tokens for row in own)
    values = sample_scores(task, own)
    entry = {**task.score(own), **score_interval(values), "n": len(own), "dense_records": dense, **task.describe(),
             "predictions": predictions, "prompts_sha256": prompts_sha256(own),
             "samples": [{"index": row["index"], "_id": row["_id"], "score": value}
                         for row, value in zip(own, values, strict=True)]}
    for key, field in (("cpu_s_per_record", "cpu_s"), ("shared_prefill_cpu_s_per_record", "shared_prefill_cpu_s")):
        cpu = [row[field] for row in own if row.get(field) is not None]
        if cpu:
            entry[key] = round(sum(cpu) / len(cpu), 2)
    if reference_rows is not None:
        entry["vs_fullkv"] = agreement_with_reference(task, own, reference_rows)
    if fidelity_rows is not None:
        entry["fidelity"] = fidelity_summary(fidelity_rows, fidelity_steps)
    return entry


def rescore_folder(folder: Path, tasks: list[Task], reference_folder: Path | None) -> dict[str, Any]:
    """A run folder's result.json with each of `tasks` that has a prediction file rescored from its files, as a
    run of this version scores it (per-sample values, intervals, the agreement with the predictions in
    `reference_folder` and the fidelity of the steps its result names). Reads only: a folder of a configuration
    that today's methods no longer build (another hash) is scored as it stands."""
    result = json.loads((folder / "result.json").read_text("utf-8"))
    budget = (result.get("method_config") or {}).get("budget")
    # one --fidelity-steps for every task of a run: a task the stored result does not have yet uses the others'
    steps = next((entry["fidelity"]["steps"] for entry in (result.get("results") or {}).values()
                  if isinstance(entry, dict) and isinstance(entry.get("fidelity"), dict)), 0)
    results = {}
    for task in tasks:
        path = folder / f"{task.name}.jsonl"
        own = read_predictions(path, task.records, repair=False) if path.exists() else []
        if not own:
            continue
        theirs = fidelity = None
        if reference_folder is not None and folder != reference_folder:
            theirs = read_predictions(reference_folder / f"{task.name}.jsonl", task.records, repair=False)
            if steps and (folder / fidelity_file_name(task.name, steps)).exists():
                fidelity = read_rows(folder / fidelity_file_name(task.name, steps), task.records,
                                     fidelity_row_problem, repair=False)
        results[task.name] = task_entry(task, own, budget, path.name, theirs, fidelity, steps)
    return {**result, "results": results}


def run_accuracy(tasks: list[Task], loaded: LoadedModel, spec: MethodSpec, out_dir: str | Path,
                 max_length: int | None, seed: int, limit: int | None, command: list[str] | None = None,
                 on_progress: ProgressCallback | None = None) -> tuple[dict[str, Any], Path]:
    """One method configuration: `run_comparison` with one spec; returns its result and path."""
    return run_comparison(tasks, loaded, [spec], out_dir, max_length, seed, limit, command, on_progress)[0]


def run_comparison(tasks: list[Task], loaded: LoadedModel, specs: list[MethodSpec], out_dir: str | Path,
                   max_length: int | None, seed: int, limit: int | None, command: list[str] | None = None,
                   on_progress: ProgressCallback | None = None, fidelity_steps: int = 0, generate: bool = True
                   ) -> list[tuple[dict[str, Any], Path]]:
    """Predict and score every task for every configuration (one dense prefill per record shared by all of them);
    returns each configuration's result and path, in `specs` order. Each configuration keeps its own folder
    (`run_dir`), resumable on its own, and its result.json: scores of other tasks already there are kept, the
    tasks of this call are rescored from their files, with the agreement with FullKV's predictions (when FullKV's
    folder for the same model, dtype, device, max length and seed has them) and the fidelity (`fidelity_steps`).
    The results are rewritten after each task, so a long run's finished tasks are scored while it goes on.
    `generate=False` scores what is on disk without generating or writing anything (no lock: it may read the files
    of a run in progress; its tasks' `n` say how far that run got)."""
    configs = [make_config(spec, loaded, out_dir, max_length, seed) for spec in specs]
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise UsageError(f"the same method configuration twice: {', '.join(labels)}")
    reference = next((c for c in configs if c.is_reference), None) or \
        make_config(MethodSpec(FullKV.name), loaded, out_dir, max_length, seed)
    with contextlib.ExitStack() as locks:
        if generate:
            for config in configs:  # two runs appending to one prediction file would interleave their lines
                locks.enter_context(output_lock(config.folder))
        rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
        outcomes: list[tuple[dict[str, Any], Path]] = []
        for done, task in enumerate(tasks, start=1):
            rows[task.name] = predict_task(task, loaded, configs, fidelity_steps, on_progress, generate)
            if generate or done == len(tasks):
                outcomes = [_result(config, reference, tasks[:done], rows, loaded, max_length, seed, limit,
                                    command, fidelity_steps, write=generate) for config in configs]
        return outcomes


def _result(config: Config, reference: Config, tasks: list[Task], rows: dict[str, dict[str, list]],
            loaded: LoadedModel, max_length: int | None, seed: int, limit: int | None, command: list[str] | None,
            fidelity_steps: int, write: bool) -> tuple[dict[str, Any], Path]:
    parameter = next(loaded.model.parameters())
    result_path = config.folder / "result.json"
    results: dict[str, Any] = {}
    if result_path.exists() and write:
        try:
            results = json.loads(result_path.read_text("utf-8")).get("results", {})
        except (ValueError, AttributeError):
            results = {}  # an unreadable summary: every score can be recomputed from its predictions
        if not isinstance(results, dict):
            results = {}
    budget = config.method["method_config"].get("budget")
    for task in tasks:
        own = rows[task.name][config.label]
        if not own:
            continue  # nothing generated yet (a run in progress)
        theirs = fidelity = None
        if not config.is_reference:
            theirs = rows[task.name].get(reference.label)
            if theirs is None:
                theirs = read_predictions(reference.predictions_path(task), task.records, write)
            if fidelity_steps:
                fidelity = read_rows(config.fidelity_path(task, fidelity_steps), task.records, fidelity_row_problem,
                                     write)
        results[task.name] = task_entry(task, own, budget, config.predictions_path(task).name, theirs, fidelity,
                                        fidelity_steps)
    result = {
        **envelope("accuracy", command, scoring=scoring_versions()),
        **config.method, "label": config.label, "model": loaded.describe(parameter.dtype),
        "device": device_description(parameter.device), "max_length": max_length, "seed": seed, "limit": limit,
        "results": results,
    }
    if write:
        write_json_atomic(result_path, result, overwrite=True)
    return result, result_path

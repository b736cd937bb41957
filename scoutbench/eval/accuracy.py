"""The accuracy runner: generate predictions for LongBench or passkey tasks under one or several method
configurations, score them officially, and compare each with FullKV.

Layout of a run, under `-o DIR`, one folder per method configuration:
    DIR/<model>/<method>-<config hash>/<task>.jsonl   one line per sample, in the official prediction format
                                                     (`pred`, `answers`, `all_classes`, `length`) plus `_id`,
                                                     `index`, `input_tokens`, `prompt_sha256` and its CPU seconds;
                                                     official eval.py reads it as is
    DIR/<model>/<method>-<config hash>/<task>.fidelity-N.jsonl   per sample, the method teacher-forced on
                                                     FullKV's first N generated tokens: top-1 agreement, KL and
                                                     hidden-state cosine per step (`--fidelity-steps N`)
    DIR/<model>/<method>-<config hash>/result.json    scores, agreement with FullKV, fidelity, config and
                                                     provenance, written atomically

Several configurations in one run share one dense prefill per record (`generation.SharedPrefill`; the prefill
does not depend on the method, and at long context it is most of the time); each still predicts exactly what a
run of its own predicts.

The hash covers everything that changes a prediction (model, method repr, dtype, device type, max length, seed),
so a rerun of the same command finds its own files: samples already on disk are skipped, each new line is flushed
as soon as it is generated (an interruption loses at most the sample in flight), and a line left half-written by
an interruption is dropped and regenerated. Lines are checked against the data (`_id` at each index), so
predictions for other data are never mixed in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import torch

from scoutbench.devices import device_description
from scoutbench.errors import UsageError
from scoutbench.eval.fidelity import compare_steps, fullkv_reference
from scoutbench.eval.generation import Generation, MethodSpec, SharedPrefill, generate_text, model_eos_ids
from scoutbench.eval.score import fidelity_file_name, prediction_row_problem
from scoutbench.methods.fullkv import FullKV
from scoutbench.models import LoadedModel
from scoutbench.results import envelope, output_lock, write_json_atomic

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


# ---------------------------------------------------------------------------------------------- row files
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
    """One hash of a task's prompts in order (lm-eval's `task_hashes`); None if a row predates prompt hashes."""
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


def _append_row(path: Path, row: dict[str, Any]) -> None:
    """One line, flushed and synced: an interruption loses at most the line being written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
        out.flush()
        os.fsync(out.fileno())


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
            _append_row(config.predictions_path(task), row)
            rows[config.label].append(row)
        else:
            _predict_shared(task, loaded, index, prompt_ids, pending, pending_fidelity, fidelity_steps, stop_ids,
                            rows, fidelity)
        if on_progress:
            on_progress(task.name, index + 1, total)
    return rows


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
        _append_row(config.predictions_path(task), row)
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
        _append_row(config.fidelity_path(task, fidelity_steps), row)
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


def agreement_with_reference(task: Task, rows: list[dict[str, Any]], reference_rows: list[dict[str, Any]]
                             ) -> dict[str, Any] | None:
    """How far a method's predictions are from FullKV's own on the same records: the exact-match rate, the task's
    metric with FullKV's prediction as the only reference (records where that metric is undefined, e.g. a
    retrieval reference without a paragraph number, are left out and counted), and the official score's change
    relative to FullKV's on the same records. None when FullKV has none of these records."""
    n = min(len(rows), len(reference_rows))
    if n == 0:
        return None
    ours, theirs = rows[:n], reference_rows[:n]
    exact = sum(a["pred"] == b["pred"] for a, b in zip(ours, theirs, strict=True))
    as_reference = getattr(task, "reference_answer", lambda pred: pred)  # passkey: the key FullKV answered
    metric = []
    for a, b in zip(ours, theirs, strict=True):
        try:
            metric.append(task.score([{**a, "answers": [as_reference(b["pred"])]}])["score"])
        except ValueError:
            continue
    score, reference_score = task.score(ours)["score"], task.score(theirs)["score"]
    change = 100 * (score - reference_score) / reference_score if reference_score else None
    return {"n": n, "exact_match": round(100 * exact / n, 2),
            "metric_vs_fullkv_pred": round(sum(metric) / len(metric), 2) if metric else None,
            "metric_undefined": n - len(metric), "score": score, "fullkv_score": reference_score,
            "score_change_pct": None if change is None else round(change, 2)}


def fidelity_summary(rows: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Teacher-forced fidelity over every (record, step) compared: top-1 agreement (%) and mean KL (nats)."""
    top1 = [value for row in rows for value in row["top1"]]
    kl = [value for row in rows for value in row["kl"]]
    cpu = [row["cpu_s"] for row in rows if row.get("cpu_s") is not None]
    return {"steps": steps, "records": len(rows), "compared_steps": len(top1),
            "cpu_s_per_record": round(sum(cpu) / len(cpu), 2) if cpu else None,
            "top1_agreement": round(100 * sum(top1) / len(top1), 2) if top1 else None,
            "kl_mean": sum(kl) / len(kl) if kl else None, "kl_max": max(kl) if kl else None}


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
        dense = sum(budget is not None and budget >= row["input_tokens"] + task.max_new_tokens for row in own)
        entry = {**task.score(own), "n": len(own), "dense_records": dense, **task.describe(),
                 "predictions": config.predictions_path(task).name, "prompts_sha256": prompts_sha256(own)}
        for key, field in (("cpu_s_per_record", "cpu_s"), ("shared_prefill_cpu_s_per_record", "shared_prefill_cpu_s")):
            cpu = [row[field] for row in own if row.get(field) is not None]
            if cpu:
                entry[key] = round(sum(cpu) / len(cpu), 2)
        if not config.is_reference:
            theirs = rows[task.name].get(reference.label)
            if theirs is None:
                theirs = read_predictions(reference.predictions_path(task), task.records, write)
            entry["vs_fullkv"] = agreement_with_reference(task, own, theirs)
            if fidelity_steps:
                fidelity = read_rows(config.fidelity_path(task, fidelity_steps), task.records, fidelity_row_problem,
                                     write)
                entry["fidelity"] = fidelity_summary(fidelity, fidelity_steps)
        results[task.name] = entry
    result = {
        **envelope("accuracy", command, scoring=scoring_versions()),
        **config.method, "label": config.label, "model": loaded.describe(parameter.dtype),
        "device": device_description(parameter.device), "max_length": max_length, "seed": seed, "limit": limit,
        "results": results,
    }
    if write:
        write_json_atomic(result_path, result, overwrite=True)
    return result, result_path


# ---------------------------------------------------------------------------------------------- comparison tables
def comparison_tables(results: list[dict[str, Any]], task_names: list[str]) -> list[tuple[str, list[str],
                                                                                      list[list[str]]]]:
    """The method configurations side by side, one row per task plus the mean over tasks: (title, header, rows)
    for the official score with its change relative to FullKV, the agreement with FullKV's own predictions, the
    teacher-forced fidelity (when measured) and the CPU seconds per record. Plain strings, for the terminal and
    for markdown alike."""
    reference = next((r for r in results if r["method_repr"] == repr(FullKV())), None)
    compared = [r for r in results if r is not reference]

    def entry(result: dict[str, Any] | None, name: str) -> dict[str, Any]:
        return (result or {}).get("results", {}).get(name) or {}

    def n_of(name: str) -> str:
        return "/".join(str(c) for c in sorted({entry(r, name).get("n") for r in results} - {None}))

    def mean(values: list[float | None]) -> float | None:
        return None if not values or any(v is None for v in values) else sum(values) / len(values)

    def fmt(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def change(score: float | None, base: float | None) -> str:
        return "" if score is None or not base else f" ({100 * (score - base) / base:+.1f}%)"

    # the mean over the tasks that every configuration has (all of them once a run has finished)
    done = [t for t in task_names if all(entry(r, t) for r in results)]
    partial = "" if len(done) == len(task_names) else f" ({len(done)} of {len(task_names)} tasks)"
    mean_label = "mean" + partial
    rows = []
    for name in [*task_names, "mean"]:
        if name == "mean":
            scores = [mean([entry(r, t).get("score") for t in done]) for r in results]
            base = mean([entry(reference, t).get("score") for t in done]) if reference else None
            first = [mean_label, "", ""]
        else:
            scores = [entry(r, name).get("score") for r in results]
            base = entry(reference, name).get("score")
            first = [name, next((entry(r, name)["metric"] for r in results if entry(r, name)), ""), n_of(name)]
        rows.append([*first, *(fmt(score) + ("" if r is reference else change(score, base))
                               for score, r in zip(scores, results, strict=True))])
    tables = [("official score (change vs FullKV)", ["task", "metric", "n", *(r["label"] for r in results)], rows)]
    header = ["task", "n", *(r["label"] for r in compared)]

    def agreement(result: dict[str, Any], names: list[str]) -> str:
        vs = [entry(result, name).get("vs_fullkv") for name in names]
        if not all(vs):
            return "-"
        return (f"{fmt(mean([v['exact_match'] for v in vs]), 1)} / "
                f"{fmt(mean([v['metric_vs_fullkv_pred'] for v in vs]), 1)}")

    if any(entry(r, t).get("vs_fullkv") for r in compared for t in task_names):
        rows = [[name, n_of(name), *(agreement(r, [name]) for r in compared)] for name in task_names]
        rows.append([mean_label, "", *(agreement(r, done) for r in compared)])
        tables.append(("agreement with FullKV's prediction: exact match % / metric with FullKV's prediction as the "
                       "reference", header, rows))

    def fidelity(result: dict[str, Any], names: list[str]) -> str:
        fids = [entry(result, name).get("fidelity") for name in names]
        if not fids or not all(f and f["compared_steps"] for f in fids):
            return "-"
        steps = sum(f["compared_steps"] for f in fids)  # the mean over every compared (record, step)
        top1 = sum(f["top1_agreement"] * f["compared_steps"] for f in fids) / steps
        kl = sum(f["kl_mean"] * f["compared_steps"] for f in fids) / steps
        return f"{fmt(top1, 1)} / {kl:.3g}"

    steps = next((entry(r, t)["fidelity"]["steps"] for r in compared for t in task_names
                  if entry(r, t).get("fidelity")), None)
    if steps:
        rows = [[name, n_of(name), *(fidelity(r, [name]) for r in compared)] for name in task_names]
        rows.append(["all steps" + partial, "", *(fidelity(r, done) for r in compared)])
        tables.append((f"teacher-forced fidelity over FullKV's first {steps} generated tokens: top-1 agreement % / "
                       "KL(FullKV || method) nats", header, rows))

    def cpu(result: dict[str, Any], name: str) -> str:
        own, fid = entry(result, name).get("cpu_s_per_record"), (entry(result, name).get("fidelity") or {})
        extra = fid.get("cpu_s_per_record")
        return fmt(own, 0) + ("" if extra is None else f" + {extra:.0f}")

    if any(entry(r, t).get("cpu_s_per_record") is not None for r in results for t in task_names):
        rows = [[name, n_of(name), fmt(max((entry(r, name)["shared_prefill_cpu_s_per_record"] for r in results
                                            if "shared_prefill_cpu_s_per_record" in entry(r, name)), default=None), 0),
                 *(cpu(r, name) for r in results)] for name in task_names]
        tables.append(("CPU seconds per record: the shared dense prefill, then each configuration's decode "
                       "(+ its teacher-forced fidelity)", ["task", "n", "prefill", *(r["label"] for r in results)],
                       rows))
    return tables


def tables_markdown(tables: list[tuple[str, list[str], list[list[str]]]]) -> str:
    parts = []
    for title, header, rows in tables:
        lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"

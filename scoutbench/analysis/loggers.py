"""Experiment trackers for `scoutbench export --mlflow / --wandb`: one tracker run per result file, with the run's
identity as parameters, its numbers as metrics, every timed decode step as a step series, and the result JSON
itself attached. Both work offline: MLflow into a local folder, W&B in offline mode (`wandb sync` uploads later).
Installed by the `mlflow` and `wandb` extras and imported only here.

A result is logged once: its run is tagged with the sha256 of the result's content (`export.result_sha256`), and
exporting it again finds that run and logs nothing (MLflow: a tag search; W&B: the run id is made from the hash).
A run's time is when the result was measured (its `created_at`), not when it was exported.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from scoutbench.analysis.export import flatten, result_sha256, run_names
from scoutbench.errors import ScoutbenchError

RESULT_TAG = "scoutbench.result_sha256"

# Flattened fields that say what ran (tracker parameters) and what was measured (tracker metrics).
PARAM_PREFIXES = ("kind", "method", "method_repr", "method_config.", "model.", "workload.", "device.", "budget",
                  "effective_budget", "sparse", "kv_source", "scoutbench_version", "created_at", "max_length", "seed",
                  "limit", "env.git_commit", "env.git_dirty", "env.workdir_git.", "env.torch", "env.transformers",
                  "env.cpu_capability", "env.gpu.", "env.partial_attention_backend")
METRIC_PREFIXES = ("decode_throughput_tok_s", "decode_time_s", "prefill_ms", "decode_step_ms.", "latency_breakdown_ms.",
                   "latency_breakdown_frac.", "gpu_idle_frac", "main_thread_wait_frac", "nvml.", "method_stats.",
                   "results.")
NOT_PARAMS = ("model.cache_dir",)


def _matches(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def params_and_metrics(result: dict[str, Any]) -> tuple[dict[str, str], dict[str, float]]:
    """(parameters as strings, finite numeric metrics) of one result; booleans are parameters, never metrics."""
    flat = flatten(result)
    params = {k: "" if v is None else str(v) for k, v in flat.items()
              if _matches(k, PARAM_PREFIXES) and k not in NOT_PARAMS and not isinstance(v, (list, dict))}
    metrics = {k: float(v) for k, v in flat.items() if _matches(k, METRIC_PREFIXES)
               and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")}
    return params, metrics


def _result_file(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "_path"}


def measured_at_ms(result: dict[str, Any]) -> int | None:
    """The result's `created_at` (when its run wrote it) in epoch milliseconds; None when absent or unreadable."""
    try:
        return int(datetime.fromisoformat(str(result.get("created_at"))).timestamp() * 1000)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------- MLflow
MLFLOW_HINT = 'pip install "scoutbench[mlflow]"'


def mlflow_tracking_uri(target: str) -> str:
    """A folder (or `file:` URI) becomes MLflow's local file store; any other URI (sqlite:, http:, databricks)
    is passed through."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", target) or target.startswith(("sqlite:", "databricks")):
        return target
    return Path(target).resolve().as_uri()


def log_mlflow(results: list[dict[str, Any]], target: str, experiment: str = "scoutbench") -> tuple[list[str], int]:
    """One MLflow run per result in `experiment` at `target`, unless a run of that result is there already;
    returns (the new runs' ids, how many results were logged before)."""
    uri = mlflow_tracking_uri(target)
    if uri.startswith("file:"):
        # MLflow 3 keeps its file store in maintenance mode and refuses it unless this is set: it is the one store
        # that needs no server and no database, which is what an offline benchmark machine has.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    try:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ScoutbenchError(f"--mlflow needs the MLflow client: {MLFLOW_HINT}") from None
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
    run_ids, already = [], 0
    for result, name in zip(results, run_names(results), strict=True):
        digest = result_sha256(result)
        if client.search_runs([experiment_id], filter_string=f"tags.`{RESULT_TAG}` = '{digest}'", max_results=1):
            already += 1
            continue
        params, metrics = params_and_metrics(result)
        measured_ms = measured_at_ms(result)
        run = client.create_run(experiment_id, run_name=name, start_time=measured_ms,
                                tags={RESULT_TAG: digest, "scoutbench.source_file": str(result.get("_path", "")),
                                      "scoutbench.kind": str(result.get("kind")),
                                      "scoutbench.version": str(result.get("scoutbench_version"))})
        at_ms = measured_ms if measured_ms is not None else run.info.start_time
        entries = [Metric(k, v, at_ms, 0) for k, v in metrics.items()]
        entries += [Metric("step_ms", float(v), at_ms, i) for i, v in enumerate(result.get("step_ms") or [])]
        items = [Param(k, v[:6000]) for k, v in params.items()]  # MLflow's limit per parameter value
        for start in range(0, len(items), 100):  # log_batch takes at most 100 params and 1000 metrics a call
            client.log_batch(run.info.run_id, params=items[start:start + 100])
        for start in range(0, len(entries), 1000):
            client.log_batch(run.info.run_id, metrics=entries[start:start + 1000])
        client.log_dict(run.info.run_id, _result_file(result), "result.json")
        client.set_terminated(run.info.run_id, end_time=at_ms)
        run_ids.append(run.info.run_id)
    return run_ids, already


# ---------------------------------------------------------------------------------------------- W&B
WANDB_HINT = 'pip install "scoutbench[wandb]"'


def log_wandb(results: list[dict[str, Any]], project: str, folder: str | Path,
              mode: str = "offline") -> tuple[list[str], int]:
    """One W&B run per result in `project`, written under `folder` (offline: `folder/wandb/offline-run-*`, uploaded
    by `wandb sync` later). The run id is made from the result's hash: a result whose offline run is already in
    `folder` is not logged again, and online a second export resumes the same run. Returns (the new runs' ids, how
    many results were logged before)."""
    try:
        import wandb
    except ImportError:
        raise ScoutbenchError(f"--wandb needs the W&B client: {WANDB_HINT}") from None
    Path(folder).mkdir(parents=True, exist_ok=True)
    run_ids: list[str] = []
    already = 0
    try:
        already = _wandb_runs(wandb, results, project, folder, mode, run_ids)
    finally:
        # finish() hands the records to W&B's service process, which writes them later: wait for it, so the
        # offline runs are complete on disk (and uploaded, online) when export returns
        wandb.teardown()
    return run_ids, already


def wandb_run_id(result: dict[str, Any]) -> str:
    """A W&B run id for the result: the first 32 hex digits of its content's sha256 (W&B ids are at most 64 of
    letters, digits, `-` and `_`, unique per project)."""
    return result_sha256(result)[:32]


def _wandb_runs(wandb: Any, results: list[dict[str, Any]], project: str, folder: str | Path, mode: str,
                run_ids: list[str]) -> int:
    already = 0
    for result, name in zip(results, run_names(results), strict=True):
        run_id = wandb_run_id(result)
        if mode == "offline" and any(Path(folder, "wandb").glob(f"offline-run-*-{run_id}")):
            already += 1
            continue
        params, metrics = params_and_metrics(result)
        run = wandb.init(project=project, name=name, dir=str(folder), mode=mode, id=run_id, resume="allow",
                         config={**params, "scoutbench.source_file": str(result.get("_path", "")),
                                 RESULT_TAG: result_sha256(result)},
                         reinit="create_new", tags=[str(result.get("kind")), str(result.get("method"))])
        for index, step in enumerate(result.get("step_ms") or []):
            run.log({"step_ms": step}, step=index)
        run.summary.update(metrics)
        run.finish()
        run_ids.append(run.id)
    return already

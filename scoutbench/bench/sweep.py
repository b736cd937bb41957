"""Sweeps: a grid of throughput points run into one folder, one JSON per point plus a `sweep.json` manifest.

The point files are the source of truth, so a sweep is resumable by construction: a rerun skips every point whose
file records this point and this sweep's settings (`sweep_point`: a file's name is no proof of either), and a point
interrupted by Ctrl-C or a kill never has a file (results are written with a temp file and a rename, and the
manifest is rewritten the same way after every point). The folder's settings are its manifest's, or where the
manifest is gone, its point files': a rerun with other settings is refused either way. A point that fails (out of
memory, a budget above its context, any error) gets a file with `"status": "failed"` and its error, and the sweep
goes on.

The grid, its presets and `--config` are planned in `bench/sweep_grid.py`; this module runs and resumes the points.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scoutbench.bench.executors import Runner, ThroughputRunner
from scoutbench.bench.sweep_grid import Settings, SweepPoint, run_environment, settings_record, write_config
from scoutbench.errors import UsageError, error_text
from scoutbench.tiers import wait_frac
from scoutbench.units import format_length

MANIFEST = "sweep.json"
MANIFEST_INTERVAL_S = 2.0  # the least time between two rewrites of the manifest while points finish
COMPACT_MANIFEST_POINTS = 1000  # a larger manifest is written without indentation: far less text to write
CONFIG = "sweep_config.yaml"  # the resolved grid and settings, written beside the points (a valid --config)


# ---- running --------------------------------------------------------------------------------------------------

@dataclass
class SweepOutcome:
    manifest: dict[str, Any]
    ran: int = 0
    skipped: int = 0

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [p for p in self.manifest["points"] if p["status"] == "failed"]


def run_sweep(points: list[SweepPoint], settings: Settings, out_dir: str | Path, runner: Runner | None = None,
              preset: str | None = None, command: list[str] | None = None, retry_failed: bool = False,
              log: Callable[[str], None] = lambda line: None, executor: Any = None,
              recall_profiles: bool = False, config: dict[str, Any] | None = None) -> SweepOutcome:
    """Run every point whose file is not in `out_dir` yet (failed points too with `retry_failed`), holding the
    folder's writer lock throughout. `recall_profiles` (the presets) gives every periodic-recall ScoutAttention
    point without a `recall_profile` one profiled into the folder first (`attach_recall_profiles`).

    `executor` (scoutbench/bench/executors.py) runs the points, here by default or as Ray tasks; this driver alone
    writes the result files and the manifest, as each point comes back."""
    from scoutbench.results import check_writable, output_lock

    out = Path(out_dir)
    check_writable(out, single_file=False)
    environment = run_environment(settings.device)
    with output_lock(out):  # one sweep per folder: the stale-temp cleanup below must not hit a live writer's file
        previous, stamped = _folder_state(out, settings, environment)  # a refused rerun profiles and runs nothing
        if recall_profiles:
            points = attach_recall_profiles(points, settings, out, log)
        return _run_sweep_locked(points, settings, environment, out, previous, stamped, runner, preset, command,
                                 retry_failed, log, executor, config)


def _folder_state(out: Path, settings: Settings, environment: dict[str, Any]
                  ) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """The folder's manifest (None when absent) and, where it is absent, the point files stamped with this sweep's
    settings (by id: what a rebuilt manifest lists). Refuses (exit 2) a folder whose manifest, or without one any
    of whose point files, records other settings or another environment (`run_environment`: a resume with
    SCOUTBENCH_CPU_ATTENTION=torch counted the compiled kernel's points as done)."""
    previous = _read_manifest(out)
    mine = settings_record(settings, environment)
    if previous is not None:
        if previous.get("settings") != mine:
            raise UsageError(f"{out} holds a sweep with other settings "
                             f"({_settings_diff(previous['settings'], mine)}); use another -o folder or the same "
                             "settings to resume it")
        return previous, {}
    stamped = {}
    for path in sorted(out.glob("*.json")):
        result = _read_point(path)
        stamp = result.get("sweep_point") if result is not None else None
        if not isinstance(stamp, dict) or not isinstance(stamp.get("settings"), dict):
            continue  # not a point of a sweep (a recall profile, a throughput result copied in): not this folder's
        if stamp["settings"] != mine:
            raise UsageError(f"{out} holds sweep points with other settings ({path.name}: "
                             f"{_settings_diff(stamp['settings'], mine)}); use another -o folder or the same "
                             "settings to resume it")
        stamped[path.stem] = result
    return None, stamped


def _run_sweep_locked(points: list[SweepPoint], settings: Settings, environment: dict[str, Any], out: Path,
                      previous: dict[str, Any] | None,
                      stamped: dict[str, dict[str, Any]], runner: Runner | None, preset: str | None,
                      command: list[str] | None, retry_failed: bool, log: Callable[[str], None], executor: Any,
                      config: dict[str, Any] | None = None) -> SweepOutcome:
    from scoutbench.bench.executors import Job, LocalExecutor
    from scoutbench.bench.throughput import failed_result
    from scoutbench.devices import device_description, resolve_device, resolve_dtype
    from scoutbench.results import envelope, utc_now, write_json_atomic

    for stale in out.glob(".*.tmp"):  # left by a kill during a write; never a result
        stale.unlink(missing_ok=True)
        log(f"removed stale temp file {stale.name}")
    command = command or ["scoutbench", "sweep"]
    resolved = resolve_device(settings.device)
    device = device_description(resolved)
    dtype = str(resolve_dtype(settings.dtype, resolved)).removeprefix("torch.")
    # a lone point keeps no synthetic prefill for a next one, as a one-method throughput command does not
    runner = runner or ThroughputRunner(share_kv=len(points) > 1)
    # points of earlier grids into this folder: as the manifest lists them, or rebuilt from their stamped files
    entries: dict[str, dict[str, Any]] = {e["id"]: e for e in (previous or {}).get("points", [])}
    entries.update({point_id: _entry(point_id, result["sweep_point"]["point"], result)
                    for point_id, result in stamped.items()})
    recorded = settings_record(settings, environment)
    manifest = {**envelope("sweep", command), "updated_at": utc_now(), "preset": preset, "settings": recorded,
                "points": []}
    by_id = {p.point_id(settings.model): p for p in points}
    saved = {"at": -math.inf, "took_s": 0.0}

    def save(now: bool = True) -> None:
        """Rewrite the manifest; after a point (`now` false) only every MANIFEST_INTERVAL_S, or ten times as long
        as the last rewrite took: a grid of 10^4 points has a 2.4 MB manifest, and rewriting it after every point
        cost more than fast points did. The point files are the record: a rerun rebuilds what a kill left stale."""
        start = time.monotonic()
        if not now and start - saved["at"] < max(MANIFEST_INTERVAL_S, 10 * saved["took_s"]):
            return
        manifest["updated_at"] = utc_now()
        manifest["points"] = [entries[i] for i in [*by_id, *(i for i in entries if i not in by_id)]]
        compact = len(manifest["points"]) > COMPACT_MANIFEST_POINTS
        write_json_atomic(out / MANIFEST, manifest, overwrite=True, indent=None if compact else 2)
        saved["at"], saved["took_s"] = time.monotonic(), time.monotonic() - start

    if previous is not None:  # a resumed sweep keeps the time it started
        manifest["created_at"] = previous["created_at"]
    stamps = {point_id: point.stamp(settings, recorded, environment) for point_id, point in by_id.items()}
    present = {path.name for path in out.iterdir()}  # one listing, not a failed open per pending point
    for point_id in by_id:
        result = _read_point(out / f"{point_id}.json", stamps[point_id]) if f"{point_id}.json" in present else None
        entries[point_id] = _entry(point_id, stamps[point_id]["point"], result)
    save()
    if config is not None:  # after the settings check: a refused rerun leaves the folder's config as it was
        write_config(out / CONFIG, config)
    outcome = SweepOutcome(manifest)
    jobs = []
    for index, (point_id, point) in enumerate(by_id.items(), 1):
        done = entries[point_id]
        where = f"[{index}/{len(by_id)}] {point_id}"
        if done["status"] == "ok" or (done["status"] == "failed" and not retry_failed):
            outcome.skipped += 1
            log(f"{where}: already {done['status']}, skipped")
            continue
        jobs.append(Job(point_id, where, point.config(settings, command)))
    try:
        for job, result in (executor or LocalExecutor()).run(jobs, runner, log):
            if not isinstance(result, dict):
                result = failed_result(job.cfg, error_text(result), device, dtype)
            result = {**result, "sweep_point": stamps[job.point_id]}
            write_json_atomic(out / f"{job.point_id}.json", result, overwrite=True)
            entries[job.point_id] = _entry(job.point_id, stamps[job.point_id]["point"], result)
            outcome.ran += 1
            log(f"{job.where}: {_one_line(result)}")
            save(now=False)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the manifest lists every finished point
        save()
        raise
    save()
    return outcome


RecallProfiler = Callable[..., dict[str, Any]]  # scoutbench.bench.recall.profile_recall's signature


def attach_recall_profiles(points: list[SweepPoint], settings: Settings, out: Path,
                           log: Callable[[str], None] = lambda line: None,
                           profiler: RecallProfiler | None = None) -> list[SweepPoint]:
    """ScoutAttention as the paper runs it: periodic recall at per-layer intervals profiled offline (section 3.4),
    not the fixed fallback interval. One `scoutbench profile-recall` per distinct ScoutAttention configuration
    (budget, block size, other fields), on the sweep's model at its shortest length, written into the sweep folder
    as `recall_profile-<hash>.json` (kept: a rerun reuses it, so point ids and results stay stable). Points that
    set `recall_profile` themselves, or run without periodic recall, are left as they are, and so is every point of
    a synthetic prefill: its random keys churn with no drift to profile (the profile picked interval 1 in every
    layer), so ScoutAttention keeps its fixed interval there, and its results say so (`recall.profile: null`)."""
    from scoutbench.bench.resolve import resolve_prefill
    from scoutbench.methods import build_method
    from scoutbench.results import write_json_atomic

    if resolve_prefill(settings.prefill, settings.model) == "synthetic":
        log("no recall profile: a synthetic prefill has no drift to profile; ScoutAttention keeps its fixed interval")
        return points

    shortest = min(p.length for p in points) if points else 0
    attached: list[SweepPoint] = []
    for point in points:
        method = build_method(point.method, point.args)
        if "recall_profile" in point.args or not getattr(method, "pr", False) or not hasattr(method, "recall_profile"):
            attached.append(point)
            continue
        profile_args = {k: v for k, v in method.config().items() if k not in ("pr", "recall_profile")}
        key = json.dumps([settings.model, settings.dtype, settings.prefill, shortest, profile_args], sort_keys=True,
                         default=str)
        path = out / f"recall_profile-{hashlib.sha1(key.encode()).hexdigest()[:10]}.json"
        if not _is_profile_for(path, json.loads(key)):
            if profiler is None:
                from scoutbench.bench.recall import profile_recall as profiler
            if path.exists():
                log(f"{path.name} is unreadable or was profiled for another configuration; profiling it again")
            log(f"profiling recall intervals for {point.method} ({path.name}, len {format_length(shortest)})")
            profile = profiler(settings.model, shortest, 32, 0.12, batch=1, device=settings.device,
                               dtype=settings.dtype, seed=settings.seed, prefill=settings.prefill,
                               method_args=profile_args)
            write_json_atomic(path, {**profile, "sweep_profile_key": json.loads(key)}, overwrite=True)
        args = dict(point.method_args)
        args["recall_profile"] = str(path)
        attached.append(SweepPoint(point.method, point.length, point.batch, tuple(sorted(args.items()))))
    return attached


def _is_profile_for(path: Path, key: list[Any]) -> bool:
    """Whether `path` is a recall profile made for `key` (model, dtype, prefill, length, method fields), as the
    sweep that wrote it recorded (`sweep_profile_key`): a profile is reused by what it records, not by its name."""
    from scoutbench.input_files import UnusableFile, read_json_file

    try:
        data = read_json_file(path)
    except UnusableFile:
        return False
    return (isinstance(data, dict) and data.get("kind") == "scout_recall_profile"
            and data.get("sweep_profile_key") == key and isinstance(data.get("intervals"), list))


def _entry(point_id: str, point: dict[str, Any], result: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest's line of a point (`SweepPoint.describe()`) and its result (None: pending)."""
    entry = {"id": point_id, "file": f"{point_id}.json", **point,
             "status": "pending" if result is None else result.get("status", "ok"), "error": None}
    if result is not None:
        entry["error"] = result.get("error")
        entry["batch_used"] = (result.get("workload") or {}).get("batch")
        entry["decode_throughput_tok_s"] = result.get("decode_throughput_tok_s")
        entry["decode_step_ms_median"] = (result.get("decode_step_ms") or {}).get("median")
        entry["gpu_idle_frac"] = result.get("gpu_idle_frac")
        entry["main_thread_wait_frac"] = result.get("main_thread_wait_frac")
        entry["step_spread_warning"] = result.get("step_spread_warning")
    return entry


def _read_point(path: Path, stamp: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A finished point's result, or None (absent, unreadable, malformed, or with `stamp` given, made for another
    point or other settings: then it is run again)."""
    from scoutbench.input_files import UnusableFile, read_json_file
    from scoutbench.result_schema import result_problem

    try:
        data = read_json_file(path)
    except UnusableFile:  # a FIFO, a device or an oversized file named like a point is never opened for reading
        return None
    if result_problem(data) is not None or data.get("status") not in ("ok", "failed"):
        return None
    if stamp is None:
        return data
    recorded = data.get("sweep_point")  # what the point is: its settings and identity, not where its files lie
    same = isinstance(recorded, dict) and all(recorded.get(key) == stamp[key] for key in ("settings", "identity"))
    return data if same else None


def _read_manifest(out: Path) -> dict[str, Any] | None:
    from scoutbench.input_files import UnusableFile, read_json_file

    path = out / MANIFEST
    if not os.path.lexists(path):
        return None
    try:
        data = read_json_file(path)
    except UnusableFile as exc:
        raise UsageError(f"{path} is not a readable sweep manifest ({exc}); remove it or use another -o") from None
    if not isinstance(data, dict) or data.get("kind") != "sweep":
        raise UsageError(f"{path} is not a sweep manifest; use another -o folder")
    from scoutbench.result_schema import schema_problem

    problem = schema_problem(data)
    if problem is not None:
        raise UsageError(f"{path}: {problem}; or use another -o folder")
    points = data.get("points")
    if not isinstance(data.get("settings"), dict) or not isinstance(points, list) or not all(
            isinstance(p, dict) and isinstance(p.get("id"), str) for p in points):
        raise UsageError(f"{path} is a malformed sweep manifest (it needs settings and points with ids); remove it "
                         "to rebuild it from the point files, or use another -o")
    return data


def _settings_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    """`steps 2 there vs 4 now, SCOUTBENCH_CPU_ATTENTION 'auto' there vs 'torch' now`: the settings records'
    differences, the environment's by variable (or backend)."""
    def flat(record: dict[str, Any]) -> dict[str, Any]:
        environment = record.get("environment")
        return {**{k: v for k, v in record.items() if k != "environment"},
                **(environment if isinstance(environment, dict) else {"environment": environment})}

    before, after = flat(old), flat(new)
    return ", ".join(f"{k} {before.get(k)!r} there vs {v!r} now" for k, v in after.items() if before.get(k) != v)


def _one_line(result: dict[str, Any]) -> str:
    if result.get("status") != "ok":
        return f"FAILED: {result.get('error')}"
    return (f"{result['decode_throughput_tok_s']:.2f} tok/s, step {result['decode_step_ms']['median']:.1f} ms, "
            f"idle {100 * (wait_frac(result) or 0.0):.1f}%")

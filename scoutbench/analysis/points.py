"""The result-point model that the gates, the report and the projection share: what a result measured (its
`PointKey`), the repeats of one measurement (`Point`, each metric the median over them), labels that name what
varies among points, and the metrics a result carries.

Points match on what was measured (kind, method and its full config, model, dtype, length, batch, and every
other setting that changes the measurement: timed and warm-up steps, seed, prefill, kv_skew, run-level fields such
as dense_layers); two points that differ only in such a setting are not comparable (`mismatched_settings` names
it). Repeats of one point are summarised by their median, which a single slow outlier cannot move. A non-finite
metric, or a throughput or step time that is not positive, is not a measurement (`metric_problem`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scoutbench.errors import UsageError
from scoutbench.result_schema import NON_FINITE_STRINGS
from scoutbench.units import format_length

THROUGHPUT_METRICS = {"decode_throughput_tok_s": True, "decode_step_ms": False}  # name -> higher is better


def canonical_method(name: str) -> str:
    """`full` and `fullkv` are one method; unknown (third-party) names are kept as they are."""
    from scoutbench.methods import METHODS

    try:
        return METHODS.canonical(name)
    except UsageError:
        return name


# Top-level result fields that change what a run measures besides the method config and the workload (which are
# part of a point's identity already): a run-level dense-layer count, an accuracy run's seed and sample limit.
RUN_SETTINGS = ("dense_layers", "seed", "limit")
# Run settings that belong to one method: a ratio pairs FullKV (dense everywhere, dense_layers null) with a sparse
# method (its own dense layers), so they do not split a ratio's groups; each method's own point still keeps them.
_PER_METHOD_SETTINGS = ("dense_layers",)
# Workload fields the key names itself (len, batch) or that only name the workload kind.
_KEYED_WORKLOAD_FIELDS = ("name", "len", "batch")


@dataclass(frozen=True)
class PointKey:
    """What was measured. Two results with equal keys are repeats of one measurement."""

    kind: str
    method: str
    config: str  # the method's full config as canonical JSON
    model: str
    dtype: str
    length: int | None
    batch: int | str | None  # "auto" when each method ran at its own planned maximum (the paper's comparison)
    settings: str = "{}"  # every other measurement-changing setting (point_settings) as canonical JSON

    def describe(self, label: str | None = None) -> str:
        parts = [label or self.method, self.model, self.dtype]
        if self.length is not None:
            parts.append(f"len {format_length(self.length)}")
        if self.batch is not None:
            parts.append(batch_text(self.batch))
        return " ".join(parts)

    def sort_key(self) -> tuple:
        return (self.kind, self.model, self.dtype, self.length or 0, batch_order(self.batch), self.method,
                self.config, self.settings)

    def comparable_part(self) -> tuple:
        """The key without the settings and the dtype: two keys equal here differ only in how they were run."""
        return (self.kind, self.method, self.config, self.model, self.length, self.batch)


def batch_text(batch: int | str) -> str:
    return f"b{batch}" if isinstance(batch, int) else f"batch {batch}"


def batch_order(batch: int | str | None) -> tuple[int, str]:
    """Numeric batches in order, then `auto`."""
    return (batch, "") if isinstance(batch, int) else (1 << 30, str(batch))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _section(result: dict[str, Any], name: str) -> dict[str, Any]:
    """A result's sub-document `name`, or {} where it is missing or not a mapping (a hand-edited or foreign file:
    a key names what it can and never fails)."""
    value = result.get(name)
    return value if isinstance(value, dict) else {}


def point_settings(result: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run that change its numbers and are not named by the rest of the key: the workload's
    timed and warm-up steps, seed, prefill and kv_skew (any workload field but its name, len and batch), and the
    run-level RUN_SETTINGS."""
    settings = {k: v for k, v in _section(result, "workload").items() if k not in _KEYED_WORKLOAD_FIELDS}
    settings.update({name: result[name] for name in RUN_SETTINGS if name in result})
    return settings


def shared_settings(key: PointKey) -> str:
    """The settings a comparison between methods holds equal (a ratio, a report's "vs fullkv"): the point's settings
    less the per-method ones (`_PER_METHOD_SETTINGS`)."""
    return _canonical({k: v for k, v in json.loads(key.settings).items() if k not in _PER_METHOD_SETTINGS})


def config_identity(result: dict[str, Any]) -> dict[str, Any]:
    """The method config as part of a point's identity: a value that names a file in the result's own folder (the
    recall profile a sweep profiles beside its points) is named relative to that folder, so the same sweep run
    into two folders has the same points."""
    config = _section(result, "method_config")
    path = result.get("_path")
    if not isinstance(path, str):
        return config
    folder = Path(path).parent
    return {k: Path(v).name if isinstance(v, str) and _in_folder(Path(v), folder) else v for k, v in config.items()}


def _in_folder(file: Path, folder: Path) -> bool:
    if file.parent == folder:
        return True
    try:
        return file.resolve().parent == folder.resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop or a value no path can be made of
        return False


def point_key(result: dict[str, Any]) -> PointKey:
    model = _section(result, "model")
    workload = _section(result, "workload")
    length = workload.get("len", result.get("max_length"))
    batch = "auto" if _section(result, "batch_plan").get("mode") == "auto" else workload.get("batch")
    return PointKey(
        kind=str(result.get("kind", "?")), method=canonical_method(str(result.get("method", "?"))),
        config=_canonical(config_identity(result)),
        model=str(model.get("name", "?")), dtype=str(model.get("dtype", "?")),
        length=length if isinstance(length, int) and not isinstance(length, bool) else None,
        batch=batch if isinstance(batch, (int, str)) and not isinstance(batch, bool) else None,
        settings=_canonical(point_settings(result)))


def settings_difference(baseline: PointKey, current: PointKey) -> str:
    """`steps 8 in the baseline vs 16 now, kv_skew 0.3 vs 0.075`: what makes two otherwise equal points
    incomparable."""
    base, cur = json.loads(baseline.settings), json.loads(current.settings)
    if baseline.dtype != current.dtype:
        base, cur = {"dtype": baseline.dtype, **base}, {"dtype": current.dtype, **cur}
    parts = [f"{name} {_show(base.get(name))} vs {_show(cur.get(name))}"
             for name in dict.fromkeys([*base, *cur]) if base.get(name) != cur.get(name)]
    if parts:
        parts[0] = parts[0].replace(" vs ", " in the baseline vs ", 1) + " now"
    return ", ".join(parts)


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def device_class(result: dict[str, Any]) -> str:
    return str((result.get("device") or {}).get("class", "unknown"))


def method_label(method: str, config: dict[str, Any], varying: Iterable[str],
                 settings: dict[str, Any] | None = None, varying_settings: Iterable[str] = ()) -> str:
    """`scout budget=1024`: the method plus only those config fields (and run settings, e.g. `steps=8`) that
    differ among the results shown."""
    shown = [f"{k}={config[k]}" for k in sorted(varying) if k in config]
    shown += [f"{k}={(settings or {}).get(k)}" for k in sorted(varying_settings)]
    return " ".join([method, *shown])


def varying_fields(results: list[dict[str, Any]], exclude: Iterable[str] = ()) -> dict[str, set[str]]:
    """Per method, the config fields whose value is not the same in every result of that method."""
    values: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for r in results:
        for k, v in config_identity(r).items():
            values[canonical_method(str(r.get("method")))][k].add(_canonical(v))
    skip = set(exclude)
    return {m: {k for k, seen in fields.items() if len(seen) > 1 and k not in skip} for m, fields in values.items()}


def varying_settings(results: list[dict[str, Any]]) -> set[str]:
    """The run settings (point_settings) whose value is not the same in every result."""
    values: dict[str, set[str]] = defaultdict(set)
    all_settings = [point_settings(r) for r in results]
    names = {name for settings in all_settings for name in settings}
    for settings in all_settings:
        for name in names:
            values[name].add(_canonical(settings.get(name)))
    return {name for name, seen in values.items() if len(seen) > 1}


def as_number(value: Any) -> float | None:
    """A metric's value as a float: a JSON number, or the "nan"/"inf"/"-inf" strings results use for non-finite
    floats (strict JSON has none); None when it is not a number at all."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in NON_FINITE_STRINGS:
        return float(value)
    return None


def metric_problem(name: str, value: float) -> str | None:
    """Why a metric value is not a measurement (then the gate refuses it as INVALID), or None. A throughput or a
    step time must be finite and positive; an accuracy score finite and not negative (0 is a real score)."""
    if not math.isfinite(value):
        return f"{name} is {value}: not a measurement"
    if name in THROUGHPUT_METRICS and value <= 0:
        return f"{name} is {value:g}: a run that decoded cannot take 0 ms or make 0 tok/s"
    if value < 0:
        return f"{name} is {value:g}: below 0"
    return None


def metric_values(result: dict[str, Any]) -> dict[str, tuple[float, bool]]:
    """The gated metrics of one ok result: name -> (value, higher is better). Values are as recorded, non-finite
    ones included (metric_problem judges them)."""
    if result.get("kind") == "throughput":
        out = {}
        tok_s = as_number(result.get("decode_throughput_tok_s"))
        if tok_s is not None:
            out["decode_throughput_tok_s"] = (tok_s, True)
        step = result.get("decode_step_ms")
        median = as_number(step.get("median")) if isinstance(step, dict) else None
        if median is not None:
            out["decode_step_ms"] = (median, False)
        return out
    if result.get("kind") == "accuracy":  # results[task] = {"score": value, "n": count, ...}
        tasks = result.get("results") if isinstance(result.get("results"), dict) else {}
        return {f"{task}.score": (score, True) for task, entry in tasks.items()
                if isinstance(entry, dict) and (score := as_number(entry.get("score"))) is not None}
    return {}


@dataclass
class Point:
    """All results of one measurement on one side, summarised by the median of each metric."""

    key: PointKey
    results: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> list[dict[str, Any]]:
        return [r for r in self.results if r.get("status", "ok") == "ok"]

    @property
    def device_classes(self) -> set[str]:
        return {device_class(r) for r in self.results}

    def metrics(self) -> dict[str, tuple[float, bool]]:
        """Median of each metric over the ok runs; a metric with an invalid value in any run is left out (see
        `invalid`): a NaN must not hide behind the median of its repeats."""
        per_metric: dict[str, list[float]] = defaultdict(list)
        direction: dict[str, bool] = {}
        for r in self.ok:
            for name, (value, higher) in metric_values(r).items():
                per_metric[name].append(value)
                direction[name] = higher
        invalid = self.invalid()
        return {name: (statistics.median(vals), direction[name]) for name, vals in per_metric.items()
                if name not in invalid}

    def invalid(self) -> dict[str, str]:
        """metric -> why one of its recorded values is not a measurement."""
        out: dict[str, str] = {}
        for r in self.ok:
            for name, (value, _) in metric_values(r).items():
                problem = metric_problem(name, value)
                if problem and name not in out:
                    out[name] = problem
        return out

    def error(self) -> str:
        failed = [r for r in self.results if r.get("status", "ok") != "ok"]
        return str(failed[-1].get("error") or failed[-1].get("status")) if failed else ""


def group_points(results: list[dict[str, Any]]) -> dict[PointKey, Point]:
    points: dict[PointKey, Point] = {}
    for r in results:
        key = point_key(r)
        points.setdefault(key, Point(key)).results.append(r)
    return points


def point_labels(results: list[dict[str, Any]]) -> dict[PointKey, str]:
    """Each point's label: its method plus the config fields and run settings that vary among `results`, so two
    different points never share a label."""
    varying = varying_fields(results)
    settings = varying_settings(results)
    labels = {}
    for r in results:
        method = canonical_method(str(r.get("method")))
        labels[point_key(r)] = method_label(method, config_identity(r), varying.get(method, ()), point_settings(r),
                                            settings)
    return labels


def mismatched_settings(baseline: dict[PointKey, Point], current: dict[PointKey, Point]) -> dict[PointKey, str]:
    """Baseline points without an exact match whose current counterpart differs only in its run settings (steps,
    warm-up, seed, prefill, kv_skew, dense layers, dtype): key -> what differs. A gate refuses such points by
    name, never reporting them as merely missing (and the current one as merely new)."""
    by_part: dict[tuple, list[PointKey]] = defaultdict(list)
    for key in current:
        if key not in baseline:
            by_part[key.comparable_part()].append(key)
    out = {}
    for key in baseline:
        if key in current or not baseline[key].ok:
            continue
        others = by_part.get(key.comparable_part())
        if others:
            out[key] = "; ".join(settings_difference(key, other) for other in sorted(others, key=PointKey.sort_key))
    return out

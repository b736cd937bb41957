"""What a usable scoutbench result is: its schema version and the JSON types of its fields, checked before a gate,
report or resume reads it (`result_problem`); values are judged by their readers. Apart from results.py, which
writes and loads results, so that the schema reads on one screen."""

from __future__ import annotations

import json
from typing import Any

# 2: every result kind carries the same envelope (`envelope`); projections and sweep manifests gained `command`
# and `env`. A file of another version is refused (`result_problem`), never read by guessing from missing fields.
SCHEMA_VERSION = 2


# field -> JSON type(s) a result must have when the field is present; `method`, `model`, `kind` are required
_RESULT_FIELDS: dict[str, tuple[type, ...]] = {
    "kind": (str,), "method": (str,), "model": (dict,), "status": (str,), "method_config": (dict,),
    "workload": (dict,), "device": (dict,), "env": (dict,), "results": (dict,), "decode_step_ms": (dict,),
    "latency_breakdown_ms": (dict,), "batch_plan": (dict,), "decode_throughput_tok_s": (int, float),
    "gpu_idle_frac": (int, float, type(None)), "main_thread_wait_frac": (int, float, type(None)),
    "error": (str, type(None)),  # gpu_idle_frac: null off CUDA, main_thread_wait_frac: null on CUDA
}
_REQUIRED_FIELDS = ("kind", "method", "model")
# what every successful throughput result measured: without them it is not a measurement a gate or report can use
_OK_THROUGHPUT_FIELDS = ("decode_throughput_tok_s", "decode_step_ms", "workload")


def _type_names(types: tuple[type, ...]) -> str:
    names = {dict: "object", str: "string", int: "number", float: "number", type(None): "null"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


NON_FINITE_STRINGS = ("nan", "inf", "-inf")  # how _jsonable writes non-finite floats


def _is_number(value: Any) -> bool:
    """A JSON number, or one of the strings this package writes for a non-finite float."""
    if isinstance(value, str):
        return value in NON_FINITE_STRINGS
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _has_type(value: Any, types: tuple[type, ...]) -> bool:
    if float in types and _is_number(value):
        return True
    return isinstance(value, types) and not isinstance(value, bool)


# what each entry of a projection document must have for `report` to tabulate it
_PROJECTION_FIELDS: dict[str, tuple[type, ...]] = {
    "method": (str,), "model": (str,), "len": (int,), "batch": (int,), "decode_throughput_tok_s": (int, float),
    "decode_step_ms": (int, float), "gpu_idle_frac": (int, float), "bound_by": (str,),
    "batch_limited_by": (str, type(None)),
}


def _projection_problem(data: dict[str, Any]) -> str | None:
    hardware = data.get("hardware")
    if not isinstance(hardware, dict) or not isinstance(hardware.get("name"), str) or \
            not isinstance(hardware.get("labels", {}), dict):
        return "malformed projection: no hardware name"
    if not isinstance(data.get("projections"), list):
        return "malformed projection: no projections list"
    for index, entry in enumerate(data["projections"]):
        if not isinstance(entry, dict):
            return f"malformed projection: projections[{index}] is not an object"
        for name, types in _PROJECTION_FIELDS.items():
            if name not in entry and type(None) in types:
                continue
            value = entry.get(name)
            if not isinstance(value, types) or isinstance(value, bool):
                return f"malformed projection: projections[{index}].{name} is not {_type_names(types)}"
    return None


def schema_problem(data: dict[str, Any]) -> str | None:
    """'schema_version 1, this scoutbench reads 2; ...' when `data` was written under another schema, else None."""
    version = data.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        return (f"schema_version {json.dumps(version)}, but this scoutbench reads schema_version {SCHEMA_VERSION}; "
                "rerun it, or read it with the scoutbench version that wrote it "
                f"({data.get('scoutbench_version', 'unknown')})")
    return None


def result_problem(data: Any) -> str | None:
    """Why `data` is not a usable scoutbench result (another schema version, wrong JSON types, missing fields), or
    None if it is. Values are not judged here (a NaN throughput is a result whose metric the gate refuses)."""
    if not isinstance(data, dict) or "schema_version" not in data:
        return "not a scoutbench result (no schema_version)"
    problem = schema_problem(data)
    if problem is not None:
        return problem
    if data.get("kind") == "projection":  # `scoutbench project -o`: per-method entries, no top-level method/model
        return _projection_problem(data)
    missing = [name for name in _REQUIRED_FIELDS if name not in data]
    if missing:
        return f"malformed result: missing {', '.join(missing)}"
    for name, types in _RESULT_FIELDS.items():
        if name in data and not _has_type(data[name], types):
            return f"malformed result: {name} is {type(data[name]).__name__}, expected {_type_names(types)}"
    if not isinstance(data["model"].get("name"), str):
        return "malformed result: model has no name"
    if data["kind"] == "throughput" and data.get("status", "ok") == "ok":
        missing = [name for name in _OK_THROUGHPUT_FIELDS if name not in data]
        if missing:
            return f"malformed throughput result: missing {', '.join(missing)}"
        if not _is_number(data["decode_step_ms"].get("median")):
            return "malformed throughput result: decode_step_ms has no numeric median"
        workload = data["workload"]
        for name in ("len", "batch"):
            if not isinstance(workload.get(name), int) or isinstance(workload.get(name), bool) or workload[name] < 1:
                return f"malformed throughput result: workload.{name} is not a positive integer"
    return None
